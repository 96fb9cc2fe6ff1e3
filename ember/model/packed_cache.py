"""A model as ember's loader built it (from a GGUF file or a checkpoint's safetensors), kept on
disk and mapped back on later loads.

Loading a GGUF file lays its weights out in the kernels' panels (`GroupLinear`, `PackedLinear`);
loading a checkpoint fuses its projections and repacks or quantizes its linears. Either way
the whole model is written into fresh anonymous memory, and on the VMs ember is measured on,
faulting fresh memory in costs more than the packing itself (AMD EPYC, KVM: ~40 ms per 128 MB
in 4 KiB pages, 60-225 ms as huge pages, while a mapped file in the page cache reads at ~6 ms
per 128 MB), and the two contend for the process's two cores with the load's Python. So after
a first load, ember writes the model it built to a file in its cache (`~/.cache/ember/weights`),
and a later load of the same file maps that file back, as llama.cpp maps its GGUF file:
no packing, no fresh memory, the page cache's pages shared by every process that loads it.

The entry is keyed by everything the built model depends on: the weight files (real path,
size, mtime of each), ember's sources, the torch and transformers versions, the kernels'
panel width and ISA, the attention implementation, the model class and config, and for a
checkpoint the dtypes and quantization it was loaded with. It is one file: `_MAGIC`, the
pickle's offset and length, the tensors' bytes (each storage's used range, placed at the same
offset within a page as in memory, so every tensor keeps its alignment), then a pickle of the
model whose tensors are persistent ids into those bytes. The map is private (copy on write): a
write to a weight never reaches the file. Pickles run code when loaded, so the directory is
one that `private_dir` accepts (owned by this user, not writable by others).

`EMBER_WEIGHTS_CACHE_GB` caps the directory (least recently used entries out first; default
8, 0 turns the cache off); an entry larger than the cap is not written. Anything that cannot
be written (an unpicklable object in the model, a full disk) is logged and the load goes on;
an entry that cannot be read is loaded afresh and written again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import mmap
import os
import pickle
import struct
import tempfile
import threading
from typing import Any

import torch
from torch import nn

from ember.host.dirs import private_dir, prune_cache, touch, user_cache_dir
from ember.host.memory import register_file_map
from ember.keys import entry_dir, file_identity, sources_fingerprint

logger = logging.getLogger(__name__)

_MAGIC = b"EMBERPK1"
_HEADER = struct.Struct("<8sQQ")  # magic, pickle offset, pickle length
_PAGE = 4096
# Changes when the entry's format changes.
_FORMAT = 1


def max_bytes() -> int:
    """The cache's cap (`EMBER_WEIGHTS_CACHE_GB`, default 8 GiB; 0: off)."""
    raw = os.environ.get("EMBER_WEIGHTS_CACHE_GB", "8")
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib >= 0:
        raise ValueError(f"EMBER_WEIGHTS_CACHE_GB must be a number of GiB >= 0, got {raw!r}")
    return int(gib * (1 << 30))


def entry_path(paths: str | list[str], parts: dict[str, Any]) -> str | None:
    """Where the model built from the weight file(s) `paths` (a GGUF file, a checkpoint's
    `checkpoint_files`) with `parts` (what else it depends on) is kept; None where the cache
    is off, a file is missing or there is no usable directory."""
    if max_bytes() == 0:
        return None
    import transformers

    files = [file_identity(p) for p in ([paths] if isinstance(paths, str) else paths)]
    if not files or any(f is None for f in files):
        return None
    ident = {
        "files": [list(f) for f in files],
        "ember_sources_sha256": sources_fingerprint(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "format": _FORMAT,
        **parts,
    }
    directory = private_dir(user_cache_dir("weights"), "weights cache")
    return None if directory is None else entry_dir(directory, ident) + ".pkd"


def checkpoint_files(model_dir: str) -> list[str]:
    """The files of the checkpoint in `model_dir` that its weights are read from (safetensors,
    PyTorch .bin files and their indexes), sorted; empty where there are none."""
    try:
        names = sorted(os.listdir(model_dir))
    except OSError:
        return []
    weights = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
    return [os.path.join(model_dir, n) for n in names if n.endswith(weights)]


def config_digest(config: Any) -> str:
    """A digest of a transformers config (what the model was built from)."""
    return hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:24]


class _NotCacheable(Exception):
    pass


class _Pickler(pickle.Pickler):
    """Pickles the model with each tensor as a persistent id: an index into `tensors`."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if type(obj) not in (torch.Tensor, nn.Parameter):
            raise _NotCacheable(f"a tensor of type {type(obj).__name__}")
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_conj() or obj.is_neg():
            raise _NotCacheable("a tensor that is not a plain CPU tensor")
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return ("tensor", index)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The absolute [start, end) addresses of the bytes `t` reads."""
    size = t.element_size()
    start = t.data_ptr()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + extent * size


