"""KV-cache dtypes side by side: decode time per token deep in a long context, prefill time, and
how many tokens `kv_cache_gib` holds.

One engine per cache dtype, built in one process and run alternately (round r runs every
dtype before round r + 1), so machine drift lands on all of them. Each run: `--requests`
prompts of `--depth` random tokens, then `--decode` greedy tokens each (EOS ignored); TTFT is
the steps up to every request's first token, TPOT the median step after it (`run_ember`).

--shape: a random bf16 checkpoint of that shape with 8,192 positions (built once under the user
cache dir; `benchmarks/llamacpp/convert.py` makes GGUF files of it).

usage: python benchmarks/bench_kv_cache.py [--shape llama-160m | --model PATH]
           [--kv auto,int8] [--depth 4000] [--decode 64] [--requests 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    from ember import LLM
    from ember.host.dirs import user_cache_dir
    from ember.host.isa import cpu_description
    from ember.tools.bench import Workload, run_ember
    from ember.tools.checkpoints import build_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-160m")
    parser.add_argument("--model", help="a checkpoint dir or GGUF file instead of --shape")
    parser.add_argument("--dtype", default="auto", help="engine dtype (weights)")
    parser.add_argument("--kv", default="auto,int8", help="comma-separated kv_cache_dtype values")
    parser.add_argument("--depth", type=int, default=4000)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--cpu-isa", default="native")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()

    # the shape's random bf16 checkpoint, with room for 8,192 positions
    model = args.model or build_checkpoint(
        user_cache_dir("models", f"{args.shape}-bfloat16-8k"), args.shape,
        dtype=torch.bfloat16, initializer_range=0.02, max_position_embeddings=8192,
    )  # fmt: skip
    workload = Workload("W-DEEP", args.requests, args.depth, args.decode)
    engines = {}
    for kv in args.kv.split(","):
        engines[kv] = LLM(
            model=model,
            dtype=args.dtype,
            kv_cache_dtype=kv,
            kv_cache_gib=args.kv_cache_gib,
            max_model_len=args.depth + args.decode + 16,
            cpu_isa=args.cpu_isa,
            compile=not args.no_compile,
        )
    runs: dict[str, list[dict[str, float]]] = {kv: [] for kv in engines}
    for _ in range(args.rounds):
        for kv, llm in engines.items():
            runs[kv] += run_ember(llm, workload, 1).runs
    print(f"{cpu_description()}, {torch.get_num_threads()} threads; {model}")
    print(
        f"{args.requests} x {args.depth}-token prompts, {args.decode} tokens each, "
        f"{args.rounds} rounds alternated; medians (all runs)"
    )
    print("| kv_cache_dtype | cache | TPOT ms | TTFT ms | tokens in 1 GiB | runs' TPOT ms |")
    print("|---|---|---|---|---|---|")
    for kv, llm in engines.items():
        cfg, pool = llm.config, llm.llm_engine.block_manager
        per_gib = (pool.num_blocks - 1) * cfg.block_size / args.kv_cache_gib
        tpot = [r["tpot_ms"] for r in runs[kv]]
        print(
            f"| {kv} | {str(cfg.kv_dtype).removeprefix('torch.')} | "
            f"{statistics.median(tpot):.2f} | "
            f"{statistics.median(r['ttft_ms'] for r in runs[kv]):.1f} | {per_gib:,.0f} | "
            f"{', '.join(f'{t:.2f}' for t in tpot)} |"
        )
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
