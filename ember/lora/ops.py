"""LoRA custom ops: `ember::lora_shrink` (x @ A^T) and `ember::lora_expand` (h @ B^T), each over
stacked slot weights and a per-token slot index (-1: the token uses no adapter).

Segment GEMM: tokens are grouped by slot and each adapter in use runs one matmul over its own
tokens, so the work grows with the tokens that use an adapter, never a weight gather per token.
Math in float32 whatever the storage dtype. Opaque to torch.compile (fake impls give shapes),
so loading or swapping adapters (writes into the slot tensors) never recompiles.
"""

from __future__ import annotations

import torch

from ember.kernels.library import define_op


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


def _lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], lora_a [max_loras, max_rank, in], slots [T] -> [T, max_rank] float32."""
    return _segment_matmul(x, lora_a, slots)


def _lora_expand(h: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """h [T, max_rank], lora_b [max_loras, out, max_rank] (scaling folded in), slots [T]
    -> [T, out] float32."""
    return _segment_matmul(h, lora_b, slots)


def _rows_by_weight_rows(
    x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weights.shape[1], dtype=torch.float32)


lora_shrink = define_op("lora_shrink", _lora_shrink, _rows_by_weight_rows)
lora_expand = define_op("lora_expand", _lora_expand, _rows_by_weight_rows)
