"""The prefix cache's disk tier: full KV blocks kept in a directory across processes.

The block manager decides (which hashes to look up, which blocks to save); this store moves
the bytes between the runner's KV tensors and files, and owns the directory.

An entry is one block of every layer: a fixed header (magic, format, the model key, the block's
chained hash, the payload size and its xxh3-64 checksum) followed by each layer's K rows then
V rows, raw. Never a pickle. A file whose header, size or checksum disagrees is a miss (one
log line), never a crash or a wrong token: the block is recomputed.

Writes run on one background thread from copies taken when the step that filled the blocks
has run (`save`), each to a temporary file renamed into place (atomic: two processes writing
the same block leave one valid entry). The directory is capped (`max_bytes`): past the cap the
least recently used entries (file mtime, bumped on every hit) are deleted, oldest first. Several
processes may share a directory: each entry is self-describing and a reader holds its file open,
so a concurrent delete or rewrite never tears what it reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import transformers
import xxhash

from ember.host.dirs import private_dir
from ember.host.isa import cpu_target
from ember.keys import file_identity, parts_digest, sources_fingerprint
from ember.model.packed_cache import checkpoint_files, config_digest

if TYPE_CHECKING:
    from ember.model.loader import LoadedModel
    from ember.runtime.config import EngineConfig

logger = logging.getLogger("ember")

_MAGIC = b"EMBERKV\x00"
_FORMAT = 1
# magic, format, model key, block hash, payload bytes, payload xxh3-64
_HEADER = struct.Struct("<8sI32s32sQQ")
_SUFFIX = ".kv"
_TMP = ".tmp-"
# A temporary file this old was left by a process that died while writing it.
_STALE_TMP_S = 3600.0
# Copies waiting for the writer thread, at most (further saves are dropped, counted).
_MAX_QUEUED_BYTES = 512 << 20


@dataclass
class PrefixStoreStats:
    """Counters since the store opened: blocks found and read back (`hits`), lookups that found
    no entry (`misses`), entries refused (`errors`: wrong header, size or checksum), bytes read
    and written, entries written, evicted and dropped (the writer was behind), and the time
    spent reading."""

    hits: int = 0
    misses: int = 0
    errors: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # in `prefetch` and `read` (open, read, checksum)
    bytes_written: int = 0
    blocks_written: int = 0
    evictions: int = 0
    dropped: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def _checksum(buffers: Sequence[Any]) -> int:
    """xxh3-64 of the buffers, one after the other (an entry's payload)."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()


@dataclass
class _Job:
    hashes: list[bytes]
    # per layer: [2, n, block bytes] (K, V) copies of the blocks
    staged: list[torch.Tensor] = field(default_factory=list)


class DiskPrefixStore:
    """Reads and writes full KV blocks of `kv_caches` (one `[2, num_blocks, ...]` tensor per
    layer, the runner's) as files under `directory`, keyed by `key` and a block's hash."""

    def __init__(
        self, directory: str, max_bytes: int, key: bytes, kv_caches: Sequence[torch.Tensor]
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"prefix_cache_gib must be > 0, got {max_bytes / (1 << 30)}")
        self.directory = directory
        self.max_bytes = max_bytes
        self.key = key
        # per layer: uint8 views [2, num_blocks, block bytes]
        self._views = [c.view(torch.uint8).reshape(2, c.shape[1], -1) for c in kv_caches]
        self._arrays = [v.numpy() for v in self._views]
        self.block_bytes = sum(2 * v.shape[2] for v in self._views)
        self.stats = PrefixStoreStats()
        self._lock = threading.Lock()  # stats and the byte estimate, shared with the writer
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._queued_bytes = 0
        self._dir_bytes: int | None = None  # the writer's estimate; None until it has scanned
        self._writer = threading.Thread(target=self._write_loop, name="ember-prefix-store")
        self._writer.daemon = True
        self._writer.start()

    @classmethod
    def open(
        cls, directory: str, max_bytes: int, key: bytes, kv_caches: Sequence[torch.Tensor]
    ) -> DiskPrefixStore | None:
        """The store, or None (one log line says why) where `directory` cannot be created or
        others could write to it (as the compile cache refuses such a directory)."""
        path = private_dir(os.path.abspath(os.path.expanduser(directory)), "prefix cache")
        return None if path is None else cls(path, max_bytes, key, kv_caches)

    def path(self, block_hash: bytes) -> str:
        name = hashlib.blake2b(self.key + block_hash, digest_size=20).hexdigest()
        return os.path.join(self.directory, name[:2], name + _SUFFIX)

    # ---- reads (the engine's thread) -------------------------------------------------------
    def read(self, block: int, block_hash: bytes) -> bool:
        """Fill `block` of every layer with the entry of `block_hash`; False (the block's
        contents then undefined) when there is none or it is not valid."""
        path = self.path(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            with self._lock:
                self.stats.misses += 1
            return False
        start = time.perf_counter()
        try:
            reason = self._read_into(fd, block, block_hash)
        except OSError as e:
            reason = f"cannot read it ({e})"
        finally:
            os.close(fd)
        with self._lock:
            self.stats.read_seconds += time.perf_counter() - start
            if reason is None:
                self.stats.hits += 1
                self.stats.bytes_read += self.block_bytes
            else:
                self.stats.errors += 1
        if reason is not None:
            logger.warning("prefix cache: ignoring %s: %s", path, reason)
            return False
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return True

    def _read_into(self, fd: int, block: int, block_hash: bytes) -> str | None:
        if os.fstat(fd).st_size != _HEADER.size + self.block_bytes:
            return "its size is not that of a block of this model"
        magic, fmt, key, stored_hash, nbytes, checksum = _HEADER.unpack(os.read(fd, _HEADER.size))
        if magic != _MAGIC or fmt != _FORMAT:
            return "not a prefix-cache entry of this format"
        if key != self.key or stored_hash != block_hash or nbytes != self.block_bytes:
            return "an entry of another model or block"
        buffers = [a[kv, block] for a in self._arrays for kv in (0, 1)]
        if os.readv(fd, buffers) != nbytes:
            return "truncated"
        return None if _checksum(buffers) == checksum else "its checksum does not match"

    def prefetch(self, hashes: Sequence[bytes]) -> None:
        """Ask the kernel to read the entries of `hashes` (up to the first missing) into the
        page cache in the background (POSIX_FADV_WILLNEED): the disk then serves them many at
        a time, where `read` alone would wait for one after the other. Counted in
        `stats.read_seconds`."""
        start = time.perf_counter()
        for block_hash in hashes:
            try:
                fd = os.open(self.path(block_hash), os.O_RDONLY)
            except OSError:
                break
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
        with self._lock:
            self.stats.read_seconds += time.perf_counter() - start

    def contains(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path(block_hash))

    # ---- writes (copied on the engine's thread, written on the store's) ---------------------
    def save(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Queue the blocks (their K/V valid now) to be written. The copies are taken here,
        so the blocks may be reused at once; past `_MAX_QUEUED_BYTES` waiting, saves are
        dropped (counted) rather than slowing the step."""
        todo = [(b, h) for b, h in zip(blocks, hashes, strict=True) if not self.contains(h)]
        if not todo:
            return
        size = len(todo) * self.block_bytes
        with self._lock:
            if self._queued_bytes + size > _MAX_QUEUED_BYTES:
                self.stats.dropped += len(todo)
                return
            self._queued_bytes += size
        index = torch.tensor([b for b, _ in todo])
        staged = [v.index_select(1, index) for v in self._views]
        self._queue.put(_Job([h for _, h in todo], staged))

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer and let go of the KV tensors (the runner
        frees them on its own close)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._views, self._arrays = [], []

    def _write_loop(self) -> None:
        self._dir_bytes = self._scan_bytes()
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                try:
                    for i, h in enumerate(job.hashes):
                        self._write(h, [s[kv, i].numpy() for s in job.staged for kv in (0, 1)])
                finally:  # written or failed, the copies no longer wait
                    with self._lock:
                        self._queued_bytes -= len(job.hashes) * self.block_bytes
                self._evict_if_full()
            except Exception:  # a full disk, a removed directory: never the engine's failure
                logger.exception("prefix cache: writing to %s failed", self.directory)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, buffers: list[Any]) -> None:
        path = self.path(block_hash)
        if os.path.exists(path):
            return
        header = _HEADER.pack(
            _MAGIC, _FORMAT, self.key, block_hash, self.block_bytes, _checksum(buffers)
        )
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = os.path.join(
            os.path.dirname(path),
            f"{_TMP}{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}",
        )
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = os.writev(fd, [header, *buffers])
        finally:
            os.close(fd)
        if written != _HEADER.size + self.block_bytes:
            os.unlink(tmp)
            raise OSError(f"short write to {tmp}: {written} bytes")
        os.replace(tmp, path)  # atomic: a reader sees the old entry, the new one, or none
        with self._lock:
            self.stats.blocks_written += 1
            self.stats.bytes_written += written
            if self._dir_bytes is not None:
                self._dir_bytes += written

    # ---- the size cap (the writer's thread) -------------------------------------------------
    def _entries(self) -> list[tuple[float, int, str]]:
        """(mtime, bytes, path) of every entry; removes temporaries of dead writers."""
        out = []
        now = time.time()
        with contextlib.suppress(OSError):
            for sub in os.scandir(self.directory):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    for entry in os.scandir(sub.path):
                        with contextlib.suppress(OSError):
                            st = entry.stat(follow_symlinks=False)
                            if entry.name.startswith(_TMP):
                                if now - st.st_mtime > _STALE_TMP_S:
                                    os.unlink(entry.path)
                            elif entry.name.endswith(_SUFFIX):
                                out.append((st.st_mtime, st.st_size, entry.path))
        return out

    def _scan_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _evict_if_full(self) -> None:
        """Past the cap (others' writes counted by a rescan), delete the least recently used
        entries down to 90% of it."""
        if self._dir_bytes is None or self._dir_bytes <= self.max_bytes:
            return
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for _, size, path in entries:
            if total <= self.max_bytes * 0.9:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                evicted += 1
            total -= size
        with self._lock:
            self._dir_bytes = total
            self.stats.evictions += evicted


def store_key_parts(config: EngineConfig, loaded: LoadedModel) -> dict[str, Any] | None:
    """What a block's K/V depend on besides its tokens (and its hash's salt: adapter, images,
    encoder input): the weight files (path, size, mtime), the model config, how the model was
    built and run (dtypes, quantization, attention backend, compile), the KV layout, the CPU's
    code-generation target and the software (ember's sources, torch, transformers). None
    where the weights are not files ember can identify."""
    spec = loaded.spec
    paths = [spec.gguf_file] if spec.gguf_file else checkpoint_files(spec.model_dir)
    files = [file_identity(p) for p in paths]
    if not files or any(f is None for f in files):
        return None
    return {
        "format": _FORMAT,
        "files": [list(f) for f in files if f is not None],
        "config": config_digest(spec.hf_config),
        "task": spec.task,
        "dtype": str(loaded.dtype),
        "weight_dtype": str(loaded.weight_dtype),
        "quantization": loaded.quantization,
        "quantize_activations": config.quantize_activations,
        "kv_dtype": str(config.kv_dtype),
        "kv_layers": [list(s) for s in loaded.kv_layer_shapes],
        "block_size": config.block_size,
        "attention_backend": loaded.attention_backend,
        "lora": [loaded.lora.max_loras, loaded.lora.max_rank] if loaded.lora else None,
        "compile": config.compile,
        "freeze_weights": config.freeze_weights,
        "kernels_isa": loaded.cpu_isa,
        "cpu_target": cpu_target(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ember_sources_sha256": sources_fingerprint(),
    }


def open_prefix_store(
    config: EngineConfig, loaded: LoadedModel, kv_caches: Sequence[torch.Tensor]
) -> DiskPrefixStore | None:
    """The engine's disk tier, or None: none asked for (`prefix_cache_dir`), a model whose K/V
    no prompt reuses (embeddings, classifiers), or one this store cannot key (logged)."""
    if config.prefix_cache_dir is None or config.task not in ("generate", "encdec"):
        return None
    parts = store_key_parts(config, loaded)
    if parts is None:
        logger.warning(
            "prefix cache: not using %s: the model's weights are not files it can key",
            config.prefix_cache_dir,
        )
        return None
    max_bytes = int(config.prefix_cache_gib * (1 << 30))
    key = parts_digest(parts)  # the 32-byte model key every entry carries
    return DiskPrefixStore.open(config.prefix_cache_dir, max_bytes, key, kv_caches)
