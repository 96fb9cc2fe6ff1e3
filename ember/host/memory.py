"""Host memory for weights and caches: lazily zeroed maps, weight arenas, file maps, huge pages
(moved and collapsed in the background) and returning freed heap to the system."""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import mmap
import os
import re
import threading
import weakref
from typing import TYPE_CHECKING

from ember.host.isa import host_isa

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


if host_isa() == "avx2":
    os.environ.update(AVX2_ENV)


def huge_pages_available() -> bool:
    """Whether anonymous memory can be backed by transparent huge pages (Linux THP "always" or
    "madvise"; shared anonymous maps are shmem, whose THP setting is usually "never")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


# The live maps of `_lazy_map`: start address -> (end address, the map, weakly).
_huge_maps: dict[int, tuple[int, weakref.ref[mmap.mmap]]] = {}


def _lazy_map(nbytes: int, advice: int | None) -> torch.Tensor:
    """A private anonymous map of `nbytes` (zeroed lazily, page by page as it is touched) as
    a uint8 tensor, which keeps the map alive; madvised `advice` (MADV_HUGEPAGE or
    MADV_NOHUGEPAGE) where the OS has it."""
    import torch

    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buffer = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    if advice is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(advice)
    whole = torch.frombuffer(buffer, dtype=torch.uint8)
    _huge_maps[whole.data_ptr()] = (whole.data_ptr() + nbytes, weakref.ref(buffer))
    return whole


def _in_huge_map(address: int) -> bool:
    return _in_map(_huge_maps, address)


def _in_map(maps: dict[int, tuple[int, weakref.ref[mmap.mmap]]], address: int) -> bool:
    for start, (end, ref) in list(maps.items()):
        if ref() is None:
            del maps[start]
        elif start <= address < end:
            return True
    return False


# Files mapped as weights (`register_file_map`): start address -> (end address, the map,
# weakly).
_file_maps: dict[int, tuple[int, weakref.ref[mmap.mmap]]] = {}


def register_file_map(buffer: mmap.mmap, whole: torch.Tensor, populate: int = 0) -> None:
    """Record `whole` (a uint8 tensor over `buffer`, a file's memory map) as weights that stay
    where they are: `move_to_huge_pages` leaves tensors in it in place (a copy would fault
    fresh memory in for what the page cache already holds). Its first `populate` bytes are read
    in now (`MADV_POPULATE_READ`: the page cache's pages mapped, none copied, even in a private
    map), advised to use huge pages first. Where the file system keeps the file in 2 MiB folios
    (ext4 on Linux 6.x, for a file written in large writes, or read from disk under that
    advice) and the map is 2 MiB-aligned (Linux aligns large file maps), they are mapped as
    huge pages (FilePmdMapped). AMD EPYC (Zen 5, KVM), a 126 MB file read from disk: 86 MB of
    it in huge pages without the advice, all of it with (~40 ms; 0.2-2.3 ms from the page
    cache)."""
    _file_maps[whole.data_ptr()] = (whole.data_ptr() + whole.numel(), weakref.ref(buffer))
    madvise = _libc_madvise()
    if madvise is not None and populate > 0:
        length = min(populate, whole.numel())
        madvise(whole.data_ptr(), length, mmap.MADV_HUGEPAGE)
        madvise(whole.data_ptr(), length, _MADV_POPULATE_READ)


def in_file_map(t: torch.Tensor) -> bool:
    """Whether `t`'s storage lies in a map recorded by `register_file_map`."""
    return _in_map(_file_maps, t.untyped_storage().data_ptr())


def zeroed_lazily(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros in its own anonymous memory map: the OS hands out each page zeroed
    when it is first touched, so a large buffer costs neither a pass over it nor resident
    memory until it is used (the KV cache: `torch.zeros` of the default 4 GiB took 1.1 s and
    4 GiB of RSS at start-up, whatever the workload). The map is private and advised to use
    huge pages (see `move_to_huge_pages`). The tensor keeps the map alive."""
    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return _lazy_map(nbytes, getattr(mmap, "MADV_HUGEPAGE", None)).view(dtype).view(shape)


# Weights at least this large are allocated by `weight_zeros` in their own map.
_OWN_MAP_MIN_BYTES = 16 << 20
_ARENA_ALIGN = 64  # a cache line, as the C heap aligns torch's tensors
_HUGE_PAGE = 2 << 20
# Linux's madvise(MADV_POPULATE_WRITE) (5.14+) and MADV_COLLAPSE (6.1+), which Python 3.11's
# mmap does not name.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)


@functools.cache
def _can_collapse() -> bool:
    """Whether the kernel turns 4 KiB pages into huge pages in place on request
    (MADV_COLLAPSE, Linux 6.1+) and ember can ask it without holding the GIL."""
    match = re.match(r"(\d+)\.(\d+)", os.uname().release) if hasattr(os, "uname") else None
    if match is None or _libc_madvise() is None or not huge_pages_available():
        return False
    return (int(match[1]), int(match[2])) >= (6, 1)


def _weight_map(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeros (uint8) in a private anonymous map of their own, zeroed lazily (page
    by page as it is first touched), starting on a huge-page boundary, the map reaching the
    next one past its end.

    Weights belong in huge pages (see `move_to_huge_pages`), but faulting huge pages in is
    the slow part of a load on a VM whose host reclaims the guest's free memory: AMD EPYC
    (Zen 4, KVM), 80 MB of freed memory faulted in 125-190 ms as 2 MiB pages, 40-60 ms as
    4 KiB ones. So where the kernel can collapse pages (`_can_collapse`) the map is written
    in 4 KiB pages, and the writer queues what it wrote with `collapse_later`; the engine,
    once ready, has a thread collapse it (`collapse_to_huge_pages`). Elsewhere the map is
    advised to use huge pages as they are first touched. The tensor keeps the map alive."""
    span = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE
    advice = "MADV_NOHUGEPAGE" if _can_collapse() else "MADV_HUGEPAGE"
    whole = _lazy_map(span, getattr(mmap, advice, None))
    skip = -whole.data_ptr() % _HUGE_PAGE
    return whole[skip : skip + nbytes]


_collapse_lock = threading.Lock()
_to_collapse: list[torch.Tensor] = []  # guarded by _collapse_lock, as is _collapser
_collapser: threading.Thread | None = None
# Set at exit: a thread still inside ctypes when the interpreter finalizes aborts the process.
_collapse_stop = threading.Event()


def collapse_later(written: torch.Tensor) -> None:
    """Queue `written`, the front of a `_weight_map` (or a view of one) that holds weights,
    for `collapse_to_huge_pages`: its pages, up to the next huge-page boundary, become huge
    pages then. Nothing where the kernel cannot collapse pages (they are already huge)."""
    if not _can_collapse() or written.numel() == 0:
        return
    start = written.data_ptr()
    _libc_madvise()(start, _collapse_span(written), mmap.MADV_HUGEPAGE)
    with _collapse_lock:
        _to_collapse.append(written)


def _collapse_span(written: torch.Tensor) -> int:
    """Bytes from `written`'s start to the huge-page boundary at or past its end."""
    end = written.data_ptr() + written.numel() * written.element_size()
    return -(-end // _HUGE_PAGE) * _HUGE_PAGE - written.data_ptr()


def collapse_to_huge_pages(wait: bool = False) -> None:
    """Turn the pages of every weight queued by `collapse_later` into huge pages, on a
    thread (one at a time; it holds the weights' maps until it is done); `wait` joins it.
    The engine calls this once its model is loaded: the collapse (about as slow as faulting
    huge pages in: ~0.2 s for 80 MB on the VM above) runs while the graphs compile, or while
    the first steps run, not on the way to a ready engine."""
    global _collapser
    with _collapse_lock:
        if _to_collapse and _collapser is None and not _collapse_stop.is_set():
            _collapser = threading.Thread(
                target=_collapse_queued, name="ember-huge-pages", daemon=True
            )
            _collapser.start()
        thread = _collapser
    if wait and thread is not None:
        thread.join()


def _collapse_queued() -> None:
    global _collapser
    madvise = _libc_madvise()
    assert madvise is not None
    try:
        while not _collapse_stop.is_set():
            with _collapse_lock:
                if not _to_collapse:
                    return
                written = _to_collapse.pop(0)
            start = written.data_ptr()
            for address in range(start, start + _collapse_span(written), _HUGE_PAGE):
                if _collapse_stop.is_set():
                    return
                # A page that cannot be collapsed (no free huge page now) stays as it is.
                madvise(address, _HUGE_PAGE, _MADV_COLLAPSE)
            del written
    finally:
        with _collapse_lock:
            _collapser = None


@atexit.register
def _stop_collapsing() -> None:
    """Let the collapsing thread finish the page it is on before the interpreter goes."""
    _collapse_stop.set()
    thread = _collapser
    if thread is not None:
        thread.join()


def _after_fork_in_child() -> None:
    global _collapse_lock, _collapser
    _collapse_lock, _collapser = threading.Lock(), None  # the parent's thread is not here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class WeightArena:
    """Memory for the weights a load builds (`weight_zeros` while `weight_arena` is active):
    one `_weight_map`, handed out front to back, whose first `populate` bytes a thread faults
    in (zeroed) ahead of the packers that write them.

    Weights built there are in a map of their own, so `move_to_huge_pages` neither copies
    them nor faults a second map in for them; the arena queues what was handed out for
    `collapse_to_huge_pages` when it closes. The thread faults pages in while the load's
    Python (the tokenizer, the meta model) and the packing run.

    Memory handed out stays mapped while any tensor in it lives: for weights that live as long
    as the model, not for a load's temporaries."""

    def __init__(self, nbytes: int, populate: int) -> None:
        self._base = _weight_map(nbytes)
        self.used = 0
        self._populate = min(populate, nbytes)
        self._stop = threading.Event()
        self._thread = None
        if _libc_madvise() is not None and self._populate > 0:
            self._thread = threading.Thread(
                target=self._fault_in, name="ember-weight-arena", daemon=True
            )
            self._thread.start()

    def _fault_in(self) -> None:
        madvise, start = _libc_madvise(), self._base.data_ptr()
        for offset in range(0, self._populate, _HUGE_PAGE):
            if self._stop.is_set():
                return
            length = min(_HUGE_PAGE, self._populate - offset)
            if madvise(start + offset, length, _MADV_POPULATE_WRITE) != 0:
                return  # an older kernel: the writers fault the pages in

    def take(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of zeros (uint8) from the arena, or None where it has no room left."""
        start = -(-self.used // _ARENA_ALIGN) * _ARENA_ALIGN
        if start + nbytes > self._base.numel():
            return None
        self.used = start + nbytes
        return self._base[start : start + nbytes]

    def close(self) -> None:
        """Stop faulting pages in, give back those faulted in past the huge page that holds
        the end of what was handed out, and queue what was handed out for collapsing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        tail = -(-self.used // _HUGE_PAGE) * _HUGE_PAGE  # the base is huge-page aligned
        if tail < self._populate:
            drop_pages(self._base.data_ptr() + tail, self._populate - tail)
        collapse_later(self._base[: self.used])


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes, which lets go of the GIL while it runs (Python's
    `mmap.madvise` holds it), or None off Linux."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        import ctypes

        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def drop_pages(start: int, nbytes: int) -> bool:
    """madvise(MADV_DONTNEED) the whole pages [start, start + nbytes): private anonymous
    memory there reads as zeros afterwards, a file mapping's pages as the file's bytes again
    (they leave the process's RSS either way). False where it failed or the OS lacks it."""
    madvise = _libc_madvise()
    return madvise is not None and madvise(start, nbytes, mmap.MADV_DONTNEED) == 0


_arena = threading.local()  # .current: the thread's active WeightArena


@contextlib.contextmanager
def weight_arena(nbytes: int, populate: int) -> Iterator[WeightArena | None]:
    """`weight_zeros` in this thread hands out memory of a `WeightArena` of `nbytes`
    (virtual) within this block, `populate` of them faulted in ahead by a thread; none where
    the OS has no huge pages for anonymous memory (or nested in another arena's block)."""
    if getattr(_arena, "current", None) is not None or nbytes <= 0 or not huge_pages_available():
        yield None
        return
    arena = _arena.current = WeightArena(nbytes, populate)
    try:
        yield arena
    finally:
        _arena.current = None
        arena.close()


def weight_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros for a weight being built (a re-laid-out or fused quantized tensor): in the active
    `weight_arena` while it has room; else a large one in a `_weight_map` of its own, resident
    only as it is written, left in place by `move_to_huge_pages` (a copy there would hold the
    weight twice) and queued for `collapse_to_huge_pages`; a small one, or where the OS has
    no huge pages, on the heap."""
    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    arena = getattr(_arena, "current", None)
    taken = None if arena is None else arena.take(nbytes)
    if taken is not None:
        return taken.view(dtype).view(shape)
    if nbytes >= _OWN_MAP_MIN_BYTES and huge_pages_available():
        own = _weight_map(nbytes)
        collapse_later(own)  # collapsed once the engine is ready, after the weight is written
        return own.view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype)


# Storages smaller than this stay where they are (norm weights, biases: not worth a page).
_HUGE_MIN_BYTES = 64 * 1024
_HUGE_ALIGN = 4096


def move_to_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Move the storages of `tensors` (a model's weights) into one `_weight_map`, which
    `collapse_to_huge_pages` turns into transparent huge pages (where the kernel cannot, its
    pages are huge as they are written), in place: every tensor object keeps its identity,
    dtype, shape, strides and storage offset, so views and tied weights stay views and ties.
    Returns the bytes moved (0 where the OS has no huge pages for anonymous memory).

    A decode step streams every weight once: in 4 KiB pages that is a TLB miss and a page
    walk per 4 KiB (llama-160m Q4_0: ~19,000 per step), which also evicts the TLB entries of
    the KV cache and of the host code that runs next; 2 MiB pages take 512 times fewer.
    Storages move one at a time (each old one is freed once its last tensor moved), so the
    process's peak memory grows by about one storage, not a model.
    """
    import torch

    if not huge_pages_available():
        return 0
    storages: dict[int, tuple[torch.UntypedStorage, dict[int, torch.Tensor]]] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() < _HUGE_MIN_BYTES or t.device.type != "cpu":
            continue
        if _in_huge_map(st.data_ptr()) or _in_map(_file_maps, st.data_ptr()):
            continue
        storages.setdefault(st.data_ptr(), (st, {}))[1][id(t)] = t  # each tensor once
    if not storages:
        return 0
    offsets, total = {}, 0
    for key, (st, _) in storages.items():
        offsets[key] = total
        total += -(-st.nbytes() // _HUGE_ALIGN) * _HUGE_ALIGN
    arena = _weight_map(total)
    heap = HeapTrimmer()  # the old storages' heap pages go back as the arena fills
    with torch.no_grad():
        for key in list(storages):
            st, views = storages.pop(key)
            nbytes = st.nbytes()
            start = offsets[key]
            region = arena[start : start + nbytes]
            region.copy_(torch.empty(0, dtype=torch.uint8).set_(st))
            for t in views.values():
                size = t.element_size()
                t.set_(
                    region.untyped_storage(),
                    region.storage_offset() // size + t.storage_offset(),
                    t.size(),
                    t.stride(),
                )
            del st, views
            heap.freed(nbytes)
    collapse_later(arena)
    return total


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """Returns the C heap's free pages to the OS (`malloc_trim`) once every `every` bytes of
    temporaries freed, for loops that convert weights one by one: glibc's mmap threshold
    adapts upward after large frees, later temporaries come from its heap, and the freed
    heap stays resident (hundreds of MB over a model) until trimmed."""

    def __init__(self, every: int = 16 << 20) -> None:
        self.every, self.pending = every, 0

    def freed(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every:
            self.pending = 0
            trim = _malloc_trim()
            if trim is not None:
                trim(0)


def release_free_heap() -> None:
    """Return the C heap's free pages to the OS (glibc `malloc_trim`; a no-op elsewhere).

    Loading re-lays every weight through temporaries of tens of MB; glibc serves later ones
    from its heap once large blocks have been freed (its mmap threshold adapts), and keeps
    the freed heap resident: 23 MB of a 127 MB GGUF file's load here. (No garbage collection
    first: the loads leave no cycles that hold memory, and a full collection with transformers
    imported took 0.25-0.4 s of every load: llama-160m Q4_0, F16 and safetensors alike, RSS
    equal with and without it.)"""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
