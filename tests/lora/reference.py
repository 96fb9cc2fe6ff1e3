"""Naive per-token LoRA oracle. Used only by tests."""

from __future__ import annotations

import torch


def ref_lora_delta(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """delta[t] = (x[t] @ A[s]^T) @ B[s]^T for s = slots[t] >= 0, else 0; float32."""
    out = torch.zeros(x.shape[0], lora_b.shape[1])
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s >= 0:
            out[t] = (x[t].float() @ lora_a[s].float().T) @ lora_b[s].float().T
    return out
