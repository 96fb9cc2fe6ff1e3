"""ember against llama.cpp on the same GGUF files, in one sitting: W-LAT (TTFT and TPOT, one
request of 128 prompt tokens and 128 output tokens) and W-THRU (32 such requests, output tokens
per second over the whole run).

llama.cpp (its own benchmark tools, 2 threads):
- TTFT: `llama-bench -p 128 -n 0`, 128 / (prompt tokens/s);
- TPOT: `llama-bench -p 0 -n 128 -d 128`, 1 / (generated tokens/s) at a 128-token depth;
- W-THRU: `llama-batched-bench -npp 128 -ntg 128 -npl 32`, 4096 / T (its whole batch's time).
ember: `run_ember` (what `ember bench --workload lat|thru` runs) in a child process per run
(each loads from the compile and weights caches, which the warm-ups of an earlier run fill;
`--warmup` runs one first).

For each file the engines' runs alternate (ember, llama.cpp, llama.cpp, ember, ...:
`ember.tools.bench.alternate`), one repeat each (an ember child, one run of each llama.cpp
tool), and each figure is the median of its engine's runs: this VM's memory bandwidth drifts
within minutes, and blocks of one engine's runs measured the drift too.

`--cpu-isa avx2`: ember with AVX2 forced (`EMBER_CPU_ISA`'s switch
for the whole process) against the llama.cpp build in `--llama-cpp` (build it with
LLAMACPP_AVX2_ONLY=1 for that).

usage: python benchmarks/llamacpp/peers.py --llama-cpp BIN_DIR FILE.gguf [FILE.gguf ...]
           [--cpu-isa native|avx2] [--repeats 3] [--warmup]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess


def ember_run(path: str, isa: str) -> dict:
    """One run of both workloads in a fresh ember child."""
    from ember.tools.bench import run_ember_child

    return run_ember_child(path, 1, ["lat", "thru"], cpu_isa=isa)


def _bench_json(bin_dir: str, path: str, args: list[str]) -> dict:
    cmd = [f"{bin_dir}/llama-bench", "-m", path, "-t", "2", "-r", "1", "-o", "json"]
    out = subprocess.run(cmd + args, capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


def llamacpp_run(bin_dir: str, path: str) -> dict:
    """One run of each llama.cpp tool, in `alternate`'s run shape."""
    from ember.tools.bench import probe_bandwidth_gbs

    pp = _bench_json(bin_dir, path, ["-p", "128", "-n", "0"])
    gbs = probe_bandwidth_gbs()
    tg = _bench_json(bin_dir, path, ["-p", "0", "-n", "128", "-d", "128"])
    cmd = [
        f"{bin_dir}/llama-batched-bench", "-m", path, "-c", "8448", "-b", "2048", "-ub", "512",
        "-npp", "128", "-ntg", "128", "-npl", "32", "-t", "2",
    ]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    row = [line for line in text.splitlines() if re.match(r"\|\s+128 \|\s+128 \|\s+32 \|", line)]
    total = float(row[0].split("|")[-3])  # the "T s" column
    return {
        "lat": {"ttft_ms": 128e3 / pp["avg_ts"], "tpot_ms": 1e3 / tg["avg_ts"], "probe_gbs": gbs},
        "thru": {"out_tok_s": 32 * 128 / total},
    }


def main() -> None:
    from ember.host.isa import cpu_description
    from ember.tools.bench import alternate, tpots

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--llama-cpp", required=True, metavar="BIN_DIR")
    parser.add_argument("--cpu-isa", default="native", choices=("native", "avx2"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warmup", action="store_true", help="an ember run of both workloads first, per file"
    )
    args = parser.parse_args()
    print(f"{cpu_description()}; ember cpu_isa={args.cpu_isa}; llama.cpp {args.llama_cpp}")
    head = (
        "| file | TTFT ms llama.cpp | ember | ratio | TPOT ms llama.cpp | ember | ratio | "
        "W-THRU tok/s llama.cpp | ember | ratio |"
    )
    print(head)
    print("|---" * 10 + "|", flush=True)
    for path in args.files:
        if args.warmup:
            ember_run(path, args.cpu_isa)  # both workloads: their graphs compile here
        e, c = alternate(
            [
                functools.partial(ember_run, path, args.cpu_isa),
                functools.partial(llamacpp_run, args.llama_cpp, path),
            ],
            args.repeats,
        )
        print(
            f"| {os.path.basename(path)} "
            f"| {c['lat']['ttft_ms']:.1f} | {e['lat']['ttft_ms']:.1f} "
            f"| {e['lat']['ttft_ms'] / c['lat']['ttft_ms']:.2f} "
            f"| {c['lat']['tpot_ms']:.2f} | {e['lat']['tpot_ms']:.2f} "
            f"| {e['lat']['tpot_ms'] / c['lat']['tpot_ms']:.2f} "
            f"| {c['thru']['out_tok_s']:.1f} | {e['thru']['out_tok_s']:.1f} "
            f"| {e['thru']['out_tok_s'] / c['thru']['out_tok_s']:.2f} |",
            flush=True,
        )
        print(
            "  TPOT ms by run @ GB/s read just before it (probe_bandwidth_gbs), ember / llama.cpp:"
            f" {tpots(e)} / {tpots(c)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
