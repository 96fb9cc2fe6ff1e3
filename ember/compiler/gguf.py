"""GGUF files (llama.cpp's format): the config, tokenizer and weights of one `.gguf` file, mapped
to the transformers model of its architecture, whose code then runs unmodified.

Metadata, tokenizer (with its chat template) and the tensor-name mapping come from transformers'
own GGUF support (`gguf_file=`, `get_gguf_hf_weights_map`, the per-architecture tensor
processors: the reverse of llama.cpp's Q/K row permutation, Gemma's norm offset); the file is
read with the `gguf` package. What transformers does not do is keep the weights quantized: its
loader dequantizes every tensor to fp32. Here each tensor is placed in the model as it is read:

- Q8_0, Q4_0 and Q4_1 linear weights become `GroupLinear`s holding the file's codes and scales
  exactly (fp16 scales, 8- or 4-bit codes, multiplied by ember's int8 dot-product kernel); a
  table in one of those types becomes a `GroupEmbedding` over the same codes, shared with a
  tied LM head;
- Q4_K weights (most of a Q4_K_M file) and Q6_K weights (a Q4_K_M file's LM head and half its
  V and down projections, and the head of most Q4_0 files) are kept as they are, in
  super-blocks of 256: 4-bit codes with a 6-bit scale and offset per 32 and fp16 d and dmin
  per 256, and 6-bit codes with an int8 scale per 16 and fp16 d per 256 (4.5 and 6.56 bits a
  weight, as in the file);
- Q5_0 weights become 5-bit codes exactly (5.5 bits a weight, as in the file); every other
  quantized type (Q5_K, Q5_1, IQ*) is
  dequantized tensor by tensor (the `gguf` package's numpy reference) and requantized to 8-bit
  groups of 32;
- F32, F16 and BF16 tensors keep their type: linears become `PackedLinear`s (F16 packed as fp16
  and widened exactly), packed straight from the file's map, and a table tied to the LM head
  becomes a `PackedEmbedding` over the packed head; a quantized tensor that fits no group
  layout is dequantized to bf16.

The model is built on the meta device, so nothing is allocated for a weight until its tensor is
read, and the file's memory map is dropped after loading: the process holds about the file's
size.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import mmap
import os
import pickle
import struct
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from ember import kernels
from ember.compiler.hf_config import UnsupportedModelError
from ember.compiler.quant import (
    BLOCK_TYPES,
    FUSED_PROJECTIONS,
    GROUP_SIZE,
    Blocks,
    GroupEmbedding,
    GroupLinear,
    PackedEmbedding,
    PackedLinear,
    Rows,
    SuperRows,
    cat_biases,
    gathers_rows,
    place_fused,
    quantize_groups,
    row_chunk,
)
from ember.host import (
    HeapTrimmer,
    private_dir,
    prune_cache,
    touch,
    user_cache_dir,
    weight_arena,
    weight_zeros,
)

logger = logging.getLogger("ember")

# general.architecture values ember loads (Mistral files say "llama"; Gemma 3's text model).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


_readers: dict[str, Any] = {}  # path -> its reader, from the config read until the model is built


def _reader(path: str, light: bool = False) -> Any:
    """The file's `GGUFReader` (memory-mapped), parsed once per load: the config, the tokenizer
    and the weights all read it. `light`: a reader that skipped the metadata's large arrays
    (the vocabulary) is enough; a full one is opened when only a light one is at hand.
    `UnsupportedModelError` naming the problem for a missing, truncated or malformed file or
    an unknown tensor type."""
    key = os.path.abspath(path)
    reader = _readers.get(key)
    if reader is None or (reader.light and not light):
        reader = (_open_indexed(path) if light else None) or _open(path, light)
        _readers[key] = reader
    return reader


def release(path: str) -> None:
    """Drop the cached reader of `path`, and with it the file's memory map."""
    _readers.pop(os.path.abspath(path), None)


# A light reader skips metadata arrays longer than this (vocabulary, scores, merges).
_LIGHT_ARRAY_MIN = 64


def _open(path: str, light: bool = False) -> Any:
    try:
        from gguf import GGUFReader, GGUFValueType
    except ImportError as e:  # pragma: no cover - a dependency of ember
        raise UnsupportedModelError("loading a GGUF file needs the `gguf` package") from e

    class Reader(GGUFReader):  # type: ignore[misc, valid-type]
        """Parses the metadata from a plain ndarray view of the map (numpy's memmap subclass
        costs per element read), and metadata arrays of `_LIGHT_ARRAY_MIN` or more elements
        (a 262k-token vocabulary is three of them) a whole array at a time: Gemma 3 270M's
        full parse took 8.2 s through the memmap, 4.4 s from the plain view, 0.7 s now.

        `light`: those arrays are stepped over, their fields left without data (0.08 s for
        Gemma 3's): for loads whose config and tokenizer come from ember's cache, which read
        only the architecture and tensors."""

        light = False

        @property
        def data(self) -> np.ndarray:
            return self._array

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._array = np.asarray(value)  # a view: its base keeps the map open
            self._map = getattr(value, "_mmap", None)

        def drop_pages(self, array: np.ndarray) -> None:
            _drop_pages(self._map, self._array, array)

        def _get_field_parts(self, offs: int, raw_type: int) -> tuple[int, list, list, list]:
            if raw_type == GGUFValueType.ARRAY and self.byte_order == "I":
                head = [self._get(offs, np.uint32), self._get(offs + 4, np.uint64)]
                itype, count = GGUFValueType(int(head[0][0])), int(head[1][0])
                if count >= _LIGHT_ARRAY_MIN and itype != GGUFValueType.ARRAY:
                    return self._array_parts(offs, head, itype, count)
            return super()._get_field_parts(offs, raw_type)

        def _array_parts(
            self, offs: int, head: list, itype: Any, count: int
        ) -> tuple[int, list, list, list]:
            """A long array of scalars or strings in the parts gguf's own parser gives (`head`:
            its item type and count, then one part per scalar, or a length part and a bytes
            part per string), made by whole-array numpy operations instead of two reads per
            element; a light reader leaves them out."""
            buf, start = self._array, offs + 12
            types = [GGUFValueType.ARRAY, itype]
            if itype == GGUFValueType.STRING:
                spans, end = [], start  # (start, length) of each string
                for _ in range(count):
                    (length,) = struct.unpack_from("<Q", buf, end)
                    spans.append((end, length))
                    end += 8 + length
                if self.light:
                    return end - offs, [], [], types
                parts: list = [*head]
                for at, length in spans:
                    parts.append(buf[at : at + 8].view(np.uint64))
                    parts.append(buf[at + 8 : at + 8 + length])
                return end - offs, parts, list(range(3, 2 + 2 * count, 2)), types
            dtype = np.dtype(self.gguf_scalar_to_np[itype])
            end = start + count * dtype.itemsize
            if self.light:
                return end - offs, [], [], types
            values = buf[start:end].view(dtype).reshape(count, 1)
            return end - offs, [*head, *values], list(range(2, 2 + count)), types

    class LightReader(Reader):
        light = True

    if not os.path.isfile(path):
        raise ValueError(f"model: GGUF file {path!r} does not exist")
    try:
        return LightReader(path) if light else Reader(path)
    except (
        ValueError,
        OSError,
        IndexError,
        KeyError,
        TypeError,
        AssertionError,
        struct.error,
    ) as e:
        if "GGMLQuantizationType" in str(e):
            problem = f"unknown tensor type ({e})"
        else:
            problem = f"truncated or not a GGUF file ({e})"
        raise UnsupportedModelError(f"cannot read GGUF file {path!r}: {problem}") from e


