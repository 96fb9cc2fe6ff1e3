"""The batch-1 decode graph called flat (`ember.compile.flat_call`) against the same graph
through Dynamo's pre-graph bytecode (`call.__wrapped__`): what the flat call saves per step.

    python -m pytest benchmarks/bench_graph_call.py --benchmark-columns=median

Each round alternates the two calls on one captured decode step (same weights, KV cache and
inputs), so a noisy neighbour slows both alike; `extra_info` holds both medians and
`flat_ratio`, the median of (flat / bytecode) per pair. Measured on AMD EPYC (Zen 5), native:
llama-160m Q4_0 0.90 (1.95 -> 1.79 ms), qwen2-0.5b Q4_0 0.95 (8.1 -> 7.7 ms). The default
dtype on the llama-160m shape's bf16 checkpoint; EMBER_BENCH_SHAPES picks others.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

from ember import LLM, SamplingParams
from ember.compile.capture import CompiledForward
from ember.tools import bench as tools

SHAPES = os.environ.get("EMBER_BENCH_SHAPES", "llama-160m").split(",")
CALLS = 200


def _decode_step(llm: LLM) -> tuple:
    """The graph serving a batch-1 decode step, and that step's arguments."""
    runner = llm.llm_engine.runner
    forward = runner.forwards.step
    assert isinstance(forward, CompiledForward)
    seen: list[tuple] = []
    run = runner._run

    def capture(batch, f):
        if batch.input_ids.shape[0] == 1 and not seen:
            seen.append(runner._args(batch))
        return run(batch, f)

    runner._run = capture
    try:
        llm.generate(["a decode step"], SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        del runner._run
    return forward.graphs[forward.key(1)], seen[0]


@pytest.mark.parametrize("shape", SHAPES)
def bench_flat_call(benchmark, shape):
    llm = LLM(model=tools.bench_checkpoint(shape, "bfloat16"), use_tqdm=False)
    graph, args = _decode_step(llm)
    bytecode = getattr(graph, "__wrapped__", None)
    if bytecode is None:
        pytest.skip("this graph's bytecode is not replayed flat")
    flat_s: list[float] = []
    bytecode_s: list[float] = []

    def pairs() -> None:
        for _ in range(CALLS):
            start = time.perf_counter()
            graph(*args)
            mid = time.perf_counter()
            bytecode(*args)
            flat_s.append(mid - start)
            bytecode_s.append(time.perf_counter() - mid)

    benchmark.pedantic(pairs, rounds=3, iterations=1, warmup_rounds=1)
    ratio = statistics.median(f / b for f, b in zip(flat_s, bytecode_s, strict=True))
    flat_ms, bytecode_ms = (statistics.median(s) * 1e3 for s in (flat_s, bytecode_s))
    benchmark.extra_info.update(
        flat_ms=round(flat_ms, 3), bytecode_ms=round(bytecode_ms, 3), flat_ratio=round(ratio, 3)
    )
    print(f"\n{benchmark.name}: flat {flat_ms:.3f} ms, bytecode {bytecode_ms:.3f} ms ({ratio:.3f})")
