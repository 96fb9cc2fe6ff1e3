"""Regional compilation: a model's decoder layers traced and compiled once per distinct kind.

The layers of a decoder are the same code over different weights. Each is called through one
`torch.compiler.nested_compile_region`: inside the one fullgraph `torch.compile` of a step,
Dynamo traces the first layer into a subgraph and reuses it for every later layer whose inputs
and guards match (the weights become the subgraph's inputs), and AOTAutograd and inductor
compile that subgraph once. Layers that differ (Gemma's sliding and global layers: another
`sliding_window`, another rotary table) get a subgraph each. Graphs stay whole (one per token
bucket, one compile site, the same custom-op boundaries), so the runner, the compile cache and
the flat calls see no difference.

Three things torch 2.13 needs for it, each kept to this module:
- the attention call in a region is `ember_cpu::paged_attention_opaque`: the same kernel as
  `ember_cpu::paged_attention` with the cache write left out of its schema. A region's subgraph
  is functionalized by `torch.func.functionalize`, which rejects a custom op that declares a
  mutation (pytorch/pytorch#189523, fixed after 2.13). Declaring none is sound here, as it is
  for vLLM's attention op (which reads its cache from a context, out of the compiler's view):
  a layer's cache is read and written by that one call per graph, and by nothing else.
- the attention metadata enters a region as a tuple of tensors (Dynamo reuses a subgraph only
  for inputs it can compare: tensors, constants, modules), rebuilt inside.
- Dynamo refuses inputs that alias one another in a region (`supports_aliasing`), a check for
  mutations through aliases; a layer's weights are views of one packed buffer and the metadata
  views of one step buffer, and nothing in a region mutates them. `compile_settings` lifts the
  check while graphs compile (`allow_aliased_inputs`).

A whole-model graph fuses across layer boundaries (a residual add with the next layer's norm)
and calls no subgraph; where that wins, `EngineArgs.regional_compile` keeps it (see
`use_regions`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from ember.attention.metadata import AttentionMetadata

# Whole-model graphs below this many decoder layers (measured: see `use_regions`).
MIN_LAYERS = 8


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The model's decoder layers that can be regions, in order, or None.

    A layer qualifies when exactly one of its submodules is an attention with a `layer_idx`
    (its KV cache's index) and it has no cross-attention (Mllama's and encoder-decoder layers
    stay whole-graph). The layers are the longest `nn.ModuleList` of such layers."""
    best: list[torch.nn.Module] | None = None
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        indices = [_kv_index(layer) for layer in module]
        if any(i is None for i in indices) or len(set(indices)) != len(indices):
            continue
        if best is None or len(module) > len(best):
            best = list(module)
    return best


def _kv_index(layer: torch.nn.Module) -> int | None:
    found = [
        m
        for m in layer.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")
    ]
    if len(found) != 1 or getattr(found[0], "_ember_cross_attention", False):
        return None
    if any("cross" in type(m).__name__.lower() for m in layer.modules()):
        return None
    return found[0].layer_idx


def use_regions(model: torch.nn.Module, requested: bool | None, supported: bool = True) -> bool:
    """Whether `model`'s graphs are compiled by regions: `requested` when given, else when it
    has at least `MIN_LAYERS` decoder layers. `supported`: the engine can (an attention
    backend with an opaque op, weights not frozen). True where it cannot, or on a model
    without qualifying layers, is a ValueError."""
    layers = decoder_layers(model)
    if requested is None:
        return supported and layers is not None and len(layers) >= MIN_LAYERS
    if requested and (layers is None or not supported):
        why = (
            f"{type(model).__name__} has no repeated decoder layers ember can compile as "
            "regions (one self-attention each, no cross-attention)"
            if layers is None
            else "needs a decoder-only text model, the torch attention backend and "
            "freeze_weights=False"
        )
        raise ValueError(f"regional_compile=True: {why}")
    return requested


def apply_regions(model: torch.nn.Module) -> int:
    """Route every decoder layer of `model` through the one region; returns the layer count.
    Idempotent. Eager calls are unchanged (the region is a plain call outside compilation),
    except that attention runs its opaque op."""
    layers = decoder_layers(model) or []
    for layer in layers:
        if "forward" not in vars(layer):
            layer.forward = _RegionCall(layer, _kv_index(layer))
    return len(layers)


class _RegionCall:
    """A layer's `forward`: takes this layer's cache (`kv_index`) out of `kv_caches` and the
    metadata's tensors out of their dataclass, and calls the region."""

    def __init__(self, layer: torch.nn.Module, kv_index: int) -> None:
        self.layer = layer
        self.kv_index = kv_index

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        kv_cache = kwargs.pop("kv_caches")[self.kv_index]
        meta: AttentionMetadata = kwargs.pop("attn_metadata")
        fields = tuple(getattr(meta, f.name) for f in dataclasses.fields(meta))
        return _layer_region(self.layer, hidden_states, kv_cache, fields, args, kwargs)


def _layer(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: tuple[torch.Tensor | None, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    return type(layer).forward(
        layer,
        hidden_states,
        *args,
        attn_metadata=AttentionMetadata(*meta),
        kv_cache=kv_cache,
        **kwargs,
    )


_layer_region = torch.compiler.nested_compile_region(_layer)


@contextlib.contextmanager
def allow_aliased_inputs() -> Iterator[None]:
    """Let a region take inputs that alias one another (see the module docstring). Reads a
    Dynamo internal (torch is pinned): where it is missing, nothing is patched, and a region
    with aliased inputs fails to compile with Dynamo's own message."""
    try:
        from torch._dynamo.variables.invoke_subgraph import InvokeSubgraphHigherOrderVariable
    except ImportError:
        yield
        return
    previous = InvokeSubgraphHigherOrderVariable.supports_aliasing
    InvokeSubgraphHigherOrderVariable.supports_aliasing = True
    try:
        yield
    finally:
        InvokeSubgraphHigherOrderVariable.supports_aliasing = previous
