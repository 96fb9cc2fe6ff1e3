"""Facts about the host CPU (no ember imports: used by runtime and attention alike)."""

from __future__ import annotations

import functools


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
