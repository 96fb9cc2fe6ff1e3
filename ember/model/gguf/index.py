"""ember's index of a GGUF file's tensors (`_save_index`, `_IndexedFile`): each tensor's type,
shape and place in the file, the architecture and the tensor-name maps, pickled in the GGUF cache
so that a load whose config and tokenizer are cached too neither imports the `gguf` package nor
parses the file's header. Also the GGML tensor type as ember records it (`TensorType`) and the
unmapping of a tensor's file pages (`_drop_pages`), which the parser shares."""

from __future__ import annotations

import contextlib
import logging
import mmap
from typing import Any, NamedTuple

import numpy as np

from ember.model.gguf.cache import _cache_entry, _load_pickle, _save_pickle

logger = logging.getLogger("ember")


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


class _IndexedTensor(NamedTuple):
    name: str
    tensor_type: TensorType
    shape: np.ndarray  # ggml's order, the fastest dim first, as the parser's `Tensor`
    n_bytes: int
    data: np.ndarray  # a view of the map, typed and shaped as `Tensor.data`


# What a file's index records, and its layout's version (a changed layout is not read).
_INDEX_VERSION = 1


class _IndexedFile:
    """A GGUF file read through ember's index of it (`_save_index`): the architecture and
    every tensor's type, shape and place in the file, so that a load whose config and
    tokenizer are cached as well imports neither the `gguf` package nor parses the header
    (about 0.1 s of llama-160m's 0.4 s load, 0.25 s of Gemma 3 270M's). The reader
    interface `load_gguf_model` uses: `architecture`, `tensors`, `drop_pages`, `light`."""

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


def _save_index(
    path: str, file: Any, architecture: str, model_class: str, names: dict[str, str]
) -> None:
    """Record what a light read of `path` gives (`_IndexedFile`; `file`: the parsed file or
    its index), and `names` (the file's tensor names -> `model_class`'s parameter names)
    beside those of other model classes."""
    if isinstance(file, _IndexedFile):
        if file.names.get(model_class) == names:
            return
        index = dict(file.index, names={**file.names, model_class: names})
    else:
        from gguf import GGML_QUANT_SIZES  # only here: an indexed load does not import gguf

        base = file.data.ctypes.data
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
            for t in file.tensors
        ]
        index = {
            "version": _INDEX_VERSION,
            "size": int(file.data.nbytes),
            "architecture": architecture,
            "tensors": tensors,
            "names": {model_class: names},
        }
    _save_pickle(index, _cache_entry(path, "index"))
