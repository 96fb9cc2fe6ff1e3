"""ember's own C++ CPU kernels (`csrc/`: one translation unit, `ember_cpu.cpp`, with the one
registration list, including one header per kernel family: `vec.h`, `linear_dense.h`,
`linear_group.h`, `attention.h`, `logits.h`, `packing.h`, `fast_calls.h`), built once per
machine (one compiler command in a subprocess, linked against torch's libraries) and
registered as aten-style ops (`torch.ops.ember_cpu.*`), so compiled graphs call them straight
through the dispatcher (the per-layer ones through the build's fast calls:
`install_fast_calls`).

`ember_cpu::paged_attention(query, key, value, kv_cache, slot_mapping, query_start_loc,
seq_lens, block_tables, scale, sliding_window, softcap, causal) -> out`: the torch attention
backend's op (`ember::paged_attention`'s contract) with its common case in C++: writes the
step's K/V, then attends every decode in place from the paged cache (fp32, bf16 or int8), every
K/V head of a sequence per task (a block's rows read contiguously), online softmax in fp32, the
GQA group's query heads sharing each K/V row; with too few decodes to keep the threads busy,
each context is split into parts of at least 32 tokens merged by log-sum-exp
(flash-decoding). Prefill chunks whose rows see too many positions, and soft-capped models,
go back to the PyTorch code (`ember::paged_attention_rest`, `ember::paged_attention`). It replaces
about 20 small ATen calls per layer (write, gather, mask, SDPA, scatter) that cost ~0.45 ms
per layer at batch 1.

`ember_cpu::pack_linear_weight(w) -> w_packed` and `ember_cpu::packed_linear(x, w_packed,
scales?, bias?, out_features)`: the linears of every model run with fp32 activations. The
weight (fp32, bf16, or int8 with one fp32 scale per output channel) is re-laid once, at load,
into panels of 2 vector widths of output channels, [ceil(N / panel), K, panel], zeros past N
(the panel width depends on the build's ISA: 32 with AVX-512, 16 with AVX2). One outer-product
kernel serves every step size, widening the weight to fp32 in registers: decodes stream each
panel once (memory-bound), larger steps reuse each weight vector for up to 12 rows of x
(compute-bound; about twice ATen's fp32 GEMM rate at prefill sizes). fp32 math throughout; y in
x's dtype.

`ember_cpu::pack_bf16_pairs(w)`: bf16 activations on CPUs with AVX512-BF16 (builds with it:
`bf16_pairs()`): the weight re-laid as [ceil(N / 32), ceil(K / 2), 64], each pair of k values of
32 channels adjacent, which `packed_linear` multiplies with vdpbf16ps (bf16 products, fp32
sums, y rounded to bf16 once): twice the fp32 FMA's multiply-adds per instruction.

`ember_cpu::group_linear(x, codes, scales, mins?, bias?, out_features, bits)`: group-quantized
weights (GGUF's Q8_0, Q4_0 and Q4_1 blocks; `quantization="int4"`): 8- or 4-bit codes in groups
of 32 k with fp16 scales (and offsets), in panels of output channels with each channel's 4 or 8
consecutive k in one 32-bit lane, each group's scales ahead of its codes (`scales`/`mins` then
empty; super-blocks keep theirs per 256 k there); x is quantized to int8 per group of 32 and
the products are summed in int32 (VNNI / vpmaddubsw); see `ember.model.layers.GroupLinear`.
fp16 weights (GGUF's F16 tensors) pack as bf16 ones do and are widened exactly.
`ember_cpu::group_pack_codes(codes!, scales!, mins!?, row, q, d, m?, bits)` and
`ember_cpu::group_pack_blocks(codes!, scales!, mins!?, row, blocks, type)` fill those panels
at load, from rows of codes or straight from a GGUF tensor's bytes (Q8_0, Q4_0, Q4_1, Q5_0,
Q4_K, Q6_K; `ember.model.layers.BLOCK_TYPES`).

`ember_cpu::bf16_linear(x, w_bf16, bias?)`: bf16 weights in the checkpoint's [N, K] layout (bf16
activations on AMX CPUs, and LM heads tied to the input embedding): the
dot-product GEMV for decodes, ATen's bf16 GEMM (AMX / AVX512-BF16) above with bf16
activations; with fp32 activations the weight is widened (whole, or tile by tile in L2) into
an fp32 GEMM.

`ember_cpu::fp32_linear(x, w_fp32, bias?)`: the GEMV for fp32 weights in [N, K] (a tied head's
decodes); ATen above.

Built with `-O3 -march=native` (or, for `cpu_isa="avx2"`, `-march=x86-64-v3`: the AVX2 paths on
an AVX-512 machine) into `$XDG_CACHE_HOME/ember/kernels/<isa>-<target>-<hash>`, keyed by source,
flags, the exact target `-march` resolves to (`ember.host.cpu_target`), torch version and CPU
ISA; a later process loads the built library (about 0.1 s). -O2 was measured against -O3 (AMD
EPYC): the GEMVs equal or faster, decode attention 5-15% slower, 12 s against 15 s of compiler.
The directory is created 0700 and refused (one log line; the kernels are built afresh in a
private temporary directory) when another user could have written to it
(`ember.host.private_dir`). The fake (shape) implementations sit beside the build below;
`torch.library.opcheck` tests each op.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import sysconfig
import tempfile
import threading
from typing import Any, NamedTuple

import torch

from ember.host.dirs import private_dir, user_cache_dir
from ember.host.isa import cpu_target, native_enables, resolve_isa

logger = logging.getLogger("ember")

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
# The one translation unit the compiler builds; it includes the kernel families' headers.
SOURCES = (os.path.join(_CSRC, "ember_cpu.cpp"),)


def source_files() -> list[str]:
    """Every file of the build (the unit and its headers), which its cache key hashes."""
    return sorted(os.path.join(_CSRC, f) for f in os.listdir(_CSRC) if f.endswith((".cpp", ".h")))


_CFLAGS = ["-O3", "-fopenmp"]
# Per `ember.host.CPU_ISAS`: the native build, or AVX2 + FMA without AVX-512 (x86-64-v3).
_ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3", "-mtune=native"]}
# A test switch: `EMBER_KERNELS_NO_SIMD=1` builds every ISA's kernels for baseline x86-64, so
# their scalar paths run (what -march=native gives on an x86 CPU without AVX2 + FMA) on any
# machine; ATen and inductor keep this CPU's vectors. tests/kernels/test_scalar_build.py runs the
# kernel and attention tests and the int8 and GGUF reference tests so.
NO_SIMD_ENV = "EMBER_KERNELS_NO_SIMD"
_NO_SIMD_FLAGS = ["-march=x86-64", "-mtune=generic"]
_loaded_isa: str | None = None
_panel = 0  # packed weight panel width of the loaded build
_bf16_pairs = False  # the loaded build has pack_bf16_pairs (AVX512-BF16)
# Held while a build loads (`load`, or `prebuild`'s thread): a caller waits for that build.
_loading = threading.Lock()
_prebuilding: threading.Thread | None = None
_prebuild_isa: str | None = None


def _attention_fake(query: torch.Tensor, *args: object) -> torch.Tensor:
    """A new contiguous tensor shaped as the first argument: what paged attention (its
    `at::zeros(sizes)`) and `moe_experts` (its fp32 sum cast back to x's dtype) return."""
    return query.new_empty(query.shape)


def _register_fakes() -> None:
    """Shape functions of the C++ ops, so torch.compile can trace through them."""
    for name in ("bf16_linear", "fp32_linear"):
        torch.library.register_fake(f"ember_cpu::{name}", _linear_fake)
    torch.library.register_fake("ember_cpu::packed_linear", _packed_linear_fake)
    torch.library.register_fake("ember_cpu::pack_linear_weight", _pack_fake)
    torch.library.register_fake("ember_cpu::pack_bf16_pairs", _pack_pairs_fake)
    torch.library.register_fake("ember_cpu::group_linear", _group_linear_fake)
    for name in ("paged_attention", "paged_attention_opaque"):
        torch.library.register_fake(f"ember_cpu::{name}", _attention_fake)
    torch.library.register_fake("ember_cpu::moe_experts", _attention_fake)  # [T, H] as x
    torch.library.register_fake("ember_cpu::apply_token_bitmask", lambda logits, bitmask: None)
    torch.library.register_fake("ember_cpu::row_max", _row_max_fake)
    for name in ("group_pack_codes", "group_pack_blocks"):
        torch.library.register_fake(f"ember_cpu::{name}", lambda *args: None)


def _row_max_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0]), x.new_empty(x.shape[0], dtype=torch.long)


