"""LoRA custom ops: `ember::lora_shrink` (x @ A^T) and `ember::lora_expand` (h @ B^T), each over
stacked slot weights and a per-token slot index (-1: the token uses no adapter).

Segment GEMM: tokens are grouped by slot and each adapter in use runs one matmul over its own
tokens, so the work grows with the tokens that use an adapter, never a weight gather per token.
Math in float32 whatever the storage dtype. Opaque to torch.compile (fake impls give shapes),
so loading or swapping adapters (writes into the slot tensors) never recompiles.
"""

from __future__ import annotations

import torch


def _segments(slots: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """(slot, token rows) per slot in use; rows None when every token uses that slot."""
    used = torch.unique(slots).tolist()
    if used == [-1] or not used:
        return []
    if len(used) == 1:
        return [(used[0], None)]
    return [(s, torch.nonzero(slots == s).flatten()) for s in used if s >= 0]


def _segment_matmul(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out[t] = x[t] @ weights[slots[t]]^T (0 where slots[t] < 0). x [T, k], weights [S, n, k]."""
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=torch.float32)
    for slot, rows in _segments(slots):
        w = weights[slot].float()
        if rows is None:
            out = x.float() @ w.T
        else:
            out.index_copy_(0, rows, x.index_select(0, rows).float() @ w.T)
    return out


@torch.library.custom_op("ember::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], lora_a [max_loras, max_rank, in], slots [T] -> [T, max_rank] float32."""
    return _segment_matmul(x, lora_a, slots)


@lora_shrink.register_fake
def _(x, lora_a, slots):
    return x.new_empty(x.shape[0], lora_a.shape[1], dtype=torch.float32)


@torch.library.custom_op("ember::lora_expand", mutates_args=())
def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """h [T, max_rank], lora_b [max_loras, out, max_rank] (scaling folded in), slots [T]
    -> [T, out] float32."""
    return _segment_matmul(h, lora_b, slots)


@lora_expand.register_fake
def _(h, lora_b, slots):
    return h.new_empty(h.shape[0], lora_b.shape[1], dtype=torch.float32)
