"""Narrow weights, fp32 math: weight-only int8 (`Int8Linear`) and bf16 (`Bf16Linear`) linears.

bf16 models: every nn.Linear becomes a `Bf16Linear` holding the same bf16 weight (tied heads
stay tied). Steps of up to `kGemvMaxRows` tokens (8, `ember/kernels/csrc`; decodes) run ember's
fused GEMV, widening bf16 rows to fp32 in registers (measured on the 85 llama-160m projections at
batch 1: 9.5-13.0 ms vs 18.0-23.4 ms through ATen's bf16 matmul); larger steps go to ATen's
bf16 GEMM (oneDNN: AMX / AVX512-BF16 where present).

Weight-only int8: int8 weights with one fp32 scale per output channel, fp32 math.

A batch-1 decode step reads every weight once, so its floor is weight bytes / memory bandwidth;
int8 storage reads a quarter of fp32's bytes (half of bf16's). Activations, the KV cache and
the accumulation stay fp32: `ember_cpu::woq_int8_linear` (`ember.kernels`) widens int8 weight
rows to fp32 in registers inside its GEMV, or tile by tile in L2 for large steps, so no
dequantised copy of a whole weight is ever written.

Quantised: every `nn.Linear` of the model, including an LM head tied to the input embedding
(the head gets its own int8 copy; the embedding table stays in the run dtype, since a lookup
reads one row of it). Symmetric per-output-channel scales, `scale = max|w_row| / 127`.
"""

from __future__ import annotations

import torch
from torch import nn

from ember import kernels

# Weight-only quantization schemes (`EngineArgs.quantization`).
QUANTIZATIONS = ("int8",)


class Int8Linear(nn.Module):
    """`y = (x @ w_int8.T) * scale + bias` with fp32 accumulation; a drop-in for nn.Linear."""

    weight_int8: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        kernels.load()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer(
            "weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("scales", scale)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @property
    def weight(self) -> torch.Tensor:
        """HF code reads `proj.weight.dtype`/`.device`; the int8 tensor answers for device."""
        return self.weight_int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ember_cpu.woq_int8_linear(x, self.weight_int8, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class GemvLinear(nn.Module):
    """nn.Linear with a bf16 or fp32 weight through ember's kernels (`ember_cpu::bf16_linear` /
    `fp32_linear`): the fused GEMV for decode-sized steps; see the module doc for larger ones.
    Holds the same weight Parameter, so tied weights stay tied."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        kernels.load()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        if self.weight.dtype == torch.bfloat16:
            self.op = torch.ops.ember_cpu.bf16_linear.default
        elif self.weight.dtype == torch.float32:
            self.op = torch.ops.ember_cpu.fp32_linear.default
        else:
            raise ValueError(f"GemvLinear needs a bf16 or fp32 weight, got {self.weight.dtype}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        dtype = str(self.weight.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, {dtype} GEMV"


def _replace_linears(model: nn.Module, make: type[nn.Module]) -> int:
    targets = [
        (name, module) for name, module in model.named_modules() if type(module) is nn.Linear
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(linear))
    return len(targets)


def use_gemv_(model: nn.Module) -> int:
    """Route every bf16/fp32 nn.Linear of `model` through `GemvLinear`, in place; returns how
    many."""
    return _replace_linears(model, GemvLinear)


def quantize_int8_(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` with an Int8Linear, in place; returns how many."""
    return _replace_linears(model, Int8Linear)
