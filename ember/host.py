"""Facts about the host, and where ember keeps its files. No ember imports: every layer may use
it (kernels, attention, compiler, runtime, tools)."""

from __future__ import annotations

import functools
import os


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def user_cache_dir(*parts: str) -> str:
    """`$XDG_CACHE_HOME/ember/...` (default `~/.cache/ember/...`): checkpoints ember builds,
    compile caches and built kernels."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ember", *parts)