def _linear_fake(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
    """Every linear op's output: x's leading dims, w's output channels."""
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _packed_linear_fake(
    x: torch.Tensor, w: torch.Tensor, scales: object, bias: object, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _group_linear_fake(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: object,
    bias: object,
    out_features: int,
    bits: int,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def panel_width() -> int:
    """Output channels per packed panel: the loaded build's; before it loads, the width of the
    build `prebuild` started (else the native one), so weights can be laid out while it
    builds: two vectors of fp32, 32 where the build targets AVX-512F, else 16 (checked when
    the build loads)."""
    return _panel or _expected_panel(_default_isa())


def _default_isa() -> str:
    """The build a `load()` without an ISA takes: the one `prebuild` started, else native."""
    return _prebuild_isa or resolve_isa("native")


def _resolved(isa: str | None) -> str | None:
    """`isa` as a build's name (`ember.host.resolve_isa`); None stays None."""
    return None if isa is None else resolve_isa(isa)


def _no_simd() -> bool:
    return os.environ.get(NO_SIMD_ENV, "") == "1"


def _expected_panel(isa: str) -> int:
    return 32 if isa == "native" and native_enables("avx512f") and not _no_simd() else 16


def _pack_fake(w: torch.Tensor) -> torch.Tensor:
    return w.new_empty((-(-w.shape[0] // _panel), w.shape[1], _panel))


def _pack_pairs_fake(w: torch.Tensor) -> torch.Tensor:
    return w.new_empty((-(-w.shape[0] // _panel), -(-w.shape[1] // 2), 2 * _panel))


def bf16_pairs() -> bool:
    """True when the loaded build multiplies bf16 activations with `pack_bf16_pairs` weights
    (it was built with AVX512-BF16)."""
    return _bf16_pairs


def loaded_isa() -> str | None:
    """The ISA the kernels of this process were built for, or None before `load`."""
    return _loaded_isa


def ready() -> bool:
    """True when the kernels are loaded, or built on disk for the ISA a `prebuild` started
    (else the native one), so that `load` takes about 0.1 s: loaders use the kernels' packers
    then, and their PyTorch equivalents while a first build is still compiling."""
    return _loaded_isa is not None or os.path.exists(_build(_default_isa()).library)


def isa_conflict(isa: str | None) -> str | None:
    """Why this process cannot run ember's kernels for `isa` (it loaded another build: a
    process holds one), or None."""
    isa = _resolved(isa)
    if _loaded_isa is None or isa in (None, _loaded_isa):
        return None
    return (
        f"cpu_isa={isa!r}: this process already runs ember's kernels built for "
        f"cpu_isa={_loaded_isa!r}, and a process holds one build; start a new process for "
        f"cpu_isa={isa!r}"
    )


def load(isa: str | None = None) -> None:
    """Build (first time on this machine) and load the kernels for `isa` (None: the loaded one,
    else the one a `prebuild` started, else "native"); registers `ember_cpu` ops. A process
    holds one build: asking for another ISA after loading raises RuntimeError. Needs a C++
    compiler, as inductor does; raises RuntimeError naming the build dir if the build fails.
    Waits for a `prebuild` in flight."""
    global _loaded_isa
    isa = _resolved(isa)
    if _loaded_isa is not None and isa in (None, _loaded_isa):
        return
    with _loading:
        if _loaded_isa is not None:
            conflict = isa_conflict(isa)
            if conflict is not None:
                raise RuntimeError(conflict)
            return
        isa = isa or _default_isa()
        _build_and_load(isa)
        _loaded_isa = isa


def prebuild(isa: str | None = None) -> None:
    """Start the one-time build's compiler (about 12 s, in a subprocess: another core) before
    returning, and `load(isa)` in a background thread that waits for it, so that the build
    overlaps whatever the caller does next, such as importing transformers and reading a model;
    the first `load`/`available` call waits for it. A failed background build is not reported
    here: the next `load` retries and raises, and `available` logs it. No-op when the kernels
    are loaded or a prebuild already started. The thread is not a daemon: the interpreter waits
    for it at exit, so a finished compile is always moved into place."""
    global _prebuilding, _prebuild_isa
    if _loaded_isa is not None or _prebuilding is not None:
        return
    _prebuild_isa = resolve_isa(isa or "native")
    # The compiler starts here, not in the thread: the thread would wait for the GIL and the
    # import lock behind the caller's imports (its first log line came 6.6 s after start).
    if _loading.acquire(blocking=False):  # else a load is under way
        try:
            _start_compile(_build(_prebuild_isa))
        except Exception:  # noqa: BLE001  (the thread's load raises it again)
            logger.debug("starting the kernel build failed", exc_info=True)
        finally:
            _loading.release()

    def build() -> None:
        try:
            load(isa)
        except Exception:  # noqa: BLE001  (reported by the caller's own load)
            logger.debug("background kernel build failed", exc_info=True)

    _prebuilding = threading.Thread(target=build, name="ember-kernel-build")
    _prebuilding.start()


class _Build(NamedTuple):
    """One build of the kernels: the library's path, the compiler command that writes it, and
    whether it has the fast calls."""

    library: str
    command: list[str]
    fast_calls: bool = False


def _build(isa: str) -> _Build:
    return _build_with(isa, (*_CFLAGS, *(_NO_SIMD_FLAGS if _no_simd() else _ISA_FLAGS[isa])))


@functools.cache
def _build_with(isa: str, cflags: tuple[str, ...]) -> _Build:
    """The build for `isa` with `cflags` and where it lives: one directory per source, flags,
    exact target, torch version and ATen CPU capability (memoized: a fallback build directory
    is a fresh one per call)."""
    # The fast calls (`install_fast_calls`) need Python's headers, as inductor's kernels do.
    python_include = sysconfig.get_paths()["include"]
    fast = ["-DEMBER_FAST_CALLS", "-isystem", python_include]
    if not os.path.exists(os.path.join(python_include, "Python.h")):
        fast = []
    digest = hashlib.sha256()
    for path in source_files():
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    # The exact target -march resolves to here, not only the coarse ISA: a home directory
    # shared across CPU generations never loads a library built for another CPU.
    target = cpu_target(next(f for f in cflags if f.startswith("-march=")))
    for part in (
        *fast,
        *cflags,
        target,
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
    ):
        digest.update(part.encode())
    key = digest.hexdigest()[:16]
    build_dir = _build_dir(f"ember_cpu-{isa}-{target}-{key}")
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    command = [
        os.environ.get("CXX", "c++"),
        "-shared",
        "-fPIC",
        "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        "-isystem",
        include,
        "-isystem",
        os.path.join(include, "torch", "csrc", "api", "include"),
        *fast,
        *cflags,
        *SOURCES,
        "-L" + os.path.join(os.path.dirname(torch.__file__), "lib"),
        "-lc10",
        "-ltorch_cpu",
        *(["-ltorch_python"] if fast else []),
    ]
    return _Build(os.path.join(build_dir, f"ember_cpu_{key}.so"), command, bool(fast))


# Compilers in flight (`prebuild` starts one before its thread runs): library path -> the
# process and the file it writes.
_compiling: dict[str, tuple[subprocess.Popen[bytes], str]] = {}


def _start_compile(build: _Build) -> None:
    """Run the compiler for `build` in a subprocess unless the library is built or a compiler
    for it runs already. It writes a file of its own (`<library>.<pid>.tmp`), renamed onto
    the library when it succeeds: processes building at once never load a half-written one."""
    if build.library in _compiling or os.path.exists(build.library):
        return
    logger.info("building ember_cpu kernels into %s (once per machine)", build.library)
    output = f"{build.library}.{os.getpid()}.tmp"
    try:
        compiler = subprocess.Popen(
            [*build.command, "-o", output], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    except OSError as e:
        raise RuntimeError(
            f"cannot build ember's C++ kernels: no C++ compiler ({build.command[0]!r}: {e}; "
            "install g++ or clang++, or name one in $CXX)"
        ) from e
    _compiling[build.library] = compiler, output


def _build_and_load(isa: str) -> None:
    build = _build(isa)
    _start_compile(build)
    if build.library in _compiling:
        compiler, output = _compiling.pop(build.library)
        log, _ = compiler.communicate()
        if compiler.returncode != 0:
            with contextlib.suppress(OSError):
                os.remove(output)
            text = log.decode(errors="replace")[-4000:]
            raise RuntimeError(f"cannot build ember's C++ kernels ({build.library}): {text}")
        os.replace(output, build.library)
    logger.info("loading ember_cpu kernels from %s", build.library)
    try:
        torch.ops.load_library(build.library)
    except OSError as e:
        raise RuntimeError(f"cannot load ember's C++ kernels from {build.library}: {e}") from e
    global _panel, _bf16_pairs
    _panel = int(torch.ops.ember_cpu.pack_linear_weight(torch.zeros(1, 1)).shape[2])
    if _panel != _expected_panel(isa):  # weights may already be laid out for the expected one
        raise RuntimeError(
            f"ember's kernels in {build.library} have panels of {_panel} channels, not the "
            f"{_expected_panel(isa)} expected for cpu_isa={isa!r} on this CPU"
        )
    try:  # builds without AVX512-BF16 refuse to pack pairs
        torch.ops.ember_cpu.pack_bf16_pairs(torch.zeros(1, 2, dtype=torch.bfloat16))
        _bf16_pairs = True
    except RuntimeError:
        _bf16_pairs = False
    _register_fakes()
    global _fast_calls
    _fast_calls = _load_fast_calls(build)


# The ops a compiled graph calls once per layer (or more); see `install_fast_calls`.
FAST_OPS = (
    "group_linear", "packed_linear", "bf16_linear", "fp32_linear", "paged_attention",
    "paged_attention_opaque",
)  # fmt: skip
# In torch's cache keys of graphs compiled once `install_fast_calls` ran.
FAST_CALLS_TAG = "ember-fast-calls-1"
# {op: the callable compiled graphs call for it}: the build's fast call, else the Python op.
_fast_calls: dict[str, Any] = {}


def _load_fast_calls(build: _Build) -> dict[str, Any]:
    ops = {name: getattr(torch.ops.ember_cpu, name).default for name in FAST_OPS}
    if not build.fast_calls:
        return ops
    try:  # optional: the kernels load and run through their ops without them
        entry = ctypes.PyDLL(build.library).ember_cpu_fast_calls
        entry.restype = ctypes.py_object
        entry.argtypes = [ctypes.py_object]
        calls = entry({f"ember_cpu::{name}": op for name, op in ops.items()})
        probe = torch.zeros(1)
        layout_ok = calls["tensor_impl"](probe) == probe._cdata  # the tensor layout it reads
    except Exception as e:  # noqa: BLE001
        logger.warning("ember's fast kernel calls failed to load (%s); using the op calls", e)
        return ops
    if not layout_ok:
        logger.warning("ember's fast kernel calls do not match this torch; using the op calls")
        return ops
    return {name: calls[f"ember_cpu::{name}"] for name in FAST_OPS}


def install_fast_calls() -> None:
    """Have inductor's generated code call `FAST_OPS` through the build's fast calls.

    A compiled graph's wrapper code (Python) calls each op as `torch.ops.ember_cpu.<op>
    .default(...)`: Python's op machinery (arguments boxed against the schema, the GIL
    dropped, unboxed again) cost 1.5-2.3 us more per call than a fast call (a 64x64 int4
    `group_linear`: 3.08 against 1.53 us on 1 thread, 5.25 against 2.96 on 2; AMD EPYC), and
    a 12-layer model makes 60 such calls per batch-1 step. The fast calls (`ember_cpu_fast_calls` in
    csrc/fast_calls.h) are Python builtins that read the arguments straight from the Python
    objects and call the same op through the dispatcher's unboxed path (profiling and dispatch
    modes kept); any argument they do not read (a tensor subclass, a SymInt) goes to the op.
    Generated code names them `extern_kernels.ember_cpu_<op>` (inductor's namespace for
    extern kernels, imported by every wrapper), which is bound to the Python op itself when the
    build has no fast calls, so a cached graph runs either way. The hook is not part of
    inductor's cache keys, so this also adds `FAST_CALLS_TAG` to torch's `cache_key_tag`: a
    graph compiled with the fast calls is never served from torch's caches to a process that
    has not installed them (where `extern_kernels` lacks their names). Needs the kernels loaded
    (a no-op before); idempotent. Reads inductor internals (torch is pinned): where they
    differ, graphs keep the op calls.
    """
    if not _fast_calls:
        return
    try:
        from torch._inductor.codegen.custom_extern_kernel_codegen import (
            CUSTOM_EXTERN_KERNEL_CODEGEN,
            CustomCodegen,
        )
        from torch._inductor.select_algorithm import extern_kernels
    except ImportError:
        return
    for name, call in _fast_calls.items():
        setattr(extern_kernels, f"ember_cpu_{name}", call)
        CUSTOM_EXTERN_KERNEL_CODEGEN[f"torch.ops.ember_cpu.{name}.default"] = CustomCodegen(
            python=functools.partial(_fast_call_line, f"extern_kernels.ember_cpu_{name}")
        )
    tag = torch.compiler.config.cache_key_tag
    if FAST_CALLS_TAG not in tag.split("|"):
        torch.compiler.config.cache_key_tag = f"{tag}|{FAST_CALLS_TAG}" if tag else FAST_CALLS_TAG


def _fast_call_line(kernel: str, node: Any, writeline: Any) -> None:
    """The wrapper line of one op's call (what inductor writes for an op's fallback kernel)."""
    args = ", ".join([*node.codegen_args(), *node.codegen_kwargs()])
    writeline(f"{node.get_name()} = {kernel}({args})")


def _build_dir(name: str) -> str:
    """`<user cache>/kernels/<name>`, created 0700; a fresh private temporary directory (the
    kernels are rebuilt, about 8 s) when that one is unsafe to load a library from."""
    path = private_dir(user_cache_dir("kernels", name), "kernel cache")
    return path if path is not None else tempfile.mkdtemp(prefix="ember-kernels-")  # 0700


@functools.cache
def _build_failed(isa: str | None) -> str | None:
    try:
        load(isa)
    except RuntimeError as e:
        logger.warning("%s; using the PyTorch fallbacks", e)
        return str(e)
    return None


def available(isa: str | None = None) -> bool:
    """True when the kernels are loaded (for `isa`, as `load` takes it); False (logged once)
    when they cannot be built here, and callers with a pure-PyTorch path take it."""
    isa = _resolved(isa)
    if _loaded_isa is not None and isa in (None, _loaded_isa):
        return True
    return _build_failed(isa or _default_isa()) is None  # one failure, one warning
