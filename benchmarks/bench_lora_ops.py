"""LoRA op suite: ember::lora_shrink + lora_expand on one llama-160m projection (768 -> 768,
rank 16), at decode and prefill token counts, with tokens on 0, 1 or 4 adapters.

Run: python -m pytest benchmarks/bench_lora_ops.py --benchmark-columns=median
Compare with bench_linear.py's qkvo rows: the LoRA delta should cost a small fraction of the
base projection.
"""

from __future__ import annotations

import pytest
import torch

from ember.lora import ops  # noqa: F401

MAX_LORAS, RANK, FAN_IN, FAN_OUT = 4, 16, 768, 768


@pytest.mark.parametrize("adapters", [0, 1, 4])
@pytest.mark.parametrize("tokens", [1, 32, 512])
def bench_lora_shrink_expand(benchmark, tokens, adapters):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, FAN_IN, generator=g)
    a = torch.randn(MAX_LORAS, RANK, FAN_IN, generator=g)
    b = torch.randn(MAX_LORAS, FAN_OUT, RANK, generator=g)
    slots = torch.arange(tokens) % adapters if adapters else torch.full((tokens,), -1)

    def run() -> torch.Tensor:
        h = torch.ops.ember.lora_shrink(x, a, slots)
        return torch.ops.ember.lora_expand(h, b, slots)

    benchmark.pedantic(run, rounds=7, warmup_rounds=1)
