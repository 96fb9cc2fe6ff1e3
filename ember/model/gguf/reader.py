"""Reading a GGUF file (llama.cpp's format, versions 2 and 3): ember's own parser of the header,
the typed metadata and the tensor index, each tensor's data a typed view of the file's memory map
(`GGUFFile`); the file's parse kept for one load (`_reader`, `release`), the architecture check
and the tensor-type counts. The `gguf` package gives the tensor types (`GGMLQuantizationType`,
`GGML_QUANT_SIZES`); nothing of its reader is used."""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections import Counter
from typing import Any, NamedTuple

import numpy as np

from ember.errors import UnsupportedModelError
from ember.model.gguf.index import TensorType, _drop_pages, _IndexedFile, _open_indexed

# general.architecture values ember loads (Mistral files say "llama"; Gemma 3's text model).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2moe", "qwen3moe")

# Metadata value types, numbered as in the GGUF spec (and `gguf.GGUFValueType`).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13)
)
# The fixed-size ones: (little-endian numpy type, struct format).
_SCALAR_FORMATS = {
    UINT8: ("<u1", "<B"),
    INT8: ("<i1", "<b"),
    UINT16: ("<u2", "<H"),
    INT16: ("<i2", "<h"),
    UINT32: ("<u4", "<I"),
    INT32: ("<i4", "<i"),
    FLOAT32: ("<f4", "<f"),
    BOOL: ("?", "<?"),
    UINT64: ("<u8", "<Q"),
    INT64: ("<i8", "<q"),
    FLOAT64: ("<f8", "<d"),
}
_SCALAR_DTYPES = {t: np.dtype(dtype) for t, (dtype, _) in _SCALAR_FORMATS.items()}
_SCALARS = {t: struct.Struct(fmt) for t, (_, fmt) in _SCALAR_FORMATS.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")  # item type, count
_TENSOR_TAIL = struct.Struct("<IQ")  # tensor type, offset in the data section
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count

VERSIONS = (2, 3)  # version 1 counted in 32 bits; llama.cpp has not written it since 2023
_DEFAULT_ALIGNMENT = 32

# A light parse steps over metadata arrays this long or longer (vocabulary, scores, merges).
_LIGHT_ARRAY_MIN = 64

# Tensor types whose data is values (the rest are blocks of bytes), by `GGMLQuantizationType` name.
_VALUE_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file ember can read; the message says why."""


class Skipped(NamedTuple):
    """A metadata array a light parse stepped over, and how long it is."""

    count: int


class Tensor(NamedTuple):
    """One tensor of the file, as `gguf.ReaderTensor` describes it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # uint64, ggml's order: the fastest dim first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    # A view of the map: the values of a value type ([..., fastest dim]), else the bytes
    # ([..., bytes a row]) as uint8 (BF16 included).
    data: np.ndarray


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise GGUFFormatError("truncated: a string runs past the end of the file")
    return str(buf[pos + 8 : end], "utf-8"), end


def _strings(buf: mmap.mmap, pos: int, count: int, keep: bool) -> tuple[list[str], int]:
    """`count` strings from `pos` (an empty list where not `keep`: stepped over), and the
    offset past them. The loop is what a 262k-token vocabulary costs (0.1 s; 0.02 s stepped
    over), so it is kept to one unpack and one slice a string."""
    unpack, out = _U64.unpack_from, []
    if keep:
        append = out.append
        for _ in range(count):
            (length,) = unpack(buf, pos)
            pos += 8
            append(str(buf[pos : pos + length], "utf-8"))
            pos += length
    else:
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
    if pos > len(buf):
        raise GGUFFormatError("truncated: a string array runs past the end of the file")
    return out, pos


def _array(buf: mmap.mmap, pos: int, light: bool) -> tuple[Any, tuple[int, ...], int]:
    """An array value at `pos`: (its items as a list, or `Skipped` where `light` steps over
    it; its types: ARRAY and the items' types; the offset past it)."""
    item_type, count = _ARRAY_HEAD.unpack_from(buf, pos)
    pos += _ARRAY_HEAD.size
    skip = light and count >= _LIGHT_ARRAY_MIN
    dtype = _SCALAR_DTYPES.get(item_type)
    if dtype is not None:
        end = pos + count * dtype.itemsize
        if end > len(buf):
            raise GGUFFormatError("truncated: an array runs past the end of the file")
        if skip:
            return Skipped(count), (ARRAY, item_type), end
        return np.frombuffer(buf, dtype, count, pos).tolist(), (ARRAY, item_type), end
    if item_type == STRING:
        values, pos = _strings(buf, pos, count, keep=not skip)
        return (Skipped(count) if skip else values), (ARRAY, STRING), pos
    if item_type == ARRAY:  # arrays of arrays: no architecture ember loads writes them
        items, types = [], (ARRAY, ARRAY)
        for i in range(count):
            item, item_types, pos = _array(buf, pos, light=False)
            items.append(item)
            types = (ARRAY, *item_types) if i == 0 else types
        return items, types, pos
    raise GGUFFormatError(f"metadata array of unknown value type {item_type}")


def _value(buf: mmap.mmap, pos: int, value_type: int, light: bool) -> tuple[Any, tuple, int]:
    """A metadata value at `pos`: (the value, its types as `gguf.ReaderField.types` lists
    them, the offset past it)."""
    scalar = _SCALARS.get(value_type)
    if scalar is not None:
        return scalar.unpack_from(buf, pos)[0], (value_type,), pos + scalar.size
    if value_type == STRING:
        value, pos = _string(buf, pos)
        return value, (STRING,), pos
    if value_type == ARRAY:
        return _array(buf, pos, light)
    raise GGUFFormatError(f"metadata value of unknown type {value_type}")


class GGUFFile:
    """A GGUF file parsed: its `version`, `metadata` (key -> value: int, float, bool, str, or
    a list for an array), each value's `types` (its type, and for an array ARRAY and the
    items' types), its `tensors` (each one's data a view of the read-only memory map), the
    data section's `alignment` and `data_offset`. Long metadata arrays (a 262k-token
    vocabulary is three) are read a whole array at a time: Gemma 3 270M parses in 0.13 s
    (`gguf.GGUFReader`: 8 s; ember's subclass of it, which replaced its private array
    parser, 0.45 s).

    `light`: metadata arrays of `_LIGHT_ARRAY_MIN` or more items are stepped over, their
    keys and lengths in `skipped` instead of `metadata` (Gemma 3's in 0.02 s): for loads
    whose config and tokenizer come from ember's cache, which read only the architecture
    and the tensors. Raises `GGUFFormatError` (or `struct.error`, `UnicodeDecodeError`, an
    `OSError`) for a file it cannot read."""

    def __init__(self, path: str, light: bool = False) -> None:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < _HEADER.size:
                raise GGUFFormatError("truncated: shorter than a GGUF header")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, dtype=np.uint8)  # the whole file
        self.light = light
        self.metadata: dict[str, Any] = {}
        self.types: dict[str, tuple[int, ...]] = {}
        self.skipped: dict[str, int] = {}
        pos = self._header()
        for _ in range(self.kv_count):
            pos = self._field(pos)
        infos, pos = self._tensor_infos(pos)
        self.alignment = self._alignment()
        self.data_offset = -(-pos // self.alignment) * self.alignment
        self.tensors = self._tensors(infos)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def drop_pages(self, array: np.ndarray) -> None:
        """Unmap the file pages under `array` (a tensor's data) from this process."""
        _drop_pages(self._map, self.data, array)

    def _header(self) -> int:
        magic, version, self.tensor_count, self.kv_count = _HEADER.unpack_from(self._map, 0)
        if magic != b"GGUF":
            raise GGUFFormatError("not a GGUF file (no GGUF magic)")
        if version & 0xFFFF == 0 and version:
            raise GGUFFormatError("a big-endian GGUF file; only little-endian files are read")
        if version not in VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} (versions {VERSIONS} are read)")
        self.version = version
        return _HEADER.size

    def _field(self, pos: int) -> int:
        key, pos = _string(self._map, pos)
        (value_type,) = _U32.unpack_from(self._map, pos)
        value, types, pos = _value(self._map, pos + 4, value_type, self.light)
        if key in self.types:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        self.types[key] = types
        if isinstance(value, Skipped):
            self.skipped[key] = value.count
        else:
            self.metadata[key] = value
        return pos

    def _tensor_infos(self, pos: int) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
        """(name, dims in ggml's order, type id, offset in the data section) of each tensor,
        and the offset past the tensor index."""
        infos = []
        for _ in range(self.tensor_count):
            name, pos = _string(self._map, pos)
            (n_dims,) = _U32.unpack_from(self._map, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, pos + 4)
            type_id, offset = _TENSOR_TAIL.unpack_from(self._map, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + _TENSOR_TAIL.size
            infos.append((name, dims, type_id, offset))
        return infos, pos

    def _alignment(self) -> int:
        if "general.alignment" not in self.types:
            return _DEFAULT_ALIGNMENT
        alignment = self.metadata["general.alignment"]
        if self.types["general.alignment"] != (UINT32,) or alignment & (alignment - 1) != 0:
            raise GGUFFormatError(f"general.alignment {alignment!r} is not a uint32 power of 2")
        if alignment == 0:
            raise GGUFFormatError("general.alignment is 0")
        return int(alignment)

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], int, int]]) -> list[Tensor]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensors, names = [], set()
        for name, dims, type_id, offset in infos:
            if name in names:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            names.add(name)
            try:
                tensor_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFFormatError(f"unknown tensor type {type_id} (tensor {name})") from None
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            n_elements = math.prod(dims)
            n_bytes = n_elements * block_bytes // block
            start = self.data_offset + offset
            if start + n_bytes > self.data.nbytes:
                raise GGUFFormatError(f"truncated: tensor {name} ends past the end of the file")
            shape = tuple(reversed(dims))  # numpy's order: the fastest dim last
            dtype = _VALUE_DTYPES.get(tensor_type.name)
            if dtype is None:  # blocks: [..., bytes a row]
                if not shape or shape[-1] % block:
                    raise GGUFFormatError(f"tensor {name}: rows of whole {tensor_type.name} blocks")
                dtype, shape = np.uint8, (*shape[:-1], shape[-1] // block * block_bytes)
            data = self.data[start : start + n_bytes].view(dtype).reshape(shape)
            shape_ggml = np.array(dims, dtype=np.uint64)
            tensors.append(Tensor(name, tensor_type, shape_ggml, n_elements, n_bytes, start, data))
        return tensors


_readers: dict[str, Any] = {}  # path -> its parse, from the config read until the model is built


def _reader(path: str, light: bool = False) -> GGUFFile | _IndexedFile:
    """The file parsed (memory-mapped) once per load: the config, the tokenizer and the weights
    all read it. `light`: a parse that stepped over the metadata's long arrays (the
    vocabulary), or ember's index of the file, is enough; the file is parsed in full when
    only a light one is at hand. `UnsupportedModelError` naming the problem for a missing,
    truncated or malformed file or an unknown tensor type."""
    key = os.path.abspath(path)
    reader = _readers.get(key)
    if reader is None or (reader.light and not light):
        reader = (_open_indexed(path) if light else None) or _open(path, light)
        _readers[key] = reader
    return reader


def release(path: str) -> None:
    """Drop the cached parse of `path`, and with it the file's memory map."""
    _readers.pop(os.path.abspath(path), None)


def _open(path: str, light: bool = False) -> GGUFFile:
    if not os.path.isfile(path):
        raise ValueError(f"model: GGUF file {path!r} does not exist")
    try:
        return GGUFFile(path, light)
    except GGUFFormatError as e:
        raise UnsupportedModelError(f"cannot read GGUF file {path!r}: {e}") from e
    except (OSError, ValueError, struct.error, OverflowError) as e:
        problem = f"truncated or not a GGUF file ({e})"
        raise UnsupportedModelError(f"cannot read GGUF file {path!r}: {problem}") from e


def _block_size(qtype: Any) -> tuple[int, int]:
    """(values, bytes) of one block of GGML type `qtype`."""
    if isinstance(qtype, TensorType):
        return qtype.block
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype]


def _architecture(reader: GGUFFile | _IndexedFile, path: str) -> str:
    arch = reader.architecture
    if arch is None:
        raise UnsupportedModelError(f"GGUF file {path!r} has no general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF file {path!r}: architecture {arch!r} is not supported by ember "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _matrix_types(path: str) -> Counter[str]:
    """How many 2-D tensors of each type the file holds, from its (light) parse."""
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
    Reads the parse the load's config step left open (no second parse; the load releases
    it)."""
    return any(t not in DENSE_TYPES for t in _matrix_types(path))


KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# Kept in their own 16/32-bit type.
DENSE_TYPES = ("F32", "F16", "BF16")
