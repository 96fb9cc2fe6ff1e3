"""Where ember keeps its files: the user cache directory, private (owner-only) directories,
and least-recently-used pruning of a cache. No ember imports."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:

    pass


logger = logging.getLogger("ember")


def user_cache_dir(*parts: str) -> str:
    """`$XDG_CACHE_HOME/ember/...` (default `~/.cache/ember/...`): checkpoints ember builds,
    compile caches and built kernels."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ember", *parts)


def default_compile_cache_dir() -> str:
    """The compile cache engines use unless told otherwise (`compile_cache_dir="auto"`)."""
    return user_cache_dir("compile")


def _unsafe_reason(path: str) -> str | None:
    """Why code loaded from directory `path` could have been written by someone else, or None.

    `path` must be owned by this user and writable by nobody else; each directory above it
    must be owned by this user or root and, if others may write to it, sticky (as /tmp is),
    so nobody else can swap `path` for their own directory."""
    uid = os.getuid()
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot stat it ({e})"
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(parent)
        if st.st_uid not in (uid, 0):
            return f"its parent {parent} is owned by uid {st.st_uid}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return f"its parent {parent} is writable by others and not sticky"
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up


def private_dir(path: str, what: str) -> str | None:
    """Make `path` (missing directories are created 0700) for a cache of code that ember loads
    (`what`: "compile cache", "kernel cache"). Returns `path` when it is safe to load from
    (see `_unsafe_reason`); else logs one line with the reason and returns None: the caller
    then compiles or builds afresh, outside that directory."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        logger.warning("not using %s %s: cannot create it (%s)", what, path, e)
        return None
    reason = _unsafe_reason(path)
    if reason is not None:
        logger.warning("not using %s %s: %s; building afresh without it", what, path, reason)
        return None
    return path


def touch(path: str | None) -> None:
    """Mark a cache entry (file or directory) as just used: `prune_cache` evicts by mtime."""
    if path is not None:
        with contextlib.suppress(OSError):
            os.utime(path)


def _entry_bytes(path: str) -> int:
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


_EVICTED = ".evicted-"


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


# An entry used (or written) this recently is never evicted: another process may be reading it.
PRUNE_MIN_IDLE_S = 3600.0


def prune_cache(directory: str, max_bytes: int, keep: str | None = None) -> list[str]:
    """Evict the least recently used entries of a cache (the files and directories directly
    in `directory`, their mtime the last use: see `touch`) until the rest total at most
    `max_bytes`. `keep`, hidden names (temporaries being written) and entries used within
    `PRUNE_MIN_IDLE_S` stay, so the cache may stay above the cap for a while. Each entry is
    renamed away before it is deleted, so no reader sees a half-deleted one. Returns the
    evicted paths."""
    entries = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(_EVICTED):  # left by a process that died while deleting it
            _remove(path)
            continue
        try:
            entries.append((os.lstat(path).st_mtime, _entry_bytes(path), path, name))
        except OSError:  # removed meanwhile
            continue
    total = sum(size for _, size, _, _ in entries)
    now = time.time()
    keep = None if keep is None else os.path.abspath(keep)
    evicted = []
    for mtime, size, path, name in sorted(entries):
        if total <= max_bytes:
            break
        if name.startswith(".") or now - mtime < PRUNE_MIN_IDLE_S or os.path.abspath(path) == keep:
            continue
        doomed = os.path.join(directory, f"{_EVICTED}{name}-{os.getpid()}")
        try:
            os.rename(path, doomed)
        except OSError:  # another process evicted it first
            continue
        _remove(doomed)
        total -= size
        evicted.append(path)
    if evicted:
        logger.info("evicted %d least recently used entries from %s", len(evicted), directory)
    return evicted