def save(entry: str | None, model: nn.Module) -> None:
    """Write `model` (as `load` maps it back) to `entry` on a thread (`wait` joins it; the
    interpreter does at exit), through a temporary file renamed into place; nothing (logged)
    where the model cannot be pickled or the file cannot be written. The model is pickled
    here; the thread writes its tensors' bytes, holding their storages (writing fresh
    page-cache pages is as slow as faulting memory in on the VMs above: ~300 ms for 133 MB,
    which a first load would otherwise wait for)."""
    if entry is None:
        return
    body = io.BytesIO()
    pickler = _Pickler(body)
    try:
        pickler.dump(model)
    except Exception as e:  # noqa: BLE001  (whatever cannot be pickled: built afresh next time)
        logger.info("weights not cached: %s", e)
        return
    tensors = pickler.tensors
    # Each storage's used bytes, once, at the same offset within a page as in memory.
    ranges: dict[int, list[int]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    bases: list[int | None] = []
    for t in tensors:
        if t.numel() == 0:  # no bytes (a plain GroupLinear's scales), and maybe no storage
            bases.append(None)
            continue
        start, end = _byte_range(t)
        storage = t.untyped_storage()
        base = storage.data_ptr()
        storages[base] = storage
        bases.append(base)
        lo_hi = ranges.setdefault(base, [start, end])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], start), max(lo_hi[1], end)
    placed: dict[int, int] = {}  # storage base -> file offset of its range's first byte
    cursor = _HEADER.size
    for base, (lo, hi) in ranges.items():
        cursor = -(-cursor // _PAGE) * _PAGE + lo % _PAGE
        placed[base] = cursor
        cursor += hi - lo
    table = []
    for t, base in zip(tensors, bases, strict=True):
        offset = 0 if base is None else placed[base] + t.data_ptr() - ranges[base][0]
        param = type(t) is nn.Parameter
        table.append((offset, str(t.dtype), tuple(t.shape), t.stride(), param, t.requires_grad))
    tail = pickle.dumps((table, body.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)
    size, cap = cursor + len(tail), max_bytes()
    if size > cap:
        logger.info("weights not cached: %d MB, over the cap of %d MB", size >> 20, cap >> 20)
        return
    regions = []
    for base, (lo, hi) in ranges.items():
        whole = torch.empty(0, dtype=torch.uint8).set_(storages[base])
        regions.append((placed[base], whole[lo - base : hi - base]))
    header = _HEADER.pack(_MAGIC, cursor, len(tail))
    thread = threading.Thread(
        target=_write,
        args=(entry, header, regions, cursor, tail, cap - size),
        name="ember-weights-cache",
    )
    with _writers_lock:
        _writers.append(thread)
    thread.start()


_writers_lock = threading.Lock()
_writers: list[threading.Thread] = []


def wait() -> None:
    """Wait until every entry being written is in place (or given up)."""
    with _writers_lock:
        writers = list(_writers)
    for thread in writers:
        thread.join()


def _write(
    entry: str,
    header: bytes,
    regions: list[tuple[int, torch.Tensor]],
    cursor: int,
    tail: bytes,
    room: int,
) -> None:
    """Write the entry (`save`), after pruning the others down to `room` bytes."""
    directory = os.path.dirname(entry)
    tmp = None
    try:
        prune_cache(directory, room)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for offset, region in regions:
                f.seek(offset)
                f.write(region.numpy().data)
            f.seek(cursor)
            f.write(tail)
        os.replace(tmp, entry)
        tmp = None
    except OSError as e:
        logger.info("weights not cached in %s: %s", entry, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        with _writers_lock:
            _writers.remove(threading.current_thread())


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, whole: torch.Tensor, table: list[Any]) -> None:
        super().__init__(file)
        self._whole, self._table = whole.untyped_storage(), table
        self._built: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind, index = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        t = self._built.get(index)
        if t is None:
            offset, dtype, shape, stride, param, grad = self._table[index]
            dtype = getattr(torch, dtype.removeprefix("torch."))
            t = torch.empty(0, dtype=dtype).set_(
                self._whole, offset // dtype.itemsize, shape, stride
            )
            if param:
                t = nn.Parameter(t, requires_grad=grad)
            self._built[index] = t
        return t


def load(entry: str | None) -> nn.Module | None:
    """The model kept at `entry`, its tensors views of the entry's file mapped copy-on-write
    and read in ahead (`MADV_POPULATE_READ`); None where there is none or it cannot be read
    (logged)."""
    if entry is None or not os.path.isfile(entry):
        return None
    try:
        with open(entry, "rb") as f:
            magic, offset, length = _HEADER.unpack(f.read(_HEADER.size))
            if magic != _MAGIC:
                raise ValueError("not an ember weights file")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if offset + length > len(mapped):
            raise ValueError("truncated")
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        register_file_map(mapped, whole, populate=offset)
        table, body = pickle.loads(mapped[offset : offset + length])
        model = _Unpickler(io.BytesIO(body), whole, table).load()
    except Exception as e:  # noqa: BLE001  (any failure to read it back: build afresh)
        logger.warning("loading the weights afresh: cannot read %s (%s)", entry, e)
        return None
    if not isinstance(model, nn.Module):
        logger.warning("loading the weights afresh: %s holds no model", entry)
        return None
    touch(entry)
    return model
