"""Load time and memory of a GGUF file: ember against llama.cpp on the same file.

ember: a fresh process per measurement; after the imports, `LLM(model=FILE)` to a ready engine
with `compile=False` (the load itself) and with `compile=True` from the warm compile cache that
`ember serve/bench/warmup` use (what a served engine pays), and the process's RSS growth at its
peak and after (VmHWM restarted after the imports). "ember s" maps back the weights an earlier
load of the file packed (`ember.model.packed_cache`, written by the warm-up loads here);
"first s" packs them from the file, as a first load does (the cache off, so it writes none).
llama.cpp: `llama-batched-bench` generating one token, its wall time less the time it reports
for the batch (model load, context set-up and tear-down). Medians of --repeats.

usage: python benchmarks/llamacpp/load.py LLAMA_CPP_BIN_DIR FILE.gguf [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

_CHILD = """
import json, sys, time
import torch
from ember import LLM

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM restarts from here
start = time.perf_counter()
compile = sys.argv[2] == "1"  # from the compile cache the CLI and the server use
cache = "auto" if compile else None
llm = LLM(
    model=sys.argv[1],
    compile=compile,
    compile_cache_dir=cache,
    kv_cache_gib=0.25,
    max_model_len=2048,
    use_tqdm=False,
)
ready = time.perf_counter() - start
print(json.dumps({"s": ready, "grown": status("VmRSS") - before, "peak": status("VmHWM") - before}))
"""


def ember_load(path: str, compile: bool, cached: bool = True) -> dict:
    env = dict(os.environ)
    if not cached:
        env["EMBER_WEIGHTS_CACHE_GB"] = "0"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, path, "1" if compile else "0"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


def llamacpp_load(bin_dir: str, path: str) -> float:
    cmd = [f"{bin_dir}/llama-batched-bench", "-m", path, "-c", "256", "-npp", "1", "-ntg", "1"]
    start = time.perf_counter()
    out = subprocess.run(
        cmd + ["-npl", "1", "-t", "2"], capture_output=True, text=True, check=True
    ).stdout
    wall = time.perf_counter() - start
    row = [line for line in out.splitlines() if re.match(r"\|\s+1 \|", line)][0]
    batch_s = float(row.split("|")[-3])  # the "T s" column
    return wall - batch_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bin_dir")
    parser.add_argument("files", nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'file':28} {'MB':>6} {'llama.cpp s':>11} {'ember s':>8} {'ratio':>6} "
        f"{'+compile s':>10} {'peak MB':>8} {'after MB':>8} {'first s':>8} {'ratio':>6} "
        f"{'peak MB':>8}"
    )
    for path in args.files:
        ember_load(path, False)  # config/tokenizer/weights caches and page cache warm
        ember_load(path, True)  # compile cache warm
        lc = statistics.median(llamacpp_load(args.bin_dir, path) for _ in range(args.repeats))
        loads = [ember_load(path, False) for _ in range(args.repeats)]
        compiled = statistics.median(ember_load(path, True)["s"] for _ in range(args.repeats))
        firsts = [ember_load(path, False, cached=False) for _ in range(args.repeats)]
        s = statistics.median(load["s"] for load in loads)
        first = statistics.median(load["s"] for load in firsts)
        peak = max(load["peak"] for load in loads)
        grown = max(load["grown"] for load in loads)
        first_peak = max(load["peak"] for load in firsts)
        mb = os.path.getsize(path) / 1e6
        print(
            f"{os.path.basename(path):28} {mb:6.0f} {lc:11.2f} {s:8.2f} {s / lc:6.2f} "
            f"{compiled:10.2f} {peak * 1.048576:8.0f} {grown * 1.048576:8.0f} {first:8.2f} "
            f"{first / lc:6.2f} {first_peak * 1.048576:8.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
