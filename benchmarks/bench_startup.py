"""Start-up: a fresh process's `LLM(model=...)` to a ready engine, warm from a compile cache
that the first (cold) start of the session filled, on the llama-160m shape's bf16 checkpoint
at the default dtype (../shared/DESIGN.md; #14's target: <= 3 s warm, <= 45 s cold on 2 cores).

    python -m pytest benchmarks/bench_startup.py --benchmark-columns=median,min,max
    EMBER_BENCH_LAYERS=4,16,32 python -m pytest benchmarks/bench_startup.py -k depth -s
    EMBER_BENCH_REGIONAL=off ...   # whole-model graphs at every depth (on: regions at every
                                   # depth; default: ember's own choice, `regional_compile`)

The timed unit is one whole child process (interpreter, `import torch`, `import ember`, the
engine); `extra_info` holds the medians of what the child measured itself: `ready_s` (the
engine alone, the number the target is about), `import_s`, and `cold_s` of the first start.
`isa_probes` counts inductor's vector-ISA probes (a child Python loading a test library each)
in the warm children: 0 where the cache entry recorded them (`ember.compile.inductor.
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


def _child(code: str, *args: str, timeout: float = 900) -> dict:
    """Run `code` in a fresh Python with `args`; the JSON object it prints last."""
    child = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout,
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


def _start(checkpoint: str, cache_dir: str) -> dict:
    return _child(_CHILD, checkpoint, cache_dir)


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


# ---- start-up against depth (#52): random-weight Llamas of 4, 16 and 32 layers, width 512 ----
LAYERS = [int(n) for n in os.environ.get("EMBER_BENCH_LAYERS", "4,16,32").split(",")]

_DEPTH_CHILD = """
import json, sys, time
start = time.perf_counter()
from ember import LLM, SamplingParams
imported = time.perf_counter()
background = sys.argv[3] == "background"
regional = {"auto": None, "on": True, "off": False}[sys.argv[4]]
llm = LLM(model=sys.argv[1], compile_cache_dir=sys.argv[2], use_tqdm=False, dtype="float32",
          kv_cache_gib=0.1, max_model_len=512, background_compile=background,
          regional_compile=regional)
ready = time.perf_counter()
llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=1), use_tqdm=False)
first = time.perf_counter()
llm.llm_engine.runner.wait_for_graphs()
print(json.dumps({"import_s": imported - start, "ready_s": ready - imported,
                  "regions": llm.llm_engine.runner.regions,
                  "first_token_s": first - imported,
                  "all_graphs_s": time.perf_counter() - imported}))
"""


REGIONAL = os.environ.get("EMBER_BENCH_REGIONAL", "auto")


def _depth_start(checkpoint: str, cache_dir: str, mode: str) -> dict:
    return _child(_DEPTH_CHILD, checkpoint, cache_dir, mode, REGIONAL, timeout=1800)


@pytest.mark.parametrize("layers", LAYERS)
def bench_start_by_depth(benchmark, layers, tmp_path):
    """Fresh processes, fresh compile caches: a cold start (every graph compiled before
    `LLM()` returns), a warm one from that cache, and a cold one with `background_compile`
    (the first token on the eager path while the graphs compile). The timed unit is the warm
    start's child; the targets (#52) are about `extra_info`: cold compile of 32 layers within
    1.3x of 4 layers', the first token within 5 s of the weights being loaded."""
    from ember.tools.checkpoints import build_checkpoint

    checkpoint = build_checkpoint(
        str(tmp_path / "model"), "small-llama", num_hidden_layers=layers, hidden_size=512,
        intermediate_size=1376,
    )  # fmt: skip
    cache_dir = str(tmp_path / "compile")
    cold = _depth_start(checkpoint, cache_dir, "foreground")
    warm: list[dict] = []
    benchmark.pedantic(
        lambda: warm.append(_depth_start(checkpoint, cache_dir, "foreground")),
        rounds=1,
        iterations=1,
    )
    background = _depth_start(checkpoint, str(tmp_path / "compile-bg"), "background")
    benchmark.extra_info.update(
        cold_s=round(cold["ready_s"], 2),
        warm_s=round(warm[0]["ready_s"], 2),
        import_s=round(warm[0]["import_s"], 2),
        background_first_token_s=round(background["first_token_s"], 2),
        background_all_graphs_s=round(background["all_graphs_s"], 2),
        regions=cold["regions"],
    )
    kind = "regions" if cold["regions"] else "whole graphs"
    print(f"\n{layers} layers ({kind}): cold {cold['ready_s']:.1f} s, "
          f"warm {warm[0]['ready_s']:.2f} s, "
          f"background first token {background['first_token_s']:.2f} s (all graphs "
          f"{background['all_graphs_s']:.1f} s)")  # fmt: skip