def _drop_pages(file_map: mmap.mmap | None, whole: np.ndarray, array: np.ndarray) -> None:
    """Unmap the file pages under `array` (a view of `whole`, all of `file_map`) from this
    process: a tensor's bytes, once converted, stop counting in its RSS (the kernel's page
    cache keeps them; reading them again faults them back in)."""
    if file_map is None or array.base is None:
        return
    start = array.ctypes.data - whole.ctypes.data
    if not 0 <= start < whole.nbytes:
        return
    page = mmap.PAGESIZE
    first = start // page * page
    end = min(start + array.nbytes, whole.nbytes)
    with contextlib.suppress(OSError, ValueError):
        file_map.madvise(mmap.MADV_DONTNEED, first, end - first)


class TensorType(int):
    """A GGML tensor type as `gguf.GGMLQuantizationType` (an IntEnum) is, equal to and hashed
    as its number, with its `name`, and `block`: (values, bytes) of one block, as in
    `gguf.GGML_QUANT_SIZES`; for tensors read from ember's index without importing gguf."""

    name: str
    block: tuple[int, int]

    def __new__(cls, value: int, name: str, block: tuple[int, int]) -> TensorType:
        obj = super().__new__(cls, value)
        obj.name, obj.block = name, block
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return TensorType, (int(self), self.name, self.block)


def _block_size(qtype: Any) -> tuple[int, int]:
    """(values, bytes) of one block of GGML type `qtype`."""
    if isinstance(qtype, TensorType):
        return qtype.block
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype]


class _IndexedTensor(NamedTuple):
    name: str
    tensor_type: TensorType
    shape: np.ndarray  # ggml's order, the fastest dim first, as gguf's `ReaderTensor`
    n_bytes: int
    data: np.ndarray  # a view of the map, typed and shaped as `ReaderTensor.data`


# What a file's index records, and its layout's version (a changed layout is not read).
_INDEX_VERSION = 1


class _IndexedFile:
    """A GGUF file read through ember's index of it (`_save_index`): the architecture and
    every tensor's type, shape and place in the file, so that a load whose config and
    tokenizer are cached as well imports neither the `gguf` package nor parses the header
    (about 0.1 s of llama-160m's 0.4 s load, 0.25 s of Gemma 3 270M's). The reader
    interface `load_gguf_model` uses: `tensors`, `drop_pages`, `light`."""

    light = True

    def __init__(self, path: str, index: dict[str, Any]) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        if self._array[:4].tobytes() != b"GGUF" or self._array.nbytes != index["size"]:
            raise ValueError("the file is not the one indexed")
        self.architecture: str = index["architecture"]
        self.names: dict[str, dict[str, str]] = index["names"]
        self.index = index
        self.tensors = []
        for name, qtype, shape, n_bytes, offset, dtype, data_shape in index["tensors"]:
            if offset + n_bytes > self._array.nbytes:
                raise ValueError(f"tensor {name} ends past the file")
            raw = self._array[offset : offset + n_bytes]
            data = raw.view(np.dtype(dtype)).reshape(data_shape)
            self.tensors.append(_IndexedTensor(name, qtype, shape, n_bytes, data))

    def drop_pages(self, array: np.ndarray) -> None:
        _drop_pages(self._map, self._array, array)


def _open_indexed(path: str) -> _IndexedFile | None:
    """`path` read through its cached index, or None: not indexed yet, or an index that does
    not fit the file (logged; the file is parsed again and the index rewritten)."""
    index = _load_pickle(_cache_entry(path, "index"), "index")
    if not isinstance(index, dict) or index.get("version") != _INDEX_VERSION:
        return None
    try:
        return _IndexedFile(path, index)
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("reading GGUF file %s again: its cached index does not fit (%s)", path, e)
        return None


