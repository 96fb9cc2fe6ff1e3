"""Per-sequence float32 attention oracle. Used only by tests."""

from __future__ import annotations

import math

import torch


def ref_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence's new tokens over its whole context, naively, in float32.

    query [num_new, num_heads, head_dim] for the last `num_new` positions of the context;
    key/value [seq_len, num_kv_heads, head_dim] for every position 0..seq_len-1; `sinks
    [num_heads]`: a logit per head in the softmax's denominator, with no value (gpt-oss).
    Returns [num_new, num_heads, head_dim] in float32.
    """
    num_new, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_new, num_heads, head_dim, dtype=torch.float32)
    q32, k32, v32 = query.float(), key.float(), value.float()
    for i in range(num_new):
        pos = seq_len - num_new + i
        for h in range(num_heads):
            kv = h // group
            scores = []
            for j in range(seq_len):
                visible = (not causal or j <= pos) and (
                    sliding_window <= 0 or j > pos - sliding_window
                )
                if not visible:
                    continue
                s = float(q32[i, h] @ k32[j, kv]) * scale
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                scores.append((s, j))
            sink = [] if sinks is None else [float(sinks[h])]
            m = max([s for s, _ in scores] + sink)
            weights = [(math.exp(s - m), j) for s, j in scores]
            total = sum(w for w, _ in weights) + sum(math.exp(s - m) for s in sink)
            for w, j in weights:
                out[i, h] += (w / total) * v32[j, kv]
    return out
