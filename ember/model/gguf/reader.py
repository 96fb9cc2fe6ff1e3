"""Reading a GGUF file: the `gguf` package's reader made fast for large metadata arrays (and a
light one that skips them), ember's own index of a file's tensors, the architecture check, and
the tensor-type counts."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
from collections import Counter
from typing import Any, NamedTuple

import numpy as np

from ember.errors import UnsupportedModelError
from ember.model.gguf.cache import _cache_entry, _load_pickle, _save_pickle

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


KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# Kept in their own 16/32-bit type.
DENSE_TYPES = ("F32", "F16", "BF16")