def _save_index(path: str, reader: Any, model_class: str, names: dict[str, str]) -> None:
    """Record what a light read of `path` gives (`_IndexedFile`), and `names` (the file's
    tensor names -> `model_class`'s parameter names) beside those of other model classes."""
    if isinstance(reader, _IndexedFile):
        if reader.names.get(model_class) == names:
            return
        index = dict(reader.index, names={**reader.names, model_class: names})
    else:
        from gguf import GGML_QUANT_SIZES

        base = reader.data.ctypes.data
        tensors = [
            (
                t.name,
                TensorType(int(t.tensor_type), t.tensor_type.name, GGML_QUANT_SIZES[t.tensor_type]),
                np.array(t.shape),
                int(t.n_bytes),
                int(t.data.ctypes.data - base),
                t.data.dtype.str,
                tuple(t.data.shape),
            )
            for t in reader.tensors
        ]
        index = {
            "version": _INDEX_VERSION,
            "size": int(reader.data.nbytes),
            "architecture": _architecture(reader, path),
            "tensors": tensors,
            "names": {model_class: names},
        }
    _save_pickle(index, _cache_entry(path, "index"))


@contextlib.contextmanager
def _shared_reader(path: str) -> Iterator[None]:
    """transformers' GGUF code opens the file itself (`gguf.GGUFReader(path)`): hand it the
    reader already parsed."""
    import gguf

    shared, original, key = _reader(path), gguf.GGUFReader, os.path.abspath(path)

    def reader(p: Any, *args: Any, **kwargs: Any) -> Any:
        return shared if os.path.abspath(p) == key else original(p, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        with _fast_value_parser():
            yield
    finally:
        gguf.GGUFReader = original


_GGUF_INTS, _GGUF_FLOATS, _GGUF_STRING, _GGUF_ARRAY = (0, 1, 2, 3, 4, 5, 10, 11), (6, 12), 8, 9


@contextlib.contextmanager
def _fast_value_parser() -> Iterator[None]:
    """transformers parses every metadata value through `_gguf_parse_value`, which decodes a
    string by way of a list of its byte values: 1.4 s for Gemma 3's 262k-token vocabulary.
    Strings and plain numbers (alone or in arrays) are parsed directly, to the same values;
    everything else goes to transformers' own parser. Left alone where transformers has no
    such function."""
    from transformers import modeling_gguf_pytorch_utils as utils

    original = getattr(utils, "_gguf_parse_value", None)
    if original is None:
        yield
        return

    def parse(value: Any, data_type: Any) -> Any:
        types = data_type if isinstance(data_type, list) else [data_type]
        if len(types) == 1 or (len(types) == 2 and types[0] == _GGUF_ARRAY):
            item = types[-1]
            if item == _GGUF_STRING:
                return bytes(value).decode()
            if item in _GGUF_INTS:
                return int(value[0])
            if item in _GGUF_FLOATS:
                return float(value[0])
        return original(value, data_type)

    utils._gguf_parse_value = parse
    try:
        yield
    finally:
        utils._gguf_parse_value = original


@contextlib.contextmanager
def _name_maps_built_once() -> Iterator[None]:
    """transformers' `get_gguf_hf_weights_map` recurses over the model's modules and builds
    gguf's `TensorNameMap` afresh in each call (313 times, 1.6 s, for Gemma 3 270M); it only
    reads the map, so one per (architecture, layers) serves them all."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _architecture(reader: Any, path: str) -> str:
    if isinstance(reader, _IndexedFile):
        arch = reader.architecture
    else:
        field = reader.fields.get("general.architecture")
        if field is None:
            raise UnsupportedModelError(f"GGUF file {path!r} has no general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode()
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF file {path!r}: architecture {arch!r} is not supported by ember "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _matrix_types(path: str) -> Counter[str]:
    """How many 2-D tensors of each type the file holds, from its (light) reader."""
    tensors = _reader(path, light=True).tensors
    return Counter(t.tensor_type.name for t in tensors if len(t.shape) > 1)


def weight_types(path: str) -> Counter[str]:
    """How many 2-D tensors of each type the file holds (for reports)."""
    try:
        return _matrix_types(path)
    finally:
        release(path)


def has_quantized_weights(path: str) -> bool:
    """Whether any 2-D tensor of the file is of a quantized type (not one of `DENSE_TYPES`).
    Reads the reader the load's config step left open (no second parse; the load releases
    it)."""
    return any(t not in DENSE_TYPES for t in _matrix_types(path))


def load_gguf_config(path: str) -> PretrainedConfig:
    """The transformers config of a GGUF file (metadata only; tensors are not read). Cached as
    the tokenizer is (`load_gguf_tokenizer`); when both are, the file is opened with a light
    reader, which skips the vocabulary."""
    entry = _cache_entry(path, "config")
    config = _load_pickle(entry, "config")
    if config is not None:
        tokenizer_entry = _cache_entry(path, "tokenizer")
        light = tokenizer_entry is not None and os.path.isfile(tokenizer_entry)
        _architecture(_reader(path, light=light), path)
        return config
    _architecture(_reader(path), path)
    directory, name = os.path.split(os.path.abspath(path))
    try:
        with _shared_reader(path):
            config = AutoConfig.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise UnsupportedModelError(f"cannot read the config of GGUF file {path!r}: {e}") from e
    _save_pickle(config, entry)
    return config


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The file's tokenizer and chat template through transformers' GGUF converter, or None
    (logged) when it has none that transformers can build.

    The converted tokenizer is pickled into the user cache (a private directory, as the
    compile cache), keyed by the file's path, size and mtime and the transformers/tokenizers
    versions, and later loads unpickle it: for a 262k-token vocabulary (Gemma 3) converting
    takes about 5 s, `from_pretrained` of a saved copy 2.7 s, unpickling 1.1 s."""
    entry = _cache_entry(path, "tokenizer")
    tokenizer = _load_pickle(entry, "tokenizer")
    if tokenizer is not None:
        return tokenizer
    directory, name = os.path.split(os.path.abspath(path))
    try:
        with _shared_reader(path):
            tokenizer = AutoTokenizer.from_pretrained(
                directory, gguf_file=name, local_files_only=True
            )
    except (OSError, ValueError, TypeError, KeyError) as e:
        logger.warning("no tokenizer in %s (%s); only token-id prompts work", path, e)
        return None
    _save_pickle(tokenizer, entry)
    return tokenizer


