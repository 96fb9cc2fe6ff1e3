"""CPU inductor and dynamo settings, applied by a context manager around compilation only."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ember.compile.regions import allow_aliased_inputs

_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class DedupePureOps(CustomGraphPass):
    """Post-grad pass: one node per (pure op, arguments), so the slices of a fused projection
    (`ember.model.layers.FusedSlice`: q_proj, k_proj and v_proj each call the fused linear
    on the same input) run one GEMV. Only ops that mutate nothing and draw no random numbers
    are merged (AOTAutograd's own CSE runs for training graphs only)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[tuple[Any, ...], torch.fx.Node] = {}
        for node in list(graph.nodes):
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
                continue
            if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
                continue
            try:
                key = (target, _hashable(node.args), _hashable(node.kwargs))
                hash(key)
            except TypeError:
                continue
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(value).__name__, str(value))
    return value


@contextlib.contextmanager
def vec_isa_probes(known: Iterable[str] = ()) -> Iterator[list[str]]:
    """Inductor's dlopen probe of its vector-ISA test libraries, remembered: within this block
    a library at a path in `known` (one that loaded in an earlier probe on this machine)
    passes without a probe, and the paths of libraries that pass a real probe are appended
    to the list this yields.

    Inductor checks every vector ISA the CPU's flags name (and AVX512-BF16, VNNI and AMX on
    top) once per process: it builds a test library per check (kept in its cache dir) and
    loads it in a child Python, ~0.2 s a child. Measured on AMD EPYC (Zen 4, 2 cores): ~1 s
    of a 3.2-3.4 s warm start of llama-160m, every start. The compile cache records the
    libraries that passed with an entry (`ember.compile.cache.mark_complete`); they sit in
    the entry's own inductor dir, whose key pins the exact CPU target and torch, so a warm
    start of that entry loads nothing it has not loaded before. Reads inductor internals
    (torch is pinned): where they differ, probes run as always and nothing is recorded."""
    passed: list[str] = []
    try:
        from torch._inductor.cpu_vec_isa import VecISA

        original = VecISA._probe_load
    except (ImportError, AttributeError):
        yield passed
        return
    trusted = set(known)

    def probe(self: Any, output_path: str) -> bool:
        if output_path in trusted:
            return True
        ok = original(self, output_path)
        if ok:
            passed.append(output_path)
        return ok

    VecISA._probe_load = probe
    try:
        yield passed
    finally:
        VecISA._probe_load = original


def cpp_compiler_missing() -> str | None:
    """Why inductor cannot build its C++ kernels here (no working compiler in
    `torch._inductor.config.cpp.cxx`, i.e. g++ or $CXX), or None."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001  (inductor's InvalidCxxCompiler, or a failing probe)
        return str(e)
    return None


def tag_vec_isa() -> None:
    """Add ATen's CPU capability to torch's `cache_key_tag`: inductor generates code for the
    vector ISA it follows (`ATEN_CPU_CAPABILITY`), and torch's FX graph cache keys a graph
    without it. A process capped at AVX2 (`EMBER_CPU_ISA=avx2`, `ember bench --cpu-isa avx2`)
    was served an AVX-512 process's generated code from the shared inductor cache and built it
    with AVX2 flags, and the other way round: 8-lane loops over 16-lane vectors corrupted the
    heap, 16-lane loops over 8-lane ones left half of each row unwritten
    (tests/kernels/test_linears.py's fused projections, Intel Xeon with AMX). ATen's answer, not
    inductor's own pick: that one probes by building and loading test libraries (~1 s of a
    warm start). Idempotent; the tag stays for the process, whose capability does not change."""
    tag = f"ember-aten-{torch.backends.cpu.get_cpu_capability().replace(' ', '_')}"
    current = torch.compiler.config.cache_key_tag
    if tag not in current.split("|"):
        torch.compiler.config.cache_key_tag = f"{current}|{tag}" if current else tag


@contextlib.contextmanager
def compile_settings(freezing: bool, inductor_cache_dir: str | None = None) -> Iterator[None]:
    """Settings in force while graphs are compiled (warm-up), never set at import.

    - automatic dynamic shapes off: only the dims the runner marks are dynamic, so a static
      bucket never silently turns into a dynamic graph.
    - freezing: weights become constants that inductor folds and prepacks (oneDNN blocked
      layout) for the CPU GEMMs. Measured on llama-160m, static graphs: 32 decodes 102 ms
      frozen vs 140 ms not, 128-token prefill 95 vs 135 ms; batch-1 decode 30 vs 25 ms; on the
      dynamic graph it is slower (32 decodes 148 vs 125 ms). Frozen graphs cannot be cached
      (packed weights do not pickle), so it is off by default (`EngineConfig.freeze_weights`).
    - no size, alignment or scalar asserts in the generated code: the runner builds every
      input itself, and a batch-1 llama-160m decode step ran 228 size asserts (0.13 ms of the
      step, cProfile).
    - `DedupePureOps`: one call per pure op and arguments (the fused q/k/v and gate/up GEMVs).
    - regions may take inputs that alias one another (`ember.compile.regions`).
    - `inductor_cache_dir`: where inductor keeps FX graphs and built C++ kernels while this
      context is open (torch reads it from the environment on every lookup); restored after.
    """
    tag_vec_isa()
    previous = os.environ.get(_CACHE_ENV)
    if inductor_cache_dir is not None:
        os.environ[_CACHE_ENV] = inductor_cache_dir
    try:
        with (
            torch._dynamo.config.patch(
                automatic_dynamic_shapes=False,
                cache_size_limit=64,
                accumulated_cache_size_limit=256,
            ),
            allow_aliased_inputs(),
            torch._inductor.config.patch(
                freezing=freezing,
                size_asserts=False,
                alignment_asserts=False,
                scalar_asserts=False,
                post_grad_custom_pre_pass=DedupePureOps(),
            ),
        ):
            yield
    finally:
        if inductor_cache_dir is not None:
            if previous is None:
                os.environ.pop(_CACHE_ENV, None)
            else:
                os.environ[_CACHE_ENV] = previous
