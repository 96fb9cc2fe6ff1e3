"""Batch-1 decode linears against the machine's streaming read: how close ember's kernels come
to reading their weights at memory speed.

Run: python -m pytest benchmarks/bench_decode_stream.py --benchmark-columns=median
One pass runs qwen2-0.5b's 96 layer projections (q/k/v fused, o, gate/up fused, down; 280-720
MB of weights, far past any cache) at M = 1, through `ember_cpu::group_linear` (GGUF Q8_0 and
Q4_0 codes) and `ember_cpu::packed_linear` (bf16 weights: fp32 activations, and bf16 pairs where
the CPU has AVX512-BF16). Each pass alternates with a `torch.sum` over as many bytes, so a noisy
neighbour slows both alike; `stream_ratio` is the median of (sum time / pass time), about 1.0 at
the machine's streaming rate. `BENCH_CPU_ISA=avx2` (with `ATEN_CPU_CAPABILITY=avx2`) runs the
AVX2 kernels on an AVX-512 machine. The software prefetch of the group and pair kernels was
decided on these ratios (AMD EPYC Zen 4, AVX-512: q8_0 0.70 with it, 0.84-1.01 without).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import pytest
import torch

from ember import kernels
from ember.host.memory import collapse_to_huge_pages, move_to_huge_pages
from ember.model.layers.group import GroupLinear

HIDDEN, FFN, LAYERS, QKV = 896, 4864, 24, 1152  # qwen2-0.5b
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)] * LAYERS


def _in_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Where the engine keeps weights (`ember.model.loader`): in huge pages, so a stream
    is not cut into 4 KiB pages (a TLB miss each, and hardware prefetchers stop at them)."""
    move_to_huge_pages(tensors)
    collapse_to_huge_pages(wait=True)


def _group_pass(bits: int) -> tuple[Callable[[], None], int]:
    g = torch.Generator().manual_seed(0)
    linears = []
    for n, k in SHAPES:
        if bits == 8:
            codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        else:
            codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scales = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        linears.append(GroupLinear(codes, scales, None, bits))
    _in_huge_pages([t for m in linears for t in (m.codes, m.scales)])
    xs = {k: torch.randn(1, k, generator=g) for k in (HIDDEN, FFN)}
    op = torch.ops.ember_cpu.group_linear.default

    def run() -> None:
        for m in linears:
            op(xs[m.in_features], m.codes, m.scales, None, None, m.out_features, bits)

    return run, sum(m.codes.numel() + 2 * m.scales.numel() for m in linears)


def _packed_pass(pairs: bool) -> tuple[Callable[[], None], int]:
    g = torch.Generator().manual_seed(0)
    pack = torch.ops.ember_cpu.pack_bf16_pairs if pairs else torch.ops.ember_cpu.pack_linear_weight
    weights = [(pack((torch.randn(n, k, generator=g) * 0.02).bfloat16()), n, k) for n, k in SHAPES]
    _in_huge_pages([w for w, _, _ in weights])
    dtype = torch.bfloat16 if pairs else torch.float32
    xs = {k: torch.randn(1, k, generator=g).to(dtype) for k in (HIDDEN, FFN)}
    op = torch.ops.ember_cpu.packed_linear.default

    def run() -> None:
        for w, n, k in weights:
            op(xs[k], w, None, None, n)

    return run, sum(w.numel() * w.element_size() for w, _, _ in weights)


def _stream_ratio(run: Callable[[], None], nbytes: int, rounds: int = 15) -> float:
    """Median of (time of a streaming sum over `nbytes` / time of a pass), alternated."""
    big = torch.ones(nbytes // 4)
    run()  # warm: both touched once before timing
    big.sum()
    ratios = []
    for _ in range(rounds):
        t = time.perf_counter()
        run()
        passed = time.perf_counter() - t
        t = time.perf_counter()
        big.sum()
        ratios.append((time.perf_counter() - t) / passed)
    return statistics.median(ratios)


CASES = ["q8_0", "q4_0", "bf16-fp32-math", "bf16-pairs"]


@pytest.mark.parametrize("case", CASES)
def bench_decode_stream(benchmark, case):
    kernels.load(os.environ.get("BENCH_CPU_ISA", "native"))
    if case == "bf16-pairs" and not kernels.bf16_pairs():
        pytest.skip("the CPU has no AVX512-BF16")
    if case.startswith("q"):
        run, nbytes = _group_pass(8 if case == "q8_0" else 4)
    else:
        run, nbytes = _packed_pass(case == "bf16-pairs")
    with torch.inference_mode():
        benchmark.pedantic(run, rounds=7, warmup_rounds=1)
        ratio = _stream_ratio(run, nbytes)
    if benchmark.stats is None:  # --benchmark-disable
        return
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(
        weight_mb=round(nbytes / 1e6),
        weight_gbs=round(nbytes / seconds / 1e9, 1),
        stream_ratio=round(ratio, 3),
        cpu_isa=kernels.loaded_isa(),
    )