# The converted configs and tokenizers kept (least recently used first out): a Gemma 3
# tokenizer pickles to 14 MB.
GGUF_CACHE_MAX_BYTES = 512 << 20


# Changes when what ember writes there changes (2: tokenizers with "a b" merges, indexes).
_CACHE_LAYOUT = 2


def file_identity(path: str) -> tuple[str, int, int] | None:
    """(real path, size, mtime in ns) of the file `path`, what ember's caches of it are keyed
    by; None where it is missing."""
    real = os.path.realpath(path)
    try:
        stat = os.stat(real)
    except OSError:
        return None
    return real, stat.st_size, stat.st_mtime_ns


def _cache_entry(path: str, what: str) -> str | None:
    """Where ember keeps `what` ("config", "tokenizer", "index") converted from the GGUF file
    `path`: `~/.cache/ember/gguf/<key>-<what>.pkl`, the key from the file's real path, size
    and mtime, the transformers/tokenizers versions and `_CACHE_LAYOUT`. None: no usable cache
    directory, or no file."""
    import tokenizers
    import transformers

    file = file_identity(path)
    if file is None:  # missing: `_open` names the problem
        return None
    real, size, mtime = file
    ident = f"{real}\0{size}\0{mtime}"
    ident += f"\0{transformers.__version__}\0{tokenizers.__version__}\0{_CACHE_LAYOUT}"
    parent = private_dir(user_cache_dir("gguf"), "GGUF cache")
    if parent is None:
        return None
    return os.path.join(parent, f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}-{what}.pkl")


def _load_pickle(entry: str | None, what: str) -> Any:
    """The object cached at `entry`, or None (missing; unreadable: logged, converted again)."""
    if entry is None or not os.path.isfile(entry):
        return None
    try:
        with open(entry, "rb") as f:
            obj = pickle.load(f)
    except Exception as e:  # noqa: BLE001  (any unpickling failure: convert again)
        logger.warning("converting the %s again: cannot read %s (%s)", what, entry, e)
        return None
    touch(entry)
    return obj


class _Pickler(pickle.Pickler):
    """Pickles a `tokenizers.Tokenizer` as its JSON (as the Tokenizer does itself) with a BPE
    model's merges in the "a b" form, which `Tokenizer.from_str` reads faster than pairs: Gemma
    3's 515k merges unpickle in 1.5-1.7 s instead of 1.9-2.1 (the same tokenizer: `to_str`
    gives back the same JSON). Kept as pairs where a merged token has a space in it."""

    def reducer_override(self, obj: Any) -> Any:
        import tokenizers

        if type(obj) is not tokenizers.Tokenizer:
            return NotImplemented
        state = json.loads(obj.to_str())
        model = state.get("model") or {}
        merges = model.get("merges")
        if model.get("type") == "BPE" and merges and all(_joinable(m) for m in merges):
            model["merges"] = [" ".join(m) for m in merges]
        return tokenizers.Tokenizer.from_str, (json.dumps(state, ensure_ascii=False),)


def _joinable(merge: Any) -> bool:
    return (
        isinstance(merge, list)
        and len(merge) == 2
        and all(isinstance(part, str) and part and " " not in part for part in merge)
    )


def _save_pickle(obj: Any, entry: str | None) -> None:
    """Pickle into a fresh file beside `entry`, then rename it: a reader never sees a
    half-written one."""
    if entry is None:
        return
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(entry))
    try:
        with os.fdopen(fd, "wb") as f:
            _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        os.replace(tmp, entry)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        logger.debug("not cached in %s: %s", entry, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return
    prune_cache(os.path.dirname(entry), GGUF_CACHE_MAX_BYTES, keep=entry)


def _blocks(raw: np.ndarray, rows: int, block_bytes: int) -> torch.Tensor:
    """A quantized tensor's bytes [rows, row bytes] as [rows, blocks, block_bytes] (a copy)."""
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1, block_bytes).copy())


Release = Callable[[np.ndarray], None] | None


def _converter(qtype: Any) -> tuple[int, Callable[[np.ndarray], Rows | SuperRows]]:
    """The code width of a quantized GGUF type in a `GroupLinear`, and its rows' converter."""
    name = qtype.name
    if name in KEPT_TYPES:
        return (8 if name == "Q8_0" else 4), functools.partial(_block_rows, qtype=name)
    if name == "Q4_K":
        return 4, _q4_k_rows
    if name == "Q6_K":
        return 6, _q6_k_rows
    if name == "Q5_0":
        return 5, _q5_0_rows
    return 8, functools.partial(_values_rows, tensor_type=qtype)


def _row_chunks(
    raw: np.ndarray, qtype: Any, release: Release
) -> Iterator[Rows | SuperRows | Blocks]:
    """(codes, scales, mins) of `raw` (a `qtype` tensor's bytes, one row of blocks per output
    channel) a `row_chunk()` of rows at a time, for `GroupLinear.from_row_chunks`: a
    conversion's temporaries (codes one byte a value, widened copies) exist for one chunk at a
    time; over a whole embedding at once they took ~7x its bytes (qwen2-0.5b Q4_0: +1,000 MB
    of peak RSS for a 350 MB file). Chunks of `BLOCK_TYPES` go to the kernels' packer as
    they are (`Blocks`) once the kernels are built (qwen2-0.5b Q4_0 loads in ~1 s instead of
    3.3; the converters here are its reference and serve while a first build compiles).
    `release(part)`, when given, is called with each chunk's bytes once they are packed (the
    loader drops their file pages and trims the heap)."""
    _, convert = _converter(qtype)
    values, nbytes = _block_size(qtype)
    k = raw.shape[1] // nbytes * values
    step = row_chunk(k)
    packer = qtype.name in BLOCK_TYPES and kernels.ready()
    for r in range(0, raw.shape[0], step):
        part = raw[r : r + step]
        yield Blocks(_bytes(part), k, qtype.name) if packer else convert(part)
        if release is not None:  # the chunk is packed
            release(part)


