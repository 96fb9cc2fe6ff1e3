"""Cache keys shared by the compile cache, the packed-weights cache and the GGUF caches: the
sources fingerprint, a key's directory and a file's identity. A leaf module: no ember imports."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any


def file_identity(path: str) -> tuple[str, int, int] | None:
    """(real path, size, mtime in ns) of the file `path`, what ember's caches of it are keyed
    by; None where it is missing."""
    real = os.path.realpath(path)
    try:
        stat = os.stat(real)
    except OSError:
        return None
    return real, stat.st_size, stat.st_mtime_ns


@functools.cache
def sources_fingerprint() -> str:
    """sha256 over ember's .py, .cpp and .h files (names and contents; the kernels' families
    live in headers since the C++ split, and a layout change there must miss the weights and
    compile caches); about 1 ms."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".py", ".cpp", ".h")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def parts_digest(parts: dict[str, Any]) -> bytes:
    """sha256 of a cache key's parts (JSON values), whatever their order."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()


def entry_dir(cache_dir: str, parts: dict[str, Any]) -> str:
    return os.path.join(cache_dir, parts_digest(parts).hex()[:24])
