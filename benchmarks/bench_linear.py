"""Linear layers at decode and prefill shapes (llama-160m projections), fp32 vs bf16 through ATen.

Run: python -m pytest benchmarks/bench_linear.py --benchmark-columns=median
Each case records GFLOP/s and, for decode shapes, the weight-read bandwidth as a fraction of
the memory bandwidth measured in the same run: the evidence behind "store narrow, compute in
fp32" (bf16 GEMM through ATen on an AVX2 CPU has no native bf16 math).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.tools.bench import measure_bandwidth_gbs

# (name, in_features, out_features) of llama-160m's projections and LM head
SHAPES = [("qkvo", 768, 768), ("up", 768, 3072), ("down", 3072, 768), ("lm_head", 768, 32000)]
TOKENS = [1, 32, 512]


@pytest.fixture(scope="module")
def bandwidth_gbs() -> float:
    return measure_bandwidth_gbs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def bench_linear(benchmark, bandwidth_gbs, shape, tokens, dtype):
    _, fan_in, fan_out = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, fan_in, generator=g).to(dtype)
    w = torch.randn(fan_out, fan_in, generator=g).to(dtype)
    with torch.inference_mode():
        benchmark.pedantic(F.linear, args=(x, w), rounds=7, warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable
        return
    seconds = benchmark.stats.stats.median
    weight_bytes = w.numel() * w.element_size()
    benchmark.extra_info.update(
        gflops=round(2 * tokens * fan_in * fan_out / seconds / 1e9, 1),
        weight_gbs=round(weight_bytes / seconds / 1e9, 2),
        bandwidth_fraction=round(weight_bytes / seconds / 1e9 / bandwidth_gbs, 3),
    )
