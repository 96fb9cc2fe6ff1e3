"""ember's function in transformers' attention registry: maps HF call args to op args.

Traced by torch.compile: no `.item()`, no branching on tensor values, no globals read.
The per-step tensors arrive as explicit keyword arguments of the HF forward call
(`attn_metadata`, `kv_caches`), which transformers passes through to every attention call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface

from ember.attention import AttentionBackend
from ember.attention import ops as _ops  # noqa: F401  (registers ember::cross_attention_ranges)
from ember.attention.metadata import AttentionMetadata

# Architectures whose sliding window HF applies through the mask alone (the attention call
# gets no `sliding_window`): ember, which builds no mask, reads it from the config.
WINDOW_ONLY_IN_MASK = frozenset({"phimoe"})


def _attention_forward(
    op: Callable[..., torch.Tensor],
    opaque_op: Callable[..., torch.Tensor] | None,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, num_heads, num_tokens, head_dim]; key/value [1, num_kv_heads, num_tokens,
    head_dim].

    Returns attn_output [1, num_tokens, num_heads, head_dim], as HF's attention functions do.

    In a compiled region (`ember.compile.regions`) the layer's own cache arrives as
    `kv_cache` and the backend's `opaque_op` (no mutation in its schema) runs instead of `op`.
    """
    meta: AttentionMetadata = kwargs["attn_metadata"]
    head_dim = query.shape[-1]
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)
    slots = meta.slot_mapping
    seq_lens: torch.Tensor | None = meta.seq_lens
    tables: torch.Tensor | None = meta.block_tables
    causal = bool(getattr(module, "is_causal", True))
    config = getattr(module, "config", None)
    if sliding_window is None and getattr(config, "model_type", None) in WINDOW_ONLY_IN_MASK:
        sliding_window = config.sliding_window
    if "kv_cache" in kwargs:
        kv_cache = kwargs["kv_cache"]
        if opaque_op is None:
            raise RuntimeError("a compiled region ran on a backend without an opaque op")
        op = opaque_op
    else:
        kv_cache = kwargs["kv_caches"][module.layer_idx]
    cross = getattr(module, "_ember_cross_attention", False)
    if cross == "ranges":
        # A vision-language model's cross-attention: each token attends its own range of its
        # sequence's image K/V (written once per request by the vision pass, see
        # `ember.compile.capture.capture_vision_forward`); HF's key/value are ignored.
        out = torch.ops.ember.cross_attention_ranges(
            query[0].transpose(0, 1),
            kv_cache,
            meta.query_start_loc,
            meta.cross_seq_lens,
            meta.cross_block_tables,
            meta.cross_token_ranges,
            float(scaling if scaling is not None else head_dim**-0.5),
        )
        return out[None], None
    if cross:
        # Cross-attention: K/V of the encoder output were written once per request (see
        # `ember.compile.capture.capture_encoder_forward`); the HF module's own key/value
        # (of a 1-row placeholder) are ignored, nothing is written, every encoder row is seen.
        key, value, slots = key[:0], value[:0], slots[:0]
        seq_lens, tables = meta.cross_seq_lens, meta.cross_block_tables
        sliding_window, softcap, causal = None, None, False
    out = op(
        query[0].transpose(0, 1),
        key,
        value,
        kv_cache,
        slots,
        meta.query_start_loc,
        seq_lens,
        tables,
        float(scaling if scaling is not None else head_dim**-0.5),
        int(sliding_window or 0),
        float(softcap or 0.0),
        causal,
    )
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # gpt-oss, Granite-SWA: a learned logit per head in the softmax
        out = torch.ops.ember.sink_scale(
            out, query[0].transpose(0, 1), kv_cache, meta.query_start_loc, seq_lens, tables,
            sinks, float(scaling if scaling is not None else head_dim**-0.5),
            int(sliding_window or 0), float(softcap or 0.0), causal,
        )  # fmt: skip
    return out[None], None


def register_attention(
    backend: AttentionBackend, cpu_isa: str | None = None, resolve: bool = True
) -> str:
    """Register `backend`'s op (for ember's `cpu_isa` kernel build) in transformers' attention
    registry; returns the `attn_implementation` name to load a model with ("ember_torch",
    "ember_triton", ...). `resolve=False`: only the name, for building a model while the
    kernels build (`ember.kernels.prebuild`); register again before it runs."""
    name = f"ember_{backend.name}"
    if not resolve:
        AttentionInterface.register(name, _unresolved)
        return name
    op = backend.load_op(cpu_isa)
    opaque = backend.load_opaque_op(cpu_isa)
    AttentionInterface.register(name, functools.partial(_attention_forward, op, opaque))
    return name


def _unresolved(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("ember's attention ran before its op was resolved (register_attention)")
