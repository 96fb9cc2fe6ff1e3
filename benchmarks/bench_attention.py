"""Op-level paged-attention benchmarks (pytest-benchmark).

Run: python -m pytest benchmarks/bench_attention.py --benchmark-columns=median,iqr
Each case records the KV bytes attention reads and the fraction of this machine's read
bandwidth (measured in the same run) it achieved, in the benchmark's extra_info.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention_cases import CASES, make_case
from ember.attention import BackendUnavailableError, select_backend
from ember.tools.bench import measure_bandwidth_gbs

# Each backend present here. Triton's CPU interpreter is a correctness tool, not a benchmark
# subject: triton runs only on a GPU.
BACKENDS = ["torch", "ipex", "triton"]


@pytest.fixture(scope="module")
def bandwidth_gbs() -> float:
    return measure_bandwidth_gbs()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend_name", BACKENDS)
def bench_paged_attention(benchmark, bandwidth_gbs, backend_name, case):
    if backend_name == "triton" and not torch.cuda.is_available():
        pytest.skip("triton is benchmarked on GPUs only")
    try:
        backend = select_backend(backend_name)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    op = backend.load_op()
    args, kv_bytes = make_case(CASES[case], layout=backend.kv_cache_shape)
    benchmark.pedantic(op, args=args, rounds=7, warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable (CI smoke): ran once, nothing to report
        return
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(
        kv_mb=round(kv_bytes / 1e6, 2),
        kv_gbs=round(kv_bytes / seconds / 1e9, 2),
        bandwidth_gbs=round(bandwidth_gbs, 1),
        bandwidth_fraction=round(kv_bytes / seconds / 1e9 / bandwidth_gbs, 3),
    )
