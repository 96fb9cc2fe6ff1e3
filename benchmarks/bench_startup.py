"""Start-up: a fresh process's `LLM(model=...)` to a ready engine, warm from a compile cache
that the first (cold) start of the session filled, on the llama-160m shape's bf16 checkpoint
at the default dtype (../shared/DESIGN.md; #14's target: <= 3 s warm, <= 45 s cold on 2 cores).

    python -m pytest benchmarks/bench_startup.py --benchmark-columns=median,min,max

The timed unit is one whole child process (interpreter, `import torch`, `import ember`, the
engine); `extra_info` holds the medians of what the child measured itself: `ready_s` (the
engine alone, the number the target is about), `import_s`, and `cold_s` of the first start.
`isa_probes` counts inductor's vector-ISA probes (a child Python loading a test library each)
in the warm children: 0 where the cache entry recorded them (`ember.compiler.inductor.
vec_isa_probes`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from ember.tools import bench as tools

SHAPES = os.environ.get("EMBER_BENCH_SHAPES", "llama-160m").split(",")
ROUNDS = 3

_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
from ember import LLM
from ember.tools.bench import count_vec_isa_probes
imported = time.perf_counter()
probes = count_vec_isa_probes()
llm = LLM(model=sys.argv[1], compile_cache_dir=sys.argv[2], use_tqdm=False)
print(json.dumps({"import_s": imported - start, "ready_s": time.perf_counter() - imported,
                  "hit": llm.llm_engine.compile_cache_hit, "isa_probes": len(probes)}))
"""


def _start(checkpoint: str, cache_dir: str) -> dict:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, checkpoint, cache_dir],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", SHAPES)
def bench_warm_start(benchmark, shape, tmp_path):
    checkpoint = tools.bench_checkpoint(shape, "bfloat16")
    cache_dir = str(tmp_path / "compile")
    os.makedirs(cache_dir, mode=0o700)
    cold = _start(checkpoint, cache_dir)
    assert not cold["hit"]
    warm: list[dict] = []
    benchmark.pedantic(
        lambda: warm.append(_start(checkpoint, cache_dir)), rounds=ROUNDS, iterations=1
    )
    assert all(w["hit"] for w in warm)
    ready = statistics.median(w["ready_s"] for w in warm)
    benchmark.extra_info.update(
        ready_s=round(ready, 2),
        import_s=round(statistics.median(w["import_s"] for w in warm), 2),
        cold_s=round(cold["ready_s"], 1),
        isa_probes=max(w["isa_probes"] for w in warm),
    )
    print(f"\n{benchmark.name}: warm {ready:.2f} s to a ready engine, cold {cold['ready_s']:.1f} s")
