"""ember's GGUF reader against what it replaces, file by file: its parse against
`gguf.GGUFReader` (every metadata value and type, every tensor's name, type, shape, offset and
data), its config against `AutoConfig.from_pretrained(dir, gguf_file=name)`, its tokenizer
against `AutoTokenizer.from_pretrained(dir, gguf_file=name)` and its tensor-name map against
`get_gguf_hf_weights_map`, all unpatched. The files: tiny checkpoints written as llama.cpp does
(Llama, Qwen2, Mistral), metadata written here for the other architectures and tokenizers
(Llama with a sentencepiece vocabulary, Qwen3, Gemma 2, Gemma 3), and the real Gemma 3 270M
and SmolLM2 files where installed."""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest
import torch

from ember.model.gguf import hf, names
from ember.model.gguf.reader import ARRAY, STRING, GGUFFile, GGUFFormatError, release
from ember.tools import checkpoints
from ember.tools.gguf_writer import write_gguf

U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32

TINY = ["tiny-llama", "tiny-qwen2", "tiny-mistral"]
WRITTEN = ["llama-spm", "qwen3", "gemma2", "gemma3"]
# Gemma 3 270M's 262k-token vocabulary takes transformers' own GGUF path ~20 s to convert:
# its reference checks run under -m slow; SmolLM2's (49k) in the default run, where installed.
REAL = [pytest.param("gemma3-270m", marks=pytest.mark.slow), "smollm2"]
FILES = TINY + WRITTEN + REAL

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TEXTS = [
    "",
    "Hello world, the quick brown fox 123",
    "the lazy dog. THE LAZY DOG!",
    " leading space",
    "  two leading, trailing  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "ünïcödé, 日本語, émoji 🙂 and ÿ",
    "   ",
]
WORDS = "the quick brown fox jumps over lazy dog hello world".split()


def _spm_vocab(specials: list[str], user: list[str]) -> tuple[list[str], list[float], list[int]]:
    """A sentencepiece vocabulary as llama.cpp writes one (tokenizer model "llama"): control
    tokens, byte tokens, "▁"-prefixed pieces of a few words (every substring, so that merges
    can be derived), a token of two spaces (as Gemma files spell it) and user-defined tokens."""
    pieces = {c for w in WORDS for c in w} | {"▁"}
    for w in WORDS:
        for word in (w, "▁" + w):
            pieces |= {word[i:j] for i in range(len(word)) for j in range(i + 2, len(word) + 1)}
    normal = sorted(pieces, key=lambda p: (len(p), p)) + ["  "]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *normal, *user]
    types = [3] * len(specials) + [6] * 256 + [1] * len(normal) + [4] * len(user)
    return tokens, [-float(i) for i in range(len(tokens))], types


def _write_model(path: str, arch: str, keys: dict, tokenizer: dict, tie: bool) -> str:
    """A GGUF file of architecture `arch`: 2 layers, hidden size 64, values no config class has
    as its default (`keys` add to or replace them), the tokenizer `tokenizer` (key suffix ->
    value) and a few F32 tensors."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(320)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(12345.0)
    writer.add_layer_norm_rms_eps(3e-6)
    for key, (value, vtype) in keys.items():
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    for key, value in tokenizer.items():
        if isinstance(value, list):
            writer.add_array(f"tokenizer.{key}", value)
        elif isinstance(value, bool):
            writer.add_bool(f"tokenizer.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"tokenizer.{key}", value)
        else:
            writer.add_string(f"tokenizer.{key}", value)
    vocab = len(tokenizer["ggml.tokens"])
    writer.add_tensor("token_embd.weight", np.zeros((vocab, 64), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    if not tie:
        writer.add_tensor("output.weight", np.zeros((vocab, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_spm() -> tuple[dict, dict]:
    """Llama 2 / TinyLlama files: a sentencepiece vocabulary, merges derived from its scores."""
    tokens, scores, types = _spm_vocab(["<unk>", "<s>", "</s>"], [])
    tokenizer = {"ggml.model": "llama", "ggml.tokens": tokens, "ggml.scores": scores}
    tokenizer |= {"ggml.token_type": types, "ggml.unknown_token_id": 0, "ggml.bos_token_id": 1}
    tokenizer |= {"ggml.eos_token_id": 2, "chat_template": CHATML}
    keys = {"rope.dimension_count": (16, U32), "vocab_size": (len(tokens), U32)}
    # One layer, whose KV head count is an array of one item (a per-layer list, as some
    # llama.cpp architectures write it): transformers reads such an array as its item.
    keys |= {"block_count": (1, U32), "attention.head_count_kv": ([2], gguf.GGUFValueType.ARRAY)}
    return keys, tokenizer


def _qwen3(tiny_qwen2: str) -> tuple[dict, dict]:
    """Qwen2's byte-level vocabulary and merges, a ChatML template, a pad token, no BOS."""
    meta = GGUFFile(tiny_qwen2).metadata
    tokenizer = {k.removeprefix("tokenizer."): v for k, v in meta.items() if ".ggml." in k}
    tokenizer |= {"ggml.pre": "qwen2", "ggml.padding_token_id": 2, "ggml.add_bos_token": False}
    tokenizer |= {"chat_template": CHATML}
    return {"attention.key_length": (16, U32)}, tokenizer