def group_linear_from_file(
    raw: np.ndarray, qtype: Any, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """A quantized GGUF weight (`raw`: its bytes, `qtype`: its `GGMLQuantizationType`) as a
    `GroupLinear`, converted a chunk of rows at a time (see `group_linear_from_blocks` and
    `group_linear_from_values` for what each type becomes)."""
    bits, _ = _converter(qtype)
    return GroupLinear.from_row_chunks(raw.shape[0], bits, _row_chunks(raw, qtype, release), bias)


def fused_group_linear(
    parts: list[tuple[np.ndarray, Any, torch.Tensor | None]], release: Release = None
) -> GroupLinear:
    """One `GroupLinear` computing the weights `parts` ((bytes, type, bias) of projections of
    one type and input size, each but the last filling whole panels) side by side, converted
    straight into the fused layout (`fuse_projections_` would copy every projection again)."""
    bits, _ = _converter(parts[0][1])
    rows = sum(raw.shape[0] for raw, _, _ in parts)
    chunks = itertools.chain.from_iterable(_row_chunks(raw, q, release) for raw, q, _ in parts)
    bias = cat_biases([b for _, _, b in parts], [len(raw) for raw, _, _ in parts])
    return GroupLinear.from_row_chunks(rows, bits, chunks, bias)


def _bytes(part: np.ndarray) -> torch.Tensor:
    """A chunk of a tensor's bytes as a uint8 tensor, without a copy (the packer only reads
    it; the file's map is read-only)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(part, dtype=np.uint8))


def _block_rows(raw: np.ndarray, qtype: str) -> Rows:
    """(codes, scales, mins) of rows of a Q8_0 / Q4_0 / Q4_1 tensor, exactly."""
    rows = raw.shape[0]
    if qtype == "Q8_0":
        blocks = _blocks(raw, rows, 2 + GROUP_SIZE)
        scales = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
        return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), scales, None
    head = {"Q4_0": 2, "Q4_1": 4}[qtype]
    blocks = _blocks(raw, rows, head + GROUP_SIZE // 2)
    scales = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    mins = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0] if head == 4 else None
    packed = blocks[..., head:]
    return torch.cat((packed & 15, packed >> 4), dim=-1).reshape(rows, -1), scales, mins


def group_linear_from_blocks(
    raw: np.ndarray, qtype: str, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """A `GroupLinear` holding a Q8_0 / Q4_0 / Q4_1 tensor's values exactly. `raw`: the tensor's
    bytes, one row of blocks per output channel (ggml's layout: Q8_0 blocks are fp16 d and 32
    int8 codes; Q4_0 fp16 d and 16 bytes whose low nibbles are codes 0-15 and high nibbles
    16-31; Q4_1 the same after fp16 d and m)."""
    from gguf import GGMLQuantizationType

    return group_linear_from_file(raw, GGMLQuantizationType[qtype], bias, release)


KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# Kept in their own 16/32-bit type.
DENSE_TYPES = ("F32", "F16", "BF16")


def _q4_k_rows(raw: np.ndarray) -> SuperRows:
    """Rows of a Q4_K tensor as they are (see `group_linear_from_q4_k`)."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 144)
    supers = blocks.shape[1]
    d = torch.from_numpy(blocks[..., 0:2].copy()).view(torch.float16)[..., 0]  # [rows, supers]
    dmin = torch.from_numpy(blocks[..., 2:4].copy()).view(torch.float16)[..., 0]
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    qs = blocks[..., 16:].reshape(rows, supers, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    codes = (qs & 15).reshape(rows, -1)
    return SuperRows(
        torch.from_numpy(codes),
        torch.from_numpy(sc.reshape(rows, -1).astype(np.uint8)),
        torch.from_numpy(m.reshape(rows, -1).astype(np.uint8)),
        d,
        -dmin,
    )


def group_linear_from_q4_k(
    raw: np.ndarray, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """A Q4_K weight as a 4-bit `GroupLinear` with offsets. A Q4_K super-block of 256 values is
    fp16 d and dmin, twelve bytes of 6-bit scales sc and offsets m (one pair per sub-block of
    32), then 128 bytes whose low nibbles are the codes of sub-block 2i and high nibbles of
    2i + 1 (bytes 32i to 32i + 31): w = d sc q - dmin m, kept as it is in super-block panels
    (4.5 bits a weight and 32 bits of d and -dmin per 256; see `GroupLinear`)."""
    from gguf import GGMLQuantizationType

    return group_linear_from_file(raw, GGMLQuantizationType.Q4_K, bias, release)


def _q6_k_rows(raw: np.ndarray) -> SuperRows:
    """Rows of a Q6_K tensor as they are (see `group_linear_from_q6_k`)."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 210)
    supers = blocks.shape[1]
    ql = blocks[..., :128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    qh = qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    codes = (ql & 15).reshape(rows, supers, 8, 32) | (qh & 3).reshape(rows, supers, 8, 32) << 4
    sc = blocks[..., 192:208].copy().view(np.int8)
    d = torch.from_numpy(blocks[..., 208:210].copy()).view(torch.float16)[..., 0]
    return SuperRows(
        torch.from_numpy(codes.reshape(rows, -1)),
        torch.from_numpy(sc.reshape(rows, -1)),
        None,
        d,
        None,
    )


def group_linear_from_q6_k(
    raw: np.ndarray, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """A Q6_K weight as a 6-bit `GroupLinear`. A Q6_K super-block of 256 values is 128 bytes
    of low nibbles, 64 bytes of high pairs, 16 int8 scales sc (one per 16 values) and fp16 d:
    w = d sc (q - 32), q in [0, 63], in the order of the `gguf` package's dequantizer; kept
    as it is in super-block panels (6.5 bits a weight and 16 bits of d per 256)."""
    from gguf import GGMLQuantizationType

    return group_linear_from_file(raw, GGMLQuantizationType.Q6_K, bias, release)


def _q5_0_rows(raw: np.ndarray) -> Rows:
    """(codes, scales, None) of rows of a Q5_0 tensor, exactly: a block is fp16 d, 32 high
    bits, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31; the value is
    d (q - 16), q = nibble | high bit << 4 in [0, 31]."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 2 + 4 + GROUP_SIZE // 2)
    scales = torch.from_numpy(blocks[..., :2].copy()).view(torch.float16)[..., 0]
    qh = blocks[..., 2:6].copy().view(np.uint32)  # [rows, blocks, 1]
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1
    packed = blocks[..., 6:]
    low = np.concatenate((packed & 15, packed >> 4), axis=-1)
    codes = (low | (high.astype(np.uint8) << 4)).reshape(rows, -1)
    return torch.from_numpy(codes), scales, None


def _values_rows(raw: np.ndarray, tensor_type: Any) -> Rows:
    from gguf import dequantize

    values = torch.from_numpy(dequantize(np.ascontiguousarray(raw), tensor_type))
    codes, scales, _ = quantize_groups(values, 8, symmetric=True)
    return codes, scales, None


def group_linear_from_values(
    raw: np.ndarray, tensor_type: Any, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """Any other quantized weight as a `GroupLinear`: Q4_K as 4-bit groups with offsets
    (`group_linear_from_q4_k`), Q6_K as 6-bit codes (`group_linear_from_q6_k`), Q5_0 as 5-bit
    codes exactly (`_q5_0_rows`); every other type
    (Q5_K, Q5_1, IQ*) dequantized by the `gguf` package and requantized to 8-bit groups of 32
    (Q8_0's rule)."""
    return group_linear_from_file(raw, tensor_type, bias, release)


def _dense(tensor: Any, qtype: str, data: np.ndarray) -> torch.Tensor:
    """A tensor that is not kept quantized: F32/F16/BF16 as they are (a 2-D one in the load's
    weight arena, see `weights_arena`), anything else dequantized to bf16. `data` is already
    row-processed (Q/K permutation)."""
    view = _dense_view(tensor, qtype, data)
    if view is not None:
        out = weight_zeros(tuple(view.shape), view.dtype) if view.dim() == 2 else None
        return view.clone() if out is None else out.copy_(view)
    from gguf import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest dim first
    values = dequantize(np.ascontiguousarray(data), tensor.tensor_type)
    return torch.from_numpy(values).reshape(shape).to(torch.bfloat16)


def _dense_view(tensor: Any, qtype: str, data: np.ndarray) -> torch.Tensor | None:
    """An F32/F16/BF16 tensor's values as a tensor over `data` (the file's map, read-only:
    for reading only), without a copy; None for other types."""
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(qtype)
    if dtype is None:
        return None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest dim first
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(raw).view(dtype).reshape(shape)


def _permute_rows(processor: Any, name: str, data: np.ndarray) -> np.ndarray:
    """transformers' processing of a tensor whose rows are output channels: for the supported
    architectures a row permutation (Llama Q/K), or an offset on norms, which are never kept
    quantized."""
    return processor.process(weights=data, name=name).weights


@contextlib.contextmanager
def weights_arena(path: str) -> Iterator[None]:
    """The quantized weights of `path` loaded in this block are packed into one
    `WeightArena`, faulted in by a thread from here on and collapsed into huge pages once the
    engine is ready (see `host.WeightArena`), instead of being built on the heap and copied
    by `move_to_huge_pages`. AMD EPYC (Zen 4, KVM), fresh processes, medians of 5:
    qwen2-0.5b Q4_0 loaded in 1.37 s instead of 1.55 (1.50 with the arena not faulted in
    ahead), peak RSS +384 MB instead of +402; llama-160m Q8_0 0.53 s instead of 0.56, +151
    MB instead of +163. Faulted in as 4 KiB pages and collapsed later: 0.93 s and 0.25 s."""
    packed, panel = 0, kernels.panel_width()
    for tensor in _reader(path, light=True).tensors:
        qtype = tensor.tensor_type
        if qtype.name in DENSE_TYPES and len(tensor.shape) == 2:  # packed, or a copied table
            n, k = int(tensor.shape[1]), int(tensor.shape[0])
            packed += -(-n // panel) * panel * k * tensor.n_bytes // (n * k)
            continue
        if qtype.name in DENSE_TYPES or len(tensor.shape) != 2 or tensor.shape[0] % GROUP_SIZE:
            continue
        bits, _ = _converter(qtype)
        _, offsets, super_blocks = BLOCK_TYPES.get(qtype.name, (bits, False, False))
        n, k = int(tensor.shape[1]), int(tensor.shape[0])
        packed += GroupLinear.packed_nbytes(n, k, bits, offsets, super_blocks)
    # Room for fused groups' and alignment's slack; only `packed` is faulted in ahead.
    with weight_arena(packed + packed // 8 + (4 << 20), packed):
        yield


def load_gguf_model(
    path: str, config: PretrainedConfig, auto_class: Any, attn_implementation: str
) -> nn.Module:
    """The transformers model of `config` with the file's weights (see the module doc)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = _reader(path, light=True)  # tensors and the architecture only
    arch = _architecture(reader, path)
    with torch.device("meta"):
        model = auto_class.from_config(config, attn_implementation=attn_implementation)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    model_class = f"{type(model).__module__}.{type(model).__qualname__}"
    names = reader.names.get(model_class) if isinstance(reader, _IndexedFile) else None
    if names is None:
        # Names by the file's own architecture (Mistral files say "llama", which gguf-py maps).
        with _name_maps_built_once():
            names = get_gguf_hf_weights_map(model, processor, model_type=arch)
        _save_index(path, reader, model_class, names)
    # Each tensor's file pages are dropped from the process once it is converted, and the C
    # heap's freed temporaries returned now and then: qwen2-0.5b Q4_0 (350 MB) loaded with a
    # peak of +1,000 MB over the imports, +800 MB with the conversions chunked alone.
    heap, drop_pages = HeapTrimmer(), reader.drop_pages

    def release(part: np.ndarray) -> None:
        drop_pages(part)
        heap.freed(part.nbytes * 4)  # the chunk's temporaries: about 4 bytes a byte of it

    def place_dense(module: nn.Module, attr: str, tensor: Any, hf_name: str) -> None:
        """`tensor` set as it is (`_dense`), its file pages dropped."""
        data = _permute_rows(processor, tensor.name, tensor.data)
        _set_tensor(module, attr, _dense(tensor, tensor.tensor_type.name, data), hf_name)
        del data
        drop_pages(tensor.data)
        heap.freed(tensor.n_bytes)

    kept: dict[str, Any] = {}  # quantized weights, converted once every bias is in place
    dense: dict[str, Any] = {}  # F32/F16/BF16 linear weights, packed likewise
    tables: dict[str, Any] = {}  # F32/F16/BF16 tables, packed as a tied head or copied
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            logger.info("GGUF tensor %s has no place in %s; skipped", tensor.name, arch)
            continue
        qtype = tensor.tensor_type.name
        module_name, _, attr = hf_name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr == "weight" and qtype not in DENSE_TYPES and _groups_fit(module):
            kept[module_name] = tensor
            continue
        if attr == "weight" and qtype in DENSE_TYPES and len(tensor.shape) == 2:
            if isinstance(module, nn.Linear):
                dense[module_name] = tensor
                continue
            if gathers_rows(module):
                tables[module_name] = tensor
                continue
        place_dense(module, attr, tensor, hf_name)

    def bias_of(module_name: str, tensor: Any) -> torch.Tensor | None:
        """The bias of `module_name`, once its GGUF weight `tensor` is checked against it."""
        module = model.get_submodule(module_name)
        expected = (module.weight.shape[0], module.weight.shape[1])
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml lists the input size first
        if shape != expected:
            raise UnsupportedModelError(
                f"GGUF file {path!r}: {module_name} is {shape[0]}x{shape[1]}, the config says "
                f"{expected[0]}x{expected[1]}"
            )
        bias = getattr(module, "bias", None) if isinstance(module, nn.Linear) else None
        if bias is not None and bias.is_meta:
            raise UnsupportedModelError(f"GGUF file {path!r} has no tensor for {module_name}.bias")
        return bias

    for parent, names, group in _fusable_groups(kept):
        data = [_permute_rows(processor, t.name, t.data) for t in group]
        biases = [bias_of(f"{parent}.{n}", t) for n, t in zip(names, group, strict=True)]
        types = [t.tensor_type for t in group]
        fused = fused_group_linear(list(zip(data, types, biases, strict=True)), release)
        for name, t in zip(names, group, strict=True):
            del kept[f"{parent}.{name}"]
            reader.drop_pages(t.data)
        del data
        place_fused(model.get_submodule(parent), names, [int(t.shape[1]) for t in group], fused)
    for parent, names, group in _fusable_groups(dense):
        biases = [bias_of(f"{parent}.{n}", t) for n, t in zip(names, group, strict=True)]
        packed = _packed_linear(processor, group, biases, reader.drop_pages)
        for name in names:
            del dense[f"{parent}.{name}"]
        place_fused(model.get_submodule(parent), names, [int(t.shape[1]) for t in group], packed)
    for module_name, tensor in dense.items():
        bias = bias_of(module_name, tensor)
        _place(model, module_name, _packed_linear(processor, [tensor], [bias], reader.drop_pages))
    for module_name, tensor in kept.items():
        module = model.get_submodule(module_name)
        bias = bias_of(module_name, tensor)
        data, qtype = _permute_rows(processor, tensor.name, tensor.data), tensor.tensor_type
        linear = group_linear_from_file(data, qtype, bias, release)
        del data
        reader.drop_pages(tensor.data)
        if isinstance(module, nn.Embedding):
            scale = getattr(module, "scalar_embed_scale", None)  # Gemma's scaled table
            _place(
                model, module_name, GroupEmbedding(linear, None if scale is None else float(scale))
            )
        else:
            _place(model, module_name, linear)
    for module_name, tensor in tables.items():  # after the head, which may be quantized
        if not _pack_tied_table(model, module_name, processor, tensor, reader.drop_pages):
            place_dense(model.get_submodule(module_name), "weight", tensor, f"{module_name}.weight")
    del reader, kept, dense, tables
    _tie_head(model, config)
    _materialize_buffers(model)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise UnsupportedModelError(
            f"GGUF file {path!r} has no tensors for {len(missing)} weights of {arch}, e.g. "
            f"{', '.join(missing[:3])}"
        )
    return model.eval().requires_grad_(False)


def _fusable_groups(kept: dict[str, Any]) -> list[tuple[str, tuple[str, ...], list[Any]]]:
    """(parent module, projection names, their GGUF tensors) for each group of
    `FUSED_PROJECTIONS` (q/k/v, gate/up) that converts into one `GroupLinear`: all kept, of one
    quantized type and input size, every part but the last filling whole panels; else its
    longest such prefix of two or more (q/k where llama.cpp's K-quant mixes give v more bits:
    half of a Q4_K_M file's layers, where q/k/v made three calls a step, each quantizing x)."""
    panel = kernels.panel_width()
    groups = []
    for module_name in kept:
        parent, _, child = module_name.rpartition(".")
        for names in FUSED_PROJECTIONS:
            if child != names[0]:
                continue
            tensors = [kept.get(f"{parent}.{n}") for n in names]
            for count in range(len(names), 1, -1):
                part = tensors[:count]
                if any(t is None for t in part):
                    continue
                if len({(t.tensor_type, int(t.shape[0])) for t in part}) != 1:
                    continue  # ggml lists the input size (fastest dim) first
                if any(int(t.shape[1]) % panel for t in part[:-1]):
                    continue
                groups.append((parent, names[:count], part))
                break
    return groups


def _packed_linear(
    processor: Any,
    tensors: list[Any],
    biases: list[torch.Tensor | None],
    drop_pages: Callable[[np.ndarray], None],
) -> PackedLinear:
    """A `PackedLinear` of F32/F16/BF16 GGUF weights (side by side where there are several),
    packed from the file's map, rows in the order `processor` puts them (Llama's Q/K:
    gathered a chunk at a time); each tensor's file pages are dropped as its rows are read."""
    parts, orders = [], []
    for tensor, bias in zip(tensors, biases, strict=True):
        data, order = tensor.data, _row_order(processor, tensor.name, int(tensor.shape[1]))
        if order is False:  # not a permutation: the processor's own copy
            data, order = _permute_rows(processor, tensor.name, data), None
        view = _dense_view(tensor, tensor.tensor_type.name, data)
        assert view is not None
        parts.append((view, bias))
        orders.append(order)

    def done(part: int, start: int, end: int) -> None:
        drop_pages(tensors[part].data[start:end])

    packed = PackedLinear.from_weights(parts, orders, done)
    del parts
    return packed


def _row_order(processor: Any, name: str, rows: int) -> torch.Tensor | None | Literal[False]:
    """What `processor` does to the rows of tensor `name`, found by processing a column of row
    numbers: None where nothing, the rows' new order where it permutes them (Llama's Q/K:
    packed rows are then gathered from the file a chunk at a time, instead of a permuted copy
    of the whole weight), False where it does anything else."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    got = np.asarray(processor.process(weights=index, name=name).weights)
    if got.shape != index.shape:
        return False
    got = got.reshape(rows)
    if np.array_equal(got, index[:, 0]):
        return None
    if not np.array_equal(np.sort(got), index[:, 0]):
        return False
    return torch.from_numpy(got.copy())


def _pack_tied_table(
    model: nn.Module,
    module_name: str,
    processor: Any,
    tensor: Any,
    drop_pages: Callable[[np.ndarray], None],
) -> bool:
    """For a file without `output.weight`, whose LM head is the input table: the head packed
    from the table's F32/F16/BF16 values in the file and the table made a `PackedEmbedding`
    gathering rows of it (held once, as `use_kernel_linears_` does for a checkpoint's tied
    head). False, with nothing changed, where the file has a head or `module_name` is not the
    model's input embedding."""
    head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings()  # type: ignore[operator]
    if (
        not isinstance(head, nn.Linear)
        or not head.weight.is_meta
        or head.bias is not None
        or embed is not model.get_submodule(module_name)
    ):
        return False
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml lists the fastest dim first
    if shape != tuple(head.weight.shape) or shape != tuple(embed.weight.shape):
        raise UnsupportedModelError(
            f"GGUF tensor for {module_name}.weight is {shape}, the config says "
            f"{tuple(embed.weight.shape)}"
        )
    packed = _packed_linear(processor, [tensor], [None], drop_pages)
    scale = getattr(embed, "scalar_embed_scale", None)
    model.lm_head = packed
    model.set_input_embeddings(  # type: ignore[operator]
        PackedEmbedding(embed, packed, None if scale is None else float(scale))
    )
    return True


def _groups_fit(module: nn.Module) -> bool:
    """A linear, or a table whose lookup is a plain row gather (times a constant scale: Gemma's
    `scalar_embed_scale`)."""
    if isinstance(module, nn.Linear):
        return module.weight.shape[1] % GROUP_SIZE == 0
    return gathers_rows(module)


def _set_tensor(module: nn.Module, attr: str, value: torch.Tensor, hf_name: str) -> None:
    current = getattr(module, attr)
    if tuple(current.shape) != tuple(value.shape):
        raise UnsupportedModelError(
            f"GGUF tensor for {hf_name} is {tuple(value.shape)}, the config says "
            f"{tuple(current.shape)}"
        )
    param = nn.Parameter(value, requires_grad=False)
    param._is_hf_initialized = True  # type: ignore[attr-defined]
    module._parameters[attr] = param


def _place(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _tie_head(model: nn.Module, config: PretrainedConfig) -> None:
    """A file without `output.weight` ties the LM head to the table: the same Parameter, or
    the same `GroupLinear` when the table is kept quantized."""
    head = getattr(model, "lm_head", None)
    if head is None or not isinstance(head, nn.Linear) or not head.weight.is_meta:
        return
    embed = model.get_input_embeddings()  # type: ignore[operator]
    if isinstance(embed, GroupEmbedding):
        model.lm_head = embed.table
    else:
        head.weight = embed.weight


def _materialize_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary inv_freq) were built on the meta device: allocate them and
    let transformers initialize them as from_pretrained does (every loaded weight is marked
    initialized, so only they are touched)."""
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner._buffers[attr] = torch.empty_like(buf, device="cpu")
    for module in model.modules():
        if not any(p.is_meta for p in module.parameters(recurse=False)):
            for p in module.parameters(recurse=False):
                p._is_hf_initialized = True  # type: ignore[attr-defined]
        if isinstance(module, (GroupLinear, GroupEmbedding)):
            module._is_hf_initialized = True  # type: ignore[attr-defined]
    model.initialize_weights()  # type: ignore[operator]
