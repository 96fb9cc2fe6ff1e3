"""Mixture-of-experts layers with their expert weights kept quantized: `QuantizedExperts`
replaces an HF experts module (transformers' `@use_experts_implementation` modules: Qwen2-MoE,
Qwen3-MoE, Mixtral, OLMoE, ...), whose router and top-k stay HF's code, and runs all of a
layer's experts in one op, `ember_cpu::moe_experts`, at a custom-op boundary as attention is: a
compiled graph has one node per MoE layer and no graph break for the data-dependent routing.

Each projection's experts are one stacked tensor of `GroupLinear` panels ([E, ...]: GGUF
blocks as the file holds them, or 8-bit groups of 32 for `quantization="int8"` and 4-bit
groups with offsets for "int4"), so a step reads only the experts its tokens were routed to:
for each expert hit, its rows (tokens sorted by expert) go through `ember_cpu::group_linear`
(gate and up as one call where they share a type, the activation, down), and the outputs are
summed per token, weighted by the router, in expert order as HF's eager loop sums them. The
op is C++ (csrc/moe.h, its shape function in `ember.kernels`), bit for bit `moe_experts_ref`,
its Python reference. Qwen3-30B-A3B's layer shape (128 experts, 8 a token, hidden 2048, expert
width 768), one decode token, Intel Xeon (AMX) 2 cores: 0.63 ms a layer in Q4_0 (21 MB of
experts read: 34 GB/s) and 0.95 ms in Q8_0 (40 MB: 42 GB/s), where the Python reference took
0.86 and 1.22 and HF's eager bf16 loop 5.4."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ember import kernels
from ember.host.memory import weight_zeros
from ember.model.layers.group import (
    Blocks,
    GroupLinear,
    Panels,
    Rows,
    SuperRows,
    quantize_groups,
)
from ember.model.layers.panels import GROUP_SIZE

logger = logging.getLogger("ember")

# config.hidden_act -> the gate's activation in `ember_cpu::moe_experts` (act(gate) * up).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "swish": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


def _linear(x: torch.Tensor, panels: list[torch.Tensor | None], e: int, rows: int, bits: int):
    codes, scales, mins = panels
    assert codes is not None and scales is not None
    return torch.ops.ember_cpu.group_linear(
        x, codes[e], scales[e], None if mins is None else mins[e], None, rows, bits
    )


def moe_experts_ref(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_codes: torch.Tensor,
    gate_scales: torch.Tensor,
    gate_mins: torch.Tensor | None,
    gate_rows: int,
    gate_bits: int,
    up_codes: torch.Tensor | None,
    up_scales: torch.Tensor | None,
    up_mins: torch.Tensor | None,
    up_rows: int,
    up_bits: int,
    down_codes: torch.Tensor,
    down_scales: torch.Tensor,
    down_mins: torch.Tensor | None,
    down_rows: int,
    down_bits: int,
    activation: str,
) -> torch.Tensor:
    """sum over k of top_k_weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e =
    top_k_index[t, k], for each token t of `x [T, H]`: the experts' projections are stacked
    `GroupLinear` panels ([E, ...], see the module doc). `up_codes` None: the gate's panels
    hold gate and up side by side (`gate_rows` = 2 I). Ids outside [0, E) (expert-parallel
    sentinels) add nothing. Sums in fp32, experts in increasing order."""
    num_experts = gate_codes.shape[0]
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)
    counts = torch.bincount(flat[valid], minlength=num_experts).tolist()
    token_of = order // k
    weight_of = top_k_weights.reshape(-1)[order].float()
    out = torch.zeros(tokens, x.shape[-1], dtype=torch.float32)
    act = ACTIVATIONS[activation]
    gate = [gate_codes, gate_scales, gate_mins]
    up = [up_codes, up_scales, up_mins]
    down = [down_codes, down_scales, down_mins]
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        tokens_e = token_of[start : start + count]
        weights_e = weight_of[start : start + count]
        start += count
        xe = x.index_select(0, tokens_e)
        h = _linear(xe, gate, e, gate_rows, gate_bits)
        if up_codes is None:
            g, u = h.chunk(2, dim=-1)
        else:
            g, u = h, _linear(xe, up, e, up_rows, up_bits)
        y = _linear(act(g) * u, down, e, down_rows, down_bits)
        out.index_add_(0, tokens_e, y.float() * weights_e[:, None])
    return out.to(x.dtype)


class StackedPanels(nn.Module):
    """One projection of every expert: E `GroupLinear`s' panels stacked ([E, ...] codes,
    scales and mins), an [out_features, in_features] weight of `bits`-bit codes each."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(
        self,
        num_experts: int,
        out_features: int,
        in_features: int,
        bits: int,
        offsets: bool,
        super_blocks: bool,
    ) -> None:
        super().__init__()
        codes, scales = GroupLinear.layout_shapes(
            out_features, in_features, bits, offsets, super_blocks
        )
        self.num_experts, self.out_features, self.in_features = (
            num_experts,
            out_features,
            in_features,
        )
        self.bits, self.offsets, self.super_blocks = bits, offsets, super_blocks
        self.register_buffer("codes", weight_zeros((num_experts, *codes), torch.uint8))
        self.register_buffer("scales", weight_zeros((num_experts, *scales), torch.half))
        mins = weight_zeros((num_experts, *scales), torch.half) if offsets else None
        self.register_buffer("mins", mins)

    def expert(self, e: int) -> Panels:
        """Expert `e`'s panels (views), for `GroupLinear.from_row_chunks(into=...)`."""
        return self.codes[e], self.scales[e], None if self.mins is None else self.mins[e]

    def fill(self, e: int, chunks: Iterable[Rows | SuperRows | Blocks]) -> None:
        """Pack expert `e`'s weight, given as `GroupLinear.from_row_chunks` takes it."""
        GroupLinear.from_row_chunks(self.out_features, self.bits, chunks, into=self.expert(e))

    def linear(self, e: int) -> GroupLinear:
        """Expert `e` as a `GroupLinear` over the stacked panels (no copy): for tests."""
        linear = GroupLinear.__new__(GroupLinear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.bits, linear.super_blocks = self.bits, self.super_blocks
        codes, scales, mins = self.expert(e)
        linear.register_buffer("codes", codes)
        linear.register_buffer("scales", scales)
        linear.register_buffer("mins", mins)
        linear.register_buffer("bias", None)
        return linear

    def extra_repr(self) -> str:
        kind = self.linear(0).extra_repr().rpartition(", ")[2]
        return (
            f"experts={self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}, {kind}"
        )


class QuantizedExperts(nn.Module):
    """A layer's experts, their projections `StackedPanels`: `gate` (gate and up side by side
    when `up` is None) and `down`; `forward` takes what HF's experts modules take."""

    def __init__(
        self,
        num_experts: int,
        activation: str,
        gate: StackedPanels,
        up: StackedPanels | None,
        down: StackedPanels,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"QuantizedExperts: activation {activation!r} is not one of {list(ACTIVATIONS)}"
            )
        self.num_experts, self.activation = num_experts, activation
        self.gate, self.up, self.down = gate, up, down

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if kernels.loaded_isa() is None:
            kernels.load()
        gate, up, down = self.gate, self.up, self.down
        return torch.ops.ember_cpu.moe_experts(
            hidden_states, top_k_index, top_k_weights,
            gate.codes, gate.scales, gate.mins, gate.out_features, gate.bits,
            None if up is None else up.codes, None if up is None else up.scales,
            None if up is None else up.mins, 0 if up is None else up.out_features,
            0 if up is None else up.bits,
            down.codes, down.scales, down.mins, down.out_features, down.bits,
            self.activation,
        )  # fmt: skip


def hf_experts_activation(module: nn.Module) -> str | None:
    """The activation name of an HF experts module that `QuantizedExperts` computes exactly:
    transformers' `@use_experts_implementation` layout with its defaults (gate and up
    concatenated in `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, no biases, not
    transposed, the default gate: act(gate) * up). None for any other module."""
    from transformers.integrations.moe import _default_apply_gate

    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return None
    if gate_up.dim() != 3 or down.dim() != 3:
        return None
    flags = (
        getattr(module, "has_gate", None), getattr(module, "has_bias", None),
        getattr(module, "is_transposed", None), getattr(module, "is_concatenated", None),
        getattr(module, "has_post_expert_norm", None),
    )  # fmt: skip
    if flags != (True, False, False, True, False):
        return None
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        return None
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    return act if act in ACTIVATIONS else None


def hf_experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, module, activation) of each experts module of `model` that `QuantizedExperts`
    can replace (`hf_experts_activation`)."""
    for name, module in model.named_modules():
        act = hf_experts_activation(module)
        if act is not None:
            yield name, module, act


def quantize_experts_(
    model: nn.Module, bits: int, consumed: Callable[[torch.Tensor], None] | None = None
) -> int:
    """Replace each experts module of `model` that `QuantizedExperts` runs exactly with one
    holding its weights in groups of 32: `bits=8` symmetric (Q8_0's rule), `bits=4` with
    offsets (Q4_1's, as `quantization="int4"` does for linears). In place; returns how many.
    `consumed` gets each replaced weight (`rewrite.Consumed`)."""
    if bits not in (4, 8):
        raise ValueError(f"quantize_experts_: bits must be 4 or 8, got {bits}")
    done = 0
    for name, module, act in list(hf_experts_modules(model)):
        if module.gate_up_proj.shape[-1] % GROUP_SIZE or module.down_proj.shape[-1] % GROUP_SIZE:
            logger.info("%s: expert widths not multiples of %d; kept unquantized", name, GROUP_SIZE)
            continue
        _set(model, name, _quantized(module, act, bits))
        if consumed is not None:
            consumed(module.gate_up_proj)
            consumed(module.down_proj)
        done += 1
    return done


def _quantized(module: nn.Module, act: str, bits: int) -> QuantizedExperts:
    gate_up, down = module.gate_up_proj, module.down_proj
    num_experts = gate_up.shape[0]
    offsets = bits == 4
    stacks = []
    for w in (gate_up, down):
        n, k = w.shape[1], w.shape[2]
        stack = StackedPanels(num_experts, n, k, bits, offsets, False)
        for e in range(num_experts):
            codes, scales, mins = quantize_groups(w[e], bits, symmetric=not offsets)
            stack.fill(e, [(codes, scales, mins)])
        stacks.append(stack)
    return QuantizedExperts(num_experts, act, stacks[0], None, stacks[1])


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
