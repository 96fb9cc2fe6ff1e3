"""Op-level paged-attention benchmarks (pytest-benchmark).

Run: python -m pytest benchmarks/bench_attention.py --benchmark-columns=median,iqr
Each case records the KV bytes attention reads and the fraction of this machine's read
bandwidth (measured in the same run) it achieved, in the benchmark's extra_info.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention_cases import CASES, make_case
from ember.attention import ops  # noqa: F401
from ember.bench import measure_bandwidth_gbs


@pytest.fixture(scope="module")
def bandwidth_gbs() -> float:
    return measure_bandwidth_gbs()


@pytest.mark.parametrize("case", list(CASES))
def bench_paged_attention_torch(benchmark, bandwidth_gbs, case):
    args, kv_bytes = make_case(CASES[case])
    op = torch.ops.ember.paged_attention
    benchmark.pedantic(op, args=args, rounds=7, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(
        kv_mb=round(kv_bytes / 1e6, 2),
        kv_gbs=round(kv_bytes / seconds / 1e9, 2),
        bandwidth_gbs=round(bandwidth_gbs, 1),
        bandwidth_fraction=round(kv_bytes / seconds / 1e9 / bandwidth_gbs, 3),
    )
