"""The LoRA-aware wrapper installed around each targeted projection of the HF model.

Every wrapper shares one per-token slot index buffer (the runner copies each step's
`ForwardBatch.lora_slots` into it before the forward)
and owns its module's slot weights `lora_a [max_loras, max_rank, in]` and
`lora_b [max_loras, out, max_rank]`. All are buffers updated in place, so the compiled graphs
are the same with and without adapters loaded and never recompile when adapters change.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.lora import ops  # noqa: F401  (registers torch.ops.ember.lora_*)
from ember.lora.adapter import TARGET_MODULES


class LoRALinear(nn.Module):
    token_slots: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(
        self, base: nn.Linear, max_loras: int, max_rank: int, token_slots: torch.Tensor
    ) -> None:
        super().__init__()
        self.base = base
        dtype = base.weight.dtype
        self.register_buffer("token_slots", token_slots, persistent=False)
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, max_rank, base.in_features, dtype=dtype),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, base.out_features, max_rank, dtype=dtype),
            persistent=False,
        )

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:  # HF code sometimes reads proj.weight (dtype, device)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        flat = x.reshape(-1, x.shape[-1])
        slots = self.token_slots[: flat.shape[0]]
        h = torch.ops.ember.lora_shrink(flat, self.lora_a, slots)
        delta = torch.ops.ember.lora_expand(h, self.lora_b, slots)
        return y + delta.view(y.shape).to(y.dtype)


def install_lora(
    model: nn.Module, max_loras: int, max_rank: int, max_tokens: int
) -> tuple[dict[str, LoRALinear], torch.Tensor]:
    """Wrap every targetable projection; returns (module name -> wrapper, token slot buffer)."""
    token_slots = torch.full((max_tokens,), -1, dtype=torch.long)
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in TARGET_MODULES and isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            wrapper = LoRALinear(module, max_loras, max_rank, token_slots)
            setattr(model.get_submodule(parent_name), child, wrapper)
            wrapped[name] = wrapper
    return wrapped, token_slots