def _gemma(arch: str) -> tuple[dict, dict]:
    """Gemma 2 and 3: a sentencepiece vocabulary with control, byte and user-defined tokens
    and one of two spaces, merges derived from its order; no vocab_size key."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens, scores, types = _spm_vocab(specials, ["<think>"])
    tokenizer = {"ggml.model": "llama", "ggml.pre": "default", "ggml.tokens": tokens}
    tokenizer |= {"ggml.scores": scores, "ggml.token_type": types, "ggml.padding_token_id": 0}
    tokenizer |= {"ggml.eos_token_id": 1, "ggml.bos_token_id": 2, "ggml.unknown_token_id": 3}
    tokenizer |= {"ggml.add_bos_token": True, "ggml.add_eos_token": False}
    tokenizer |= {"ggml.add_space_prefix": False, "chat_template": GEMMA_CHAT}
    keys = {"attention.key_length": (16, U32), "attention.value_length": (16, U32)}
    keys |= {"attention.sliding_window": (8, U32)}
    if arch == "gemma2":
        keys |= {"attn_logit_softcapping": (50.0, F32), "final_logit_softcapping": (30.0, F32)}
    return keys, tokenizer


def _written(root: str, name: str, tiny_qwen2: str) -> str:
    """The files whose metadata is written here (see the module doc)."""
    path = os.path.join(root, f"{name}.gguf")
    if name == "llama-spm":
        return _write_model(path, "llama", *_llama_spm(), tie=False)
    if name == "qwen3":
        return _write_model(path, "qwen3", *_qwen3(tiny_qwen2), tie=True)
    return _write_model(path, name, *_gemma(name), tie=True)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """`gguf_path(name)` -> the GGUF file `name` of `FILES` (skips a real file not installed)."""
    from ember.tools.checkpoints import build_checkpoint

    root = str(tmp_path_factory.mktemp("gguf-reader"))
    made: dict[str, str] = {}

    def path(name: str) -> str:
        if name in made:
            return made[name]
        if name in TINY:
            qtype = {"tiny-qwen2": "Q4_0"}.get(name, "Q8_0")
            tie = {"tie_word_embeddings": True} if name == "tiny-qwen2" else {}
            ckpt = build_checkpoint(os.path.join(root, f"{name}-hf"), name, **tie)
            made[name] = write_gguf(ckpt, os.path.join(root, f"{name}.gguf"), qtype)
        elif name in WRITTEN:
            made[name] = _written(root, name, path("tiny-qwen2"))
        else:
            real = checkpoints.gemma3_270m() if name == "gemma3-270m" else None
            real = checkpoints.default_model(download=False) if name == "smollm2" else real
            if real is None:
                pytest.skip(f"the {name} GGUF file is not installed")
            made[name] = real
        return made[name]

    return path


@pytest.fixture(scope="module")
def reference():
    """`reference(kind, path)`: transformers' or gguf's own reading of `path`, unpatched, made
    once per file (the real files' take seconds): "reader", "config", "tokenizer"."""
    from transformers import AutoConfig, AutoTokenizer

    done: dict[tuple[str, str], object] = {}
    build = {
        "reader": lambda d, n: gguf.GGUFReader(os.path.join(d, n)),
        "config": lambda d, n: AutoConfig.from_pretrained(d, gguf_file=n, local_files_only=True),
        "tokenizer": lambda d, n: AutoTokenizer.from_pretrained(
            d, gguf_file=n, local_files_only=True
        ),
    }

    def get(kind: str, path: str) -> object:
        if (kind, path) not in done:
            done[kind, path] = build[kind](*os.path.split(path))
        return done[kind, path]

    return get


def _assert_parse_equal(ours: GGUFFile, theirs, light: bool = False) -> None:
    """Every metadata key, in order, with its value (and each item's Python type) and its
    types; the header's counts; every tensor's name, type, shape, element and byte counts,
    offset and data view. A light parse: the long arrays in `skipped` with their lengths."""
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.types) == keys
    header = [theirs.fields[f"GGUF.{n}_count"].contents() for n in ("tensor", "kv")]
    header.insert(0, theirs.fields["GGUF.version"].contents())
    assert [ours.version, ours.tensor_count, ours.kv_count] == header
    for key in keys:
        field, want = theirs.fields[key], theirs.fields[key].contents()
        types = [int(t) for t in field.types]
        if types == [ARRAY]:  # gguf leaves out an empty array's item type
            assert ours.types[key][0] == ARRAY and want == [], key
        else:
            assert list(ours.types[key]) == types, key
        if light and key in ours.skipped:
            assert ours.skipped[key] == len(want) >= 64 and key not in ours.metadata, key
            continue
        got = ours.metadata[key]
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert a.shape.dtype == b.shape.dtype and list(a.shape) == list(b.shape), a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert a.data.ctypes.data - ours.data.ctypes.data == b.data_offset, a.name
        assert np.array_equal(a.data, b.data, equal_nan=a.data.dtype.kind == "f"), a.name


