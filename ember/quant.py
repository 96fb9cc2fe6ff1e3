"""Weight-only int8 quantization: int8 weights with one fp32 scale per output channel, fp32 math.

A batch-1 decode step reads every weight once, so its floor is weight bytes / memory bandwidth;
int8 storage reads a quarter of fp32's bytes (half of bf16's). Activations, the KV cache and
the accumulation stay fp32: `aten._weight_int8pack_mm` converts each int8 weight row to fp32
in registers inside its GEMV/GEMM loop, so no dequantised copy of the weight is ever written.

Quantised: every `nn.Linear` of the model, including an LM head tied to the input embedding
(the head gets its own int8 copy; the embedding table stays in the run dtype, since a lookup
reads one row of it). Symmetric per-output-channel scales, `scale = max|w_row| / 127`.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATIONS = ("int8",)


class Int8Linear(nn.Module):
    """`y = (x @ w_int8.T) * scale + bias` with fp32 accumulation; a drop-in for nn.Linear."""

    weight_int8: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer(
            "weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def weight(self) -> torch.Tensor:
        """HF code reads `proj.weight.dtype`/`.device`; the int8 tensor answers for device."""
        return self.weight_int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, self.in_features), self.weight_int8, self.scales
        )
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8_(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` with an Int8Linear, in place; returns how many."""
    targets = [
        (name, module) for name, module in model.named_modules() if type(module) is nn.Linear
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(linear))
    return len(targets)
