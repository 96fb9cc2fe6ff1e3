"""`ember` command line: thin argument parsing over the engine."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from ember.attention import BACKEND_NAMES
from ember.runtime.buckets import DEFAULT_TOKEN_BUCKETS
from ember.runtime.config import user_cache_dir
from ember.runtime.llm import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_CACHE_GIB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="local HF checkpoint dir (default: a small random Llama "
        "built once under the user cache dir)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "int8"],
        help="int8: weight-only int8 (per-channel scales), float32 activations and math",
    )
    p.add_argument("--kv-cache-gib", type=float, default=DEFAULT_KV_CACHE_GIB)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile every shape bucket with torch.compile before serving",
    )
    p.add_argument(
        "--token-buckets",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=DEFAULT_TOKEN_BUCKETS,
        help="comma-separated token counts with their own static graph (default 1)",
    )
    p.add_argument(
        "--freeze-weights",
        action="store_true",
        help="let inductor fold and prepack weights (not cacheable)",
    )
    p.add_argument(
        "--attention-backend",
        choices=list(BACKEND_NAMES),
        default="auto",
        help="paged-attention backend (auto: the fastest usable here)",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        compile=args.compile,
        token_buckets=args.token_buckets,
        freeze_weights=args.freeze_weights,
        attention_backend=args.attention_backend,
    )


def _resolve_model(model: str | None) -> str:
    if model:
        return model
    from ember.checkpoints import build_checkpoint, default_model_dir

    path = default_model_dir()
    print(f"no --model given: using the small random-init Llama at {path}", file=sys.stderr)
    return build_checkpoint(path, "small-llama", seed=0)


def cmd_generate(args: argparse.Namespace) -> int:
    from ember import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=_resolve_model(args.model),
        compile_cache_dir=args.compile_cache_dir,
        **_engine_kwargs(args),
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["Once upon a time", "The quick brown fox"]
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        c = o.outputs[0]
        print(
            f"--- prompt: {o.prompt!r}\n{c.text!r}\n"
            f"    tokens={c.token_ids} finish={c.finish_reason}"
        )
    print(
        f"generated {num_out} tokens for {len(outs)} prompts in {gen_s:.3f} s: "
        f"{num_out / max(gen_s, 1e-9):.1f} tok/s (load {load_s:.2f} s, dtype {llm.config.dtype})"
    )
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    import torch

    from ember import LLM

    if not args.model or not args.text:
        print("ember embed: give --model DIR and at least one TEXT", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(model=args.model, use_tqdm=False, **_engine_kwargs(args))
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    outs = llm.embed(args.text, use_tqdm=False)
    embed_s = time.perf_counter() - t1
    vectors = torch.tensor([o.outputs.embedding for o in outs])
    norms = vectors.norm(dim=-1)
    for i, (text, norm) in enumerate(zip(args.text, norms.tolist(), strict=True)):
        print(f"[{i}] dim={vectors.shape[1]} norm={norm:.4f}  {text!r}")
    unit = torch.nn.functional.normalize(vectors, dim=-1)
    cos = unit @ unit.T
    print("pairwise cosine similarity:")
    print("      " + " ".join(f"[{j}]".rjust(7) for j in range(len(outs))))
    for i in range(len(outs)):
        print(f"[{i}]".ljust(6) + " ".join(f"{c:7.4f}" for c in cos[i].tolist()))
    print(
        f"embedded {len(outs)} texts in {embed_s:.3f} s "
        f"({len(outs) / max(embed_s, 1e-9):.1f} texts/s; load {load_s:.2f} s)"
    )
    return 0


def default_compile_cache_dir() -> str:
    return user_cache_dir("compile")


def cmd_warmup(args: argparse.Namespace) -> int:
    from ember import LLM

    cache_dir = args.cache_dir or default_compile_cache_dir()
    kwargs = _engine_kwargs(args)
    kwargs.update(compile=True, compile_cache_dir=cache_dir)
    t0 = time.perf_counter()
    llm = LLM(model=_resolve_model(args.model), **kwargs)
    seconds = time.perf_counter() - t0
    engine = llm.llm_engine
    state = "loaded from cache" if engine.compile_cache_hit else "compiled and saved"
    sizes = engine.runner.graph_sizes
    print(
        f"{len(sizes)} graphs (static token buckets {list(engine.runner.buckets)}"
        f"{' + one dynamic' if len(sizes) > len(engine.runner.buckets) else ''}) {state} in "
        f"{seconds:.1f} s; cache dir {cache_dir}"
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ember import LLM, bench

    model_dir = args.model or bench.bench_checkpoint(args.shape, args.dtype)
    workload = bench.WORKLOADS[args.workload]
    kwargs = _engine_kwargs(args)
    kwargs["compile_cache_dir"] = None if args.no_cache else default_compile_cache_dir()
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, use_tqdm=False, **kwargs)
    startup = time.perf_counter() - t0
    results = [bench.run_ember(llm, workload, args.repeats)]
    results[0].startup_s = startup
    engine = llm.llm_engine
    model = engine.runner.model
    dtype = llm.config.dtype
    bytes_per_token = bench.decode_bytes_per_token(model)
    flops = bench.workload_flops(model, workload)
    warm = engine.compile_cache_hit
    llm.close()
    if args.compare == "hf":
        results.append(bench.run_hf(model_dir, dtype, workload, args.repeats))
        if workload.num_requests == 1:
            results.append(bench.run_hf(model_dir, dtype, workload, args.repeats, True))
    report = bench.Report(
        workload=workload,
        results=results,
        bandwidth_gbs=bench.measure_bandwidth_gbs(),
        bytes_per_token=bytes_per_token,
        gemm_gflops=bench.measure_gemm_gflops(dtype),
        gemm_dtype=str(dtype).removeprefix("torch."),
        flops=flops,
        warm_start=warm,
    )
    print(bench.format_table(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="CPU-first LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--compile-cache-dir",
        default=None,
        help="load compiled graphs saved by `ember warmup` from this dir",
    )
    gen.set_defaults(func=cmd_generate)
    emb = sub.add_parser("embed", help="embed texts; print norms and pairwise cosine similarity")
    _add_engine_args(emb)
    emb.add_argument("text", nargs="*", help="texts to embed")
    emb.set_defaults(func=cmd_embed)
    warm = sub.add_parser(
        "warmup",
        help="compile every shape bucket ahead of time and save "
        "the compile artefacts, so a later engine starts warm",
    )
    _add_engine_args(warm)
    warm.add_argument(
        "--cache-dir",
        default=None,
        help=f"compile cache dir (default {default_compile_cache_dir()})",
    )
    warm.set_defaults(func=cmd_warmup)
    bench_p = sub.add_parser("bench", help="run a standard workload (W-THRU, W-LAT)")
    _add_engine_args(bench_p)
    bench_p.add_argument("--workload", choices=["thru", "lat"], default="lat")
    bench_p.add_argument(
        "--shape",
        default="llama-160m",
        help="checkpoint shape to build when no --model is given "
        "(llama-160m, qwen2-0.5b, or a tiny test shape)",
    )
    bench_p.add_argument(
        "--compare",
        choices=["hf"],
        default=None,
        help="also run HF transformers in this process: eager generate, and for W-LAT "
        "static-cache torch.compile too",
    )
    bench_p.add_argument("--repeats", type=int, default=3)
    bench_p.add_argument(
        "--no-cache",
        action="store_true",
        help="do not use the default compile cache dir (measures cold start)",
    )
    bench_p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