@pytest.mark.parametrize("name", FILES)
def test_gguf_file_parse_equals_the_gguf_packages(name, gguf_path, reference):
    path = gguf_path(name)
    theirs = reference("reader", path)
    _assert_parse_equal(GGUFFile(path), theirs)
    _assert_parse_equal(GGUFFile(path, light=True), theirs, light=True)


@pytest.mark.parametrize("name", FILES)
def test_gguf_config_equals_transformers(name, gguf_path, reference):
    path = gguf_path(name)
    config = hf.gguf_config(GGUFFile(path), os.path.dirname(path))
    want = reference("config", path)
    assert type(config) is type(want)
    assert config.to_dict() == want.to_dict()


def _assert_same_tokenizer(ours, theirs) -> None:
    """Class, arguments, backend (normalizer, pre-tokenizer, model, post-processor, added
    tokens: its JSON), special tokens, chat template, and the ids and text of `TEXTS` and of
    the special tokens themselves."""
    assert type(ours) is type(theirs)
    assert ours.init_kwargs == theirs.init_kwargs
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    assert {i: repr(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: repr(t) for i, t in theirs.added_tokens_decoder.items()
    }
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
        theirs.unk_token_id,
    )
    assert ours.chat_template == theirs.chat_template
    specials = "".join(theirs.all_special_tokens)
    for text in [*TEXTS, specials, f"{specials} hello {specials}world"]:
        for add in (True, False):
            ids = theirs.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, text
            assert ours.decode(ids) == theirs.decode(ids), text
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
                ids, skip_special_tokens=True
            )
    if theirs.chat_template:
        chat = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi"}]
        kw = dict(add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(chat, **kw) == theirs.apply_chat_template(chat, **kw)


@pytest.mark.parametrize("name", FILES)
def test_gguf_tokenizer_equals_transformers(name, gguf_path, reference):
    path = gguf_path(name)
    directory = os.path.dirname(path)
    assert not {"tokenizer.json", "tokenizer_config.json"} & set(os.listdir(directory))
    file = GGUFFile(path)
    ours = hf.gguf_tokenizer(file, hf.gguf_config(file, directory), directory)
    _assert_same_tokenizer(ours, reference("tokenizer", path))


@pytest.mark.parametrize("name", FILES)
def test_weights_map_equals_transformers(name, gguf_path):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    path = gguf_path(name)
    file = GGUFFile(path, light=True)
    config = hf.gguf_config(file, os.path.dirname(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    arch = file.architecture
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    want = get_gguf_hf_weights_map(model, processor, model_type=arch)
    assert names.weights_map(model, processor, arch) == want
    assert {t.name for t in file.tensors} <= set(want)


# Metadata value types' struct formats (the GGUF spec's numbering).
_FORMATS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))


def _value(vtype: int, value) -> bytes:
    if vtype == STRING:
        data = value.encode()
        return struct.pack("<Q", len(data)) + data
    if vtype == ARRAY:  # value: (item type, items)
        item_type, items = value
        return struct.pack("<IQ", item_type, len(items)) + b"".join(
            _value(item_type, v) for v in items
        )
    return struct.pack("<" + _FORMATS.get(vtype, "I"), value)  # an unknown type: 4 bytes


def _raw_gguf(version: int, kvs: list, tensors: list, alignment: int = 32) -> bytes:
    """A GGUF file's bytes: `kvs` (key, type, value), `tensors` (name, ggml dims, type id,
    data bytes), each tensor's data aligned to `alignment`."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, vtype, value in kvs:
        out += _value(STRING, key) + struct.pack("<I", vtype) + _value(vtype, value)
    offset, data = 0, b""
    for name, dims, type_id, raw in tensors:
        offset = -(-len(data) // alignment) * alignment
        data = data.ljust(offset, b"\0") + raw
        info = struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)
        out += _value(STRING, name) + info
    return out.ljust(-(-len(out) // alignment) * alignment, b"\0") + data


def _every_type(version: int = 3) -> bytes:
    """Every value type alone and in arrays (long and short, empty, nested), odd strings, a
    64-byte alignment, and tensors of value and block types, 1-, 2- and 3-D."""
    kvs = [("general.architecture", STRING, "llama"), ("general.alignment", 4, 64)]
    samples = {0: 200, 1: -100, 2: 60000, 3: -30000, 4: 4000000000, 5: -2000000000, 6: 0.1}
    samples |= {7: True, 10: 2**63 + 5, 11: -(2**62), 12: 1 / 3}
    for vtype, value in samples.items():
        kvs.append((f"test.scalar.{vtype}", vtype, value))
        kvs.append((f"test.short.{vtype}", ARRAY, (vtype, [value] * 3)))
        kvs.append((f"test.long.{vtype}", ARRAY, (vtype, [value, samples[7]] * 40)))
    strings = ["", "a", "été", "<|im_end|>", "▁the", "x" * 300, "日本🙂"]
    kvs += [("test.string", STRING, "café"), ("test.empty", STRING, "")]
    kvs += [("test.strings", ARRAY, (STRING, strings * 20)), ("test.one", ARRAY, (STRING, ["z"]))]
    kvs += [("test.none", ARRAY, (4, [])), ("test.nested", ARRAY, (ARRAY, [(4, [1, 2]), (4, [3])]))]
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), 8)
    tensors = [
        ("a", (4, 3), 0, np.arange(12, dtype=np.float32).tobytes()),
        ("b", (5,), 1, np.arange(5, dtype=np.float16).tobytes()),
        ("c", (64, 2), 8, q8.tobytes()),
        ("d", (2, 2, 2), 26, np.arange(8, dtype=np.int32).tobytes()),
    ]
    return _raw_gguf(version, kvs, tensors, alignment=64)


@pytest.mark.parametrize("version", [2, 3])
def test_every_value_type_and_layout_parses_as_the_gguf_package_reads_it(version, tmp_path):
    path = tmp_path / "types.gguf"
    path.write_bytes(_every_type(version))
    ours = GGUFFile(str(path))
    assert ours.metadata["test.nested"] == [[1, 2], [3]]
    assert ours.types["test.nested"] == (ARRAY, ARRAY, 4) and ours.types["test.none"] == (ARRAY, 4)
    assert ours.alignment == 64 and ours.data_offset % 64 == 0
    theirs = gguf.GGUFReader(str(path))
    del theirs.fields["test.nested"]  # its `contents()` flattens arrays of arrays
    del ours.types["test.nested"], ours.metadata["test.nested"]
    _assert_parse_equal(ours, theirs)
    light = GGUFFile(str(path), light=True)
    assert light.skipped == {f"test.long.{t}": 80 for t in range(13) if t not in (8, 9)} | {
        "test.strings": 140
    }
    assert light.metadata["test.short.6"] == ours.metadata["test.short.6"]
    assert [t.name for t in light.tensors] == list("abcd")


def _broken(kind: str) -> bytes:
    good = _every_type()
    if kind == "magic":
        return b"GGUX" + good[4:]
    if kind in ("version", "big-endian"):
        version = struct.pack("<I", 1) if kind == "version" else struct.pack(">I", 3)
        return good[:4] + version + good[8:]
    if kind == "truncated-metadata":
        return good[:200]
    if kind == "truncated-data":
        return good[:-8]
    arch = [("general.architecture", STRING, "llama")]
    tensor = [("t", (4,), 0, bytes(16))]
    cases = {
        "value-type": [("k", 13, 0)],
        "duplicate-key": [("k", 4, 1), ("k", 4, 2)],
        "alignment": [("general.alignment", 4, 48)],
        "alignment-type": [("general.alignment", 10, 64)],
    }
    if kind in cases:
        return _raw_gguf(3, arch + cases[kind], tensor)
    if kind == "tensor-type":
        return _raw_gguf(3, arch, [("t", (4,), 77, bytes(16))])
    assert kind == "duplicate-tensor"
    return _raw_gguf(3, arch, tensor * 2)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("magic", "not a GGUF file"),
        ("version", "GGUF version 1"),
        ("big-endian", "big-endian"),
        ("truncated-metadata", "truncated|unpack_from requires"),
        ("truncated-data", "truncated: tensor d ends past the end"),
        ("value-type", "unknown type 13"),
        ("duplicate-key", "'k' appears twice"),
        ("alignment", "not a uint32 power of 2"),
        ("alignment-type", "not a uint32 power of 2"),
        ("tensor-type", "unknown tensor type 77"),
        ("duplicate-tensor", "tensor 't' appears twice"),
    ],
)
def test_malformed_files_are_named(kind, message, tmp_path):
    from ember.errors import UnsupportedModelError
    from ember.model.gguf.reader import _open

    path = tmp_path / f"{kind}.gguf"
    path.write_bytes(_broken(kind))
    with pytest.raises((GGUFFormatError, struct.error), match=message):
        GGUFFile(str(path))
    with pytest.raises(UnsupportedModelError, match=f"cannot read GGUF file .*({message})"):
        _open(str(path))


def test_a_file_without_a_tokenizer_gives_none_and_says_so(tmp_path, caplog):
    """As before: only token-id prompts work; the config is still read."""
    path = tmp_path / "no-tokenizer.gguf"
    arch = [("general.architecture", STRING, "llama"), ("llama.block_count", 4, 1)]
    path.write_bytes(_raw_gguf(3, arch, [("token_embd.weight", (4, 2), 0, bytes(32))]))
    try:
        assert hf.load_gguf_config(str(path)).num_hidden_layers == 1
        with caplog.at_level("WARNING", logger="ember"):
            assert hf.load_gguf_tokenizer(str(path)) is None
    finally:
        release(str(path))
    assert "no tokenizer in" in caplog.text
