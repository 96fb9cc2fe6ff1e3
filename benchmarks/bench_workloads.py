"""End-to-end standard workloads (../shared/DESIGN.md): W-THRU and W-LAT on the llama-160m and
qwen2-0.5b shapes, fp32, bf16 and weight-only int8, ember (compiled, warm from the default
compile cache after the first run) and HF transformers eager `generate` on the same prompts.

Run everything (about an hour on 2 cores; the checkpoints are built once under
~/.cache/ember/models):
    python -m pytest benchmarks/bench_workloads.py --benchmark-columns=median,min,max
One shape or case:  ... -k "llama-160m and lat and ember"
Other shapes:       EMBER_BENCH_SHAPES=tiny-llama python -m pytest benchmarks/bench_workloads.py

The benchmark's timed unit is one whole workload run (rounds=3); TTFT, TPOT and output tokens/s
medians go to `extra_info`, so `--benchmark-save`/`--benchmark-compare` keep them.
"""

from __future__ import annotations

import os

import pytest
import torch

from ember import LLM
from ember.tools import bench as tools
from ember.tools.bench import WORKLOADS, Result, run_ember, run_hf, summarize

SHAPES = os.environ.get("EMBER_BENCH_SHAPES", "llama-160m,qwen2-0.5b").split(",")
DTYPES = ["float32", "bfloat16", "int8"]
ROUNDS = 3


def _record(benchmark, result: Result) -> None:
    benchmark.extra_info.update(
        out_tok_s=round(result.out_tok_s, 1),
        ttft_ms=round(result.ttft_ms, 1),
        tpot_ms=round(result.tpot_ms, 2),
    )
    print(
        f"\n{benchmark.name}: {result.out_tok_s:.1f} out tok/s, TTFT {result.ttft_ms:.1f} ms, "
        f"TPOT {result.tpot_ms:.2f} ms"
    )


@pytest.mark.parametrize("workload", ["thru", "lat"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def bench_ember(benchmark, shape, dtype, workload):
    wl = WORKLOADS[workload]
    llm = LLM(model=tools.bench_checkpoint(shape, dtype), dtype=dtype, use_tqdm=False)
    runs: list[Result] = []
    benchmark.pedantic(
        lambda: runs.append(run_ember(llm, wl, repeats=1)), rounds=ROUNDS, iterations=1
    )
    llm.close()
    _record(benchmark, summarize("ember", [r for res in runs for r in res.runs]))


@pytest.mark.parametrize("workload", ["thru", "lat"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def bench_hf_eager(benchmark, shape, dtype, workload):
    wl = WORKLOADS[workload]
    path = tools.bench_checkpoint(shape, dtype)
    weights = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    runs: list[Result] = []
    benchmark.pedantic(
        lambda: runs.append(run_hf(path, weights, wl, repeats=1)), rounds=ROUNDS, iterations=1
    )
    _record(benchmark, summarize("hf-eager", [r for res in runs for r in res.runs]))
