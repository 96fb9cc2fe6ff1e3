"""Facts about the host, and where ember keeps its files. No ember imports: every layer may use
it (kernels, attention, compiler, runtime, tools)."""

from __future__ import annotations

import functools
import os

# ISAs ember's own kernels can be built for: "native" (-march=native), or "avx2" (AVX2 + FMA,
# no AVX-512), to take the AVX2 paths on an AVX-512 machine.
CPU_ISAS = ("native", "avx2")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16(isa: str = "native") -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX-BF16) and `isa` lets
    ember use them."""
    flags = _cpu_flags()
    return isa == "native" and ("avx512_bf16" in flags or "amx_bf16" in flags)


def cpu_description() -> str:
    """The CPU's model name and its vector extensions, for benchmark reports."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = _cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX2'})"


def user_cache_dir(*parts: str) -> str:
    """`$XDG_CACHE_HOME/ember/...` (default `~/.cache/ember/...`): checkpoints ember builds,
    compile caches and built kernels."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ember", *parts)
