"""The host CPU: its instruction sets (`EMBER_CPU_ISA`, flags, native bf16 / int8 dot / AMX),
and the compiler target `-march=native` resolves to. No ember imports."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
from typing import TYPE_CHECKING

from ember.host.dirs import private_dir, user_cache_dir

if TYPE_CHECKING:

    pass


# ISAs ember's own kernels can be built for: "native" (-march=native), or "avx2" (AVX2 + FMA,
# no AVX-512), to take the AVX2 paths on an AVX-512 machine.
CPU_ISAS = ("native", "avx2")

# The one switch that makes a process behave as an AVX2-only host (an older AMD EPYC, say) on
# any x86-64-v3 CPU: `EMBER_CPU_ISA=avx2` in its environment. Then ember sees no AVX-512, AMX or
# AVX-VNNI flag (so no native bf16 math), builds its kernels for x86-64-v3 (`cpu_isa="native"`
# means "avx2"), and caps ATen and oneDNN at AVX2 (`AVX2_ENV`, set on import of this module).
# It is an environment variable, not an engine knob, because ATen and oneDNN read theirs once
# per process at their first kernel, and because child processes (compile workers, tests'
# subprocesses) must behave as the same host.
HOST_ISA_ENV = "EMBER_CPU_ISA"
# /proc/cpuinfo flags an AVX2-only x86 CPU lacks (AMD Zen 2 has none of them).
_PAST_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")


@functools.cache
def host_isa() -> str:
    """The host this process behaves as: "avx2" for an AVX2-only host (`EMBER_CPU_ISA=avx2`),
    else "native" (the CPU as it is). Any other value of the variable is a ValueError."""
    value = os.environ.get(HOST_ISA_ENV, "native").strip().lower() or "native"
    if value not in CPU_ISAS:
        raise ValueError(f"{HOST_ISA_ENV} must be one of {CPU_ISAS}, got {value!r}")
    return value


def resolve_isa(isa: str) -> str:
    """The build of ember's kernels that `cpu_isa=isa` means in this process: "native" is
    "avx2" on a host forced to AVX2 (one build, one name)."""
    return "avx2" if isa == "native" and host_isa() == "avx2" else isa


def check_host_isa() -> None:
    """Raise ValueError where `EMBER_CPU_ISA=avx2` came too late for ATen: it had already
    chosen its wider kernels (before this module set `ATEN_CPU_CAPABILITY`)."""
    if host_isa() != "avx2":
        return
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "DEFAULT", "NO AVX"):
        raise ValueError(
            f"{HOST_ISA_ENV}=avx2: ATen already runs its {capability} kernels in this process "
            "(it chose them at its first kernel, before ember was imported); set "
            f"{HOST_ISA_ENV}=avx2 in the environment before Python starts"
        )


def beyond_avx2() -> bool:
    """Whether the CPU, as this process sees it, has vector extensions past AVX2 (AVX-512,
    AMX, AVX-VNNI): False on an AVX2-only host, real or forced, and off x86."""
    return any(f.startswith(_PAST_AVX2) for f in _cpu_flags())


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's /proc/cpuinfo flags, less those past AVX2 on a host forced to AVX2."""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if host_isa() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_PAST_AVX2))
    return flags


def cpu_has_native_bf16(isa: str = "native") -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX-BF16) and `isa` lets
    ember use them."""
    flags = _cpu_flags()
    return isa == "native" and ("avx512_bf16" in flags or "amx_bf16" in flags)


def cpu_has_int8_dot(isa: str = "native") -> bool:
    """True when the CPU has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX-INT8)
    and `isa` lets ember use them. Without them oneDNN's int8 GEMM (`torch._int_mm`) sums
    pairs of byte products in saturating int16 (vpmaddubsw): wrong sums for full-range int8
    (measured: 127 x 127 over 64 k gave 8160, not 1032256)."""
    flags = _cpu_flags()
    return isa == "native" and any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles for bf16 (Sapphire Rapids and later Xeons)."""
    return "amx_bf16" in _cpu_flags()


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


def _cpu_identity() -> str:
    """The first CPU's vendor, family, model, stepping, name and flags (what `-march=native`
    is derived from), as /proc/cpuinfo gives them."""
    keys = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                if line.split(":", 1)[0].strip() in keys:
                    lines.append(line.strip())
    except OSError:
        pass
    return "\n".join(lines)


@functools.cache
def _march(march: str) -> tuple[str, tuple[str, ...]]:
    """The base architecture `march` resolves to here and every -m flag the compiler turns on
    or off with it (its cc1 command line); the CPU's own feature list without a compiler.

    Asking the compiler takes 15-45 ms, a tenth of a small GGUF file's load, so the answer is
    kept in the kernel cache, keyed by the compiler (path, size, mtime), `march` and the CPU."""
    compiler = shutil.which("c++")
    if compiler is None:
        return "cpu", tuple(sorted(_cpu_flags()))
    try:
        real = os.path.realpath(compiler)
        st = os.stat(real)
    except OSError:
        return "cpu", tuple(sorted(_cpu_flags()))
    ident = f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{march}\0{_cpu_identity()}"
    parent = private_dir(user_cache_dir("kernels"), "kernel cache")
    entry = None
    if parent is not None:
        name = f"march-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.txt"
        entry = os.path.join(parent, name)
        with contextlib.suppress(OSError, ValueError):
            with open(entry) as f:
                base, *flags = f.read().split()
            if base and flags:
                return base, tuple(flags)
    base, flags = _ask_compiler(march)
    if entry is not None and base != "cpu":
        with contextlib.suppress(OSError):
            tmp = f"{entry}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(" ".join((base, *flags)))
            os.replace(tmp, entry)
    return base, flags


def _ask_compiler(march: str) -> tuple[str, tuple[str, ...]]:
    try:
        run = subprocess.run(
            ["c++", march, "-x", "c++", "-E", "-v", "-"],
            input="",
            capture_output=True,
            text=True,
            timeout=30,
        )
        line = next(ln for ln in run.stderr.splitlines() if "cc1" in ln and "-march=" in ln)
        flags = [f for f in line.split() if f.startswith("-m")]
        base = next(f for f in flags if f.startswith("-march=")).split("=", 1)[1]
    except (OSError, StopIteration, subprocess.SubprocessError):
        # No compiler to ask (then nothing is built here either): the CPU's own feature list.
        return "cpu", tuple(sorted(_cpu_flags()))
    return base, tuple(flags)


def cpu_target(march: str = "-march=native") -> str:
    """The exact code-generation target of `march` on this host, e.g. "znver3-1f0c9a2b": the
    compiler's expansion of the flag (base architecture plus every -m feature it enables),
    hashed. Two CPUs that differ in any feature -march=native turns on get different values,
    so a cache shared between machines never loads code built for the other one."""
    base, flags = _march(march)
    return f"{base}-{hashlib.sha256(' '.join(flags).encode()).hexdigest()[:8]}"


def native_enables(feature: str) -> bool:
    """Whether code built here with -march=native may use `feature` (e.g. "avx512f"), as the
    compiler expands that flag (the CPU's own flags without a compiler)."""
    base, flags = _march("-march=native")
    return f"-m{feature}" in flags if base != "cpu" else feature in flags
