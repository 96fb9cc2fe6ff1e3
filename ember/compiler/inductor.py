"""CPU inductor and dynamo settings, applied by a context manager around compilation only."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class DedupePureOps(CustomGraphPass):
    """Post-grad pass: one node per (pure op, arguments), so the slices of a fused projection
    (`ember.compiler.quant.FusedSlice`: q_proj, k_proj and v_proj each call the fused linear
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


def _vec_isa_candidates() -> list[str]:
    """The vector ISAs inductor considers on this CPU: those its flags name, best first (what
    inductor's `valid_vec_isa_list` probes). Reads torch internals (torch is pinned)."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    return [
        str(isa)
        for isa in cpu_vec_isa.supported_vec_isa_list
        if all(flag in flags for flag in str(isa).split())
    ]


def vec_isa_probe() -> dict[str, list[str]] | None:
    """What inductor's C++ vector-ISA probe found in this process: the ISAs this CPU's flags
    name (`candidates`) and those that passed the probe (`valid`); None off x86 or where
    torch's internals are not the ones this reads.

    The probe builds a test kernel per ISA and loads it in a child Python, once per process:
    on AMD EPYC (Zen 4, 2 cores) ~1 s of a 3.2-3.4 s warm start of llama-160m, every start.
    The compile cache records the result with an entry (`ember.compiler.cache.mark_complete`)
    so that a warm start of that entry, whose key pins the exact CPU target and torch, can
    skip it (`compile_settings(trust_vec_isa=True)`). None too where the probe did not run
    (the user's TORCHINDUCTOR_VEC_ISA_OK decided)."""
    if torch._inductor.config.cpp.vec_isa_ok is not None:
        return None
    try:
        from torch._inductor import cpu_vec_isa

        candidates = _vec_isa_candidates()
        valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    except Exception:  # noqa: BLE001 - torch's internals changed: no record, no skip
        return None
    return {"candidates": candidates, "valid": valid} if candidates else None


def vec_isa_trusted(recorded: Any) -> bool:
    """Whether inductor may skip its vector-ISA probe (`cpp.vec_isa_ok`) given the probe
    result `recorded` with a cache entry: every ISA this CPU's flags named passed it then, and
    the flags name the same ISAs now. A TORCHINDUCTOR_VEC_ISA_OK of the user's own wins."""
    if torch._inductor.config.cpp.vec_isa_ok is not None or not isinstance(recorded, dict):
        return False
    candidates = recorded.get("candidates")
    if not candidates or recorded.get("valid") != candidates:
        return False
    try:
        return _vec_isa_candidates() == candidates
    except Exception:  # noqa: BLE001
        return False


@contextlib.contextmanager
def compile_settings(
    freezing: bool, inductor_cache_dir: str | None = None, trust_vec_isa: bool = False
) -> Iterator[None]:
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
    - `inductor_cache_dir`: where inductor keeps FX graphs and built C++ kernels while this
      context is open (torch reads it from the environment on every lookup); restored after.
    - `trust_vec_isa`: inductor's vector-ISA probe is skipped (`cpp.vec_isa_ok`), for a
      cache entry whose recorded probe passed every ISA (`vec_isa_trusted`). Inductor picks
      the same ISA either way, so the entry's kernels still match. Warm start to a ready
      engine, AMD EPYC (Zen 4, 2 cores), processes alternated: llama-160m Q4_0 GGUF
      2.95 / 3.62 / 3.67 / 3.53 s probing, 2.08 / 2.61 / 2.51 / 2.30 trusting the record.
    """
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
            torch._inductor.config.patch(
                freezing=freezing,
                size_asserts=False,
                alignment_asserts=False,
                scalar_asserts=False,
                post_grad_custom_pre_pass=DedupePureOps(),
                **({"cpp.vec_isa_ok": True} if trust_vec_isa else {}),
            ),
        ):
            yield
    finally:
        if inductor_cache_dir is not None:
            if previous is None:
                os.environ.pop(_CACHE_ENV, None)
            else:
                os.environ[_CACHE_ENV] = previous
