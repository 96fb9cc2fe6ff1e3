"""W-SPEC as a pytest-benchmark suite: speculative (ngram) against plain decoding on the default
model (SmolLM2-135M-Instruct Q4_1, real weights), batch 1 and 8, per task; see
`ember.tools.bench_spec` for the tasks and how TPOT is taken.
    python -m pytest benchmarks/bench_spec.py --benchmark-columns=median,min,max -s
"""

from __future__ import annotations

import pytest

from ember import LLM
from ember.tools.bench_spec import TASKS, format_spec, run_spec
from ember.tools.checkpoints import default_model

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip


@pytest.fixture(scope="module")
def engines():
    path = default_model()
    if path is None:
        pytest.skip("the default model cannot be had (offline, nothing cached)")
    base = LLM(model=path, max_model_len=1024, use_tqdm=False)
    spec = LLM(model=path, max_model_len=1024, use_tqdm=False, speculative_config=SPEC)
    yield base, spec
    base.close()
    spec.close()


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("task", list(TASKS))
def bench_spec(benchmark, engines, task, batch):
    base, spec = engines
    rows = []
    benchmark.pedantic(
        lambda: rows.extend(run_spec(base, spec, (task,), (batch,), repeats=1)),
        rounds=3,
        iterations=1,
    )
    speedups = sorted(r.speedup for r in rows)
    benchmark.extra_info.update(
        speedup=round(speedups[len(speedups) // 2], 2),
        acceptance=round(sum(r.accepted for r in rows) / max(sum(r.proposed for r in rows), 1), 2),
    )
    print("\n" + format_spec(rows, f"{task}, batch {batch}"))
