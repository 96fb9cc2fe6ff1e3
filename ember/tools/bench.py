"""Standard workloads (../shared/DESIGN.md) for `ember bench` and the benchmark suites.

W-THRU: 32 requests x 128 random prompt tokens (seed 0), 128 output tokens each, greedy, EOS
ignored; output tokens/s excluding load and warm-up. W-LAT: 1 request, 128 prompt tokens, 128
output tokens; TTFT and TPOT. Every figure is the median of `repeats` runs in this process, and
`--compare hf` runs the same workload with HF transformers (eager `generate`, plus static-cache
`torch.compile` for W-LAT) in the same process, so ratios come from one run on this noisy
machine. The rooflines are measured in the same run: memory bandwidth (batch-1 decode floor =
weight bytes per token / bandwidth) and the best GEMM rate (ATen's, or ember's packed kernel:
fp32 panels, or bf16 pairs on AVX512-BF16; compute floor = workload FLOPs / GEMM rate).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ember import kernels
from ember.host.dirs import user_cache_dir
from ember.model.spec import is_gguf
from ember.runtime.request import SamplingParams
from ember.tools.checkpoints import build_checkpoint


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    output_len: int


WORKLOADS = {
    "thru": Workload("W-THRU", 32, 128, 128),
    "lat": Workload("W-LAT", 1, 128, 128),
}


@dataclass
class Result:
    """Medians over repeats. Times in ms, throughput in output tokens/s."""

    engine: str
    out_tok_s: float
    ttft_ms: float
    tpot_ms: float
    runs: list[dict[str, float]] = field(default_factory=list)
    startup_s: float | None = None


def bench_checkpoint(
    shape: str, dtype: str = "float32", checkpoint_dtype: str | None = None, **overrides: Any
) -> str:
    """The random-init checkpoint of `shape` the benchmarks run with engine dtype `dtype`,
    stored in `checkpoint_dtype` (default: fp32 for "float32" and "int8" engines, which
    quantise the fp32 one; else bf16, as most checkpoints are), with config `overrides`
    (`max_position_embeddings=8192`); built once under the user cache dir."""
    name = checkpoint_dtype or ("float32" if dtype in ("float32", "int8") else "bfloat16")
    suffix = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    return build_checkpoint(
        user_cache_dir("models", f"{shape}-{name}{suffix}"),
        shape,
        dtype=getattr(torch, name),
        initializer_range=0.02,
        **overrides,
    )


def prompts_for(workload: Workload, vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, vocab_size, (workload.prompt_len,), generator=g).tolist()
        for _ in range(workload.num_requests)
    ]


def summarize(engine: str, runs: list[dict[str, float]]) -> Result:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return Result(engine, med["out_tok_s"], med["ttft_ms"], med["tpot_ms"], runs)


def run_ember(
    llm: Any,
    workload: Workload,
    repeats: int,
    loras: Sequence[Any] | None = None,
    params: Sequence[SamplingParams] | None = None,
) -> Result:
    """Drive the engine step by step: TTFT = first step of a request's first token, TPOT =
    median time per step after it, throughput = all output tokens / wall time. `loras`:
    request i uses `loras[i % len(loras)]` (a LoRARequest or None); `params`: request i uses
    `params[i % len(params)]`, which must make it emit exactly `output_len` tokens (default:
    greedy, EOS ignored)."""
    engine = llm.llm_engine
    prompts = prompts_for(workload, engine.vocab_size)
    greedy = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    runs = []
    for rep in range(repeats):
        engine.block_manager.reset_prefix_cache()  # each repeat computes its prompts
        for i, p in enumerate(prompts):
            lora = loras[i % len(loras)] if loras else None
            sp = params[i % len(params)] if params else greedy
            engine.add_request(f"bench{rep}-{i}", {"prompt_token_ids": p}, sp, lora)
        steps: list[tuple[float, int]] = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            steps.append((time.perf_counter() - t, len(outs)))
        wall = time.perf_counter() - start
        first = next(i for i, (_, n) in enumerate(steps) if n == workload.num_requests)
        runs.append(
            {
                "out_tok_s": workload.num_requests * workload.output_len / wall,
                "ttft_ms": sum(s for s, _ in steps[: first + 1]) * 1e3,
                "tpot_ms": statistics.median(s for s, _ in steps[first + 1 :]) * 1e3,
            }
        )
    return summarize("ember", runs)


_CHILD = """
import json, sys
from ember import LLM
from ember.tools.bench import Workload, probe_bandwidth_gbs, run_ember
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], use_tqdm=False, **args["engine"])
out = {"kv": str(llm.config.kv_dtype).removeprefix("torch.")}
for key, w in args["workloads"]:
    gbs = probe_bandwidth_gbs()
    r = run_ember(llm, Workload(**w), args["repeats"])
    out[key] = {"ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms, "out_tok_s": r.out_tok_s,
                "probe_gbs": gbs}
llm.close()
print(json.dumps(out))
"""


def run_ember_child(
    model: str,
    repeats: int,
    workloads: Sequence[str | Workload] = ("lat", "thru"),
    cpu_isa: str = "native",
    **engine_args: Any,
) -> dict[str, Any]:
    """`run_ember` on `model` in a fresh child process (so each engine starts from the caches
    alone, and `cpu_isa="avx2"` makes the whole child an AVX2-only host: `EMBER_CPU_ISA`, ATen
    and oneDNN capped). `workloads`: keys of WORKLOADS or Workloads. Returns {key (a Workload's
    name): {ttft_ms, tpot_ms, out_tok_s}, "kv": the cache dtype}; `engine_args` go to `LLM` (JSON
    values); a failed child is a RuntimeError with the end of its stderr. Each workload's
    figures carry "probe_gbs", the child's `probe_bandwidth_gbs` just before it. For the peer
    benchmarks."""
    import dataclasses
    import json
    import subprocess
    import sys

    from ember.host import isa as host
    from ember.host import memory as host_memory

    env = dict(os.environ)
    if cpu_isa == "avx2":
        env.update({host.HOST_ISA_ENV: "avx2"}, **host_memory.AVX2_ENV)
    chosen = [(w, WORKLOADS[w]) if isinstance(w, str) else (w.name, w) for w in workloads]
    spec = {"model": model, "repeats": repeats, "engine": {"cpu_isa": cpu_isa, **engine_args},
            "workloads": [(key, dataclasses.asdict(w)) for key, w in chosen]}  # fmt: skip
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True, env=env
    )
    if child.returncode != 0:
        raise RuntimeError(f"ember on {model}: {child.stderr[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def alternate(engines: Sequence[Callable[[], dict[str, Any]]], repeats: int) -> list[dict]:
    """Peer benchmarks: `repeats` runs of each engine, alternated and mirrored (A B, B A, A B,
    ...), each run a dict {"lat": {ttft_ms, tpot_ms}, "thru": {out_tok_s}, ...}; returns one
    such dict per engine, each figure the median of its runs (other keys from the first run),
    with "runs": the runs in order. On the VMs ember is measured on, memory bandwidth drifts by
    tens of percent within minutes; one engine's runs back to back, then the other's, measured
    that drift as much as the engines (`probe_bandwidth_gbs`)."""
    runs: list[list[dict]] = [[] for _ in engines]
    for r in range(repeats):
        order = range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            runs[i].append(engines[i]())
    out = []
    for own in runs:
        med = {**own[0], "runs": own}
        for part in ("lat", "thru"):
            med[part] = {k: statistics.median(r[part][k] for r in own) for k in own[0][part]}
        out.append(med)
    return out


def probe_bandwidth_gbs() -> float:
    """The peer benchmarks' probe of the machine's state, taken just before each engine's
    W-LAT ("probe_gbs" in its figures): this process's read rate over 256 MiB (all its
    threads), ~0.1 s. On a 2-vCPU AMD EPYC (Zen 4) VM, 2 threads read 27-55 GB/s within hours,
    switching within seconds, while 1 thread read a steady 18-23; ember's batch-1 decode
    tracked the 2-thread rate (Llama-1B Q4_K_M, 813 MB a token: 25.3 ms at 34 GB/s, then 16.7-
    17.8 ms at 51-55 in the same process). A switch during a run is not seen: it tells a
    sitting's state, not always each run's."""
    return measure_bandwidth_gbs(256 << 20, 3)


def tpots(engine: dict) -> str:
    """An `alternate` result's TPOT of each run, in order ("12.34, 12.56"), each with its
    probe's GB/s where the run has one ("12.34 @31, 12.56 @44")."""
    return ", ".join(
        f"{lat['tpot_ms']:.2f}" + (f" @{lat['probe_gbs']:.0f}" if "probe_gbs" in lat else "")
        for lat in (run["lat"] for run in engine["runs"])
    )


def run_hf(
    model_dir: str,
    dtype: torch.dtype,
    workload: Workload,
    repeats: int,
    static_compile: bool = False,
) -> Result:
    """HF transformers `generate` on the same prompts (one batch, no padding needed): eager with
    its dynamic cache, or `static_compile`: a static KV cache and `torch.compile(model.forward,
    fullgraph=True)`, HF's recipe for low latency (two graphs: prefill and decode). Start-up is
    load time plus, when compiling, the first (compiling) generate call."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if is_gguf(model_dir):  # HF dequantizes a GGUF file to `dtype`
        model_dir, kwargs["gguf_file"] = os.path.split(os.path.abspath(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).eval()
    ids = torch.tensor(prompts_for(workload, model.config.vocab_size))
    kw: dict[str, Any] = dict(
        do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids)
    )
    if static_compile:
        kw["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)

    def generate(n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t

    runs = []
    with torch.inference_mode():
        if static_compile:
            generate(2)  # compiles the prefill and the decode graph
        startup = time.perf_counter() - t0
        for _ in range(repeats):
            ttft = generate(1)
            wall = generate(workload.output_len)
            runs.append(
                {
                    "out_tok_s": workload.num_requests * workload.output_len / wall,
                    "ttft_ms": ttft * 1e3,
                    "tpot_ms": (wall - ttft) / (workload.output_len - 1) * 1e3,
                }
            )
    result = summarize("hf-static-compile" if static_compile else "hf-eager", runs)
    result.startup_s = startup
    return result


def teacher_forced_ranks(model: Any, prompt: list[int], generated: list[int]) -> list[int]:
    """Rank of each generated token in `model`'s (an HF causal LM's) logits at its step,
    teacher-forced on `prompt + generated` (0: the model's argmax)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(generated)[:, None])
    return (logits > chosen).sum(dim=1).tolist()


def count_vec_isa_probes() -> list[str]:
    """From now on in this process, every vector-ISA probe inductor runs (a child Python
    loading a test library, ~0.2 s each; see `ember.compile.inductor.vec_isa_probes`) appends
    its library's path to the list returned: what a start-up measurement counts."""
    from torch._inductor import cpu_vec_isa

    probes: list[str] = []
    probe_load = cpu_vec_isa.VecISA._probe_load

    def counted(self: Any, path: str) -> bool:
        probes.append(path)
        return probe_load(self, path)

    cpu_vec_isa.VecISA._probe_load = counted
    return probes


def measure_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth of this machine: median time to sum a large fp32 tensor."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return num_bytes / statistics.median(times) / 1e9


def decode_bytes_per_token(model: torch.nn.Module) -> int:
    """Weight bytes one batch-1 decode step reads: every parameter and weight buffer (int8
    weights and their scales) except the input embedding table (one row of it is read),
    counting a tied LM head once, and of a mixture of experts only the experts a token is
    routed to (`_idle_expert_bytes`)."""
    module = model.get_input_embeddings()  # type: ignore[operator]
    embed = module.weight
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # params + saved buffers
    total = sum(t.numel() * t.element_size() for t in unique.values()) - _idle_expert_bytes(model)
    head = model.get_output_embeddings()  # type: ignore[operator]
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    if tied:
        return total
    table = {
        t.data_ptr(): t for t in module.state_dict().values()
    }  # a quantized table's scales too
    return total - sum(t.numel() * t.element_size() for t in table.values())


def _idle_expert_bytes(model: torch.nn.Module) -> int:
    """The bytes of the experts a batch-1 token does not read: of each MoE layer's E experts
    (an HF experts module's [E, ...] weights, or `QuantizedExperts`' stacked panels) it reads
    its top k (`num_experts_per_tok`), so E - k experts' bytes are idle (Qwen3-30B-A3B:
    120 of 128)."""
    config = model.config.get_text_config()  # type: ignore[union-attr, operator]
    k = getattr(config, "num_experts_per_tok", None)
    if not k:
        return 0
    idle = 0
    for module in model.modules():
        num = getattr(module, "num_experts", None)
        if not isinstance(num, int) or num <= k:
            continue
        # its own [E, rows, K] weights (gate_up_proj, down_proj; a stacked panel's), not a
        # router's [E, H], which every token reads
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors = [t for t in own if t.dim() >= 3 and t.shape[0] == num]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        idle += nbytes * (num - k) // num
    return idle


def measure_gemm_gflops(
    dtype: torch.dtype, m: int = 512, k: int = 2048, n: int = 2048, repeats: int = 5
) -> float:
    """This machine's best GEMM rate in `dtype` (a prefill-sized `x @ W.T`), GFLOP/s: ATen's,
    or ember's packed kernel when it is loaded (fp32 panels, or bf16 pairs where the build has
    AVX512-BF16), whichever is faster."""
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    candidates = [lambda: torch.nn.functional.linear(x, w)]
    if dtype == torch.float32 and kernels.loaded_isa() is not None:
        packed = torch.ops.ember_cpu.pack_linear_weight(w)
        candidates.append(lambda: torch.ops.ember_cpu.packed_linear(x, packed, None, None, n))
    if dtype == torch.bfloat16 and kernels.bf16_pairs():
        pairs = torch.ops.ember_cpu.pack_bf16_pairs(w)
        candidates.append(lambda: torch.ops.ember_cpu.packed_linear(x, pairs, None, None, n))
    best = 0.0
    for fn in candidates:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        best = max(best, 2 * m * k * n / statistics.median(times) / 1e9)
    return best


def workload_flops(model: Any, workload: Workload) -> float:
    """FLOPs of the workload's model math: every linear layer at every computed token, the LM
    head only at sampled positions (one per output token), and attention (QK^T and PV) over
    each token's causal context. Embedding lookups, norms and activations are not counted."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    body = sum(
        m.in_features * m.out_features
        for m in model.modules()
        if hasattr(m, "in_features")
        and hasattr(m, "out_features")
        and m is not head
        and not any(True for _ in m.children())  # leaves only (a LoRA wrapper counts once)
    )
    cfg = model.config
    p, o, n = workload.prompt_len, workload.output_len, workload.num_requests
    tokens = p + o - 1  # the last output token is sampled, never fed back
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    context = tokens * (tokens + 1) / 2  # sum over tokens of their context length
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context
    per_request = 2 * body * tokens + 2 * head.in_features * head.out_features * o + attention
    return n * per_request


@dataclass
class Report:
    """One `ember bench` run: results (ember first) and this machine's rooflines, all measured
    in the same process."""

    workload: Workload
    results: list[Result]
    bandwidth_gbs: float
    bytes_per_token: int
    gemm_gflops: float
    gemm_dtype: str
    flops: float
    warm_start: bool

    @property
    def roofline_ms(self) -> float:
        """Batch-1 decode floor: weight bytes per token / memory bandwidth."""
        return self.bytes_per_token / (self.bandwidth_gbs * 1e9) * 1e3


def format_table(report: Report) -> str:
    w, results = report.workload, report.results
    lines = [
        f"{w.name}: {w.num_requests} req x {w.prompt_len} prompt + {w.output_len} output "
        f"tokens; medians of {len(results[0].runs)} runs",
        f"{'engine':18s} {'out tok/s':>10s} {'TTFT ms':>9s} {'TPOT ms':>9s} {'start-up s':>11s}",
    ]
    for r in results:
        startup = f"{r.startup_s:11.1f}" if r.startup_s is not None else f"{'-':>11s}"
        lines.append(
            f"{r.engine:18s} {r.out_tok_s:10.1f} {r.ttft_ms:9.1f} {r.tpot_ms:9.2f} {startup}"
        )
    ours = results[0]
    for other in results[1:]:
        lines.append(
            f"ember vs {other.engine}: throughput {ours.out_tok_s / other.out_tok_s:.2f}x, "
            f"TTFT {other.ttft_ms / ours.ttft_ms:.2f}x faster, "
            f"TPOT {other.tpot_ms / ours.tpot_ms:.2f}x faster"
        )
    start = "warm (compile cache hit)" if report.warm_start else "cold (compiled)"
    lines.append(f"ember start-up {ours.startup_s or 0.0:.1f} s, {start}")
    line = (
        f"memory bandwidth {report.bandwidth_gbs:.1f} GB/s; weights read per decode token "
        f"{report.bytes_per_token / 1e6:.0f} MB; batch-1 decode roofline "
        f"{report.roofline_ms:.2f} ms/token"
    )
    if w.num_requests == 1:  # the bandwidth roofline is for batch-1 decode
        line += f"; ember TPOT at {report.roofline_ms / ours.tpot_ms:.0%} of it"
    lines.append(line)
    achieved = report.flops / (w.num_requests * w.output_len / ours.out_tok_s) / 1e9
    lines.append(
        f"GEMM rate {report.gemm_gflops:.0f} GFLOP/s ({report.gemm_dtype}); workload "
        f"{report.flops / 1e12:.2f} TFLOP; ember {achieved:.0f} GFLOP/s = "
        f"{achieved / report.gemm_gflops:.0%} of the compute roofline"
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class StepProfile:
    """Where a batch-1 decode step's time goes (ms per step, means over the profiled steps, the
    basis of the profiler's totals, so that graph + host = step even when one step stalls):
    `step` wall time; `graph` inside the forward (compiled region, or the eager forward), split
    into `linears` (every projection and the LM head), `attention` (the paged-attention op) and
    `other` (norms, RoPE, activations: inductor's fused kernels, and guard checks); `host` is
    the rest of the step (scheduling, batch building, sampling, detokenization, outputs)."""

    step: float
    graph: float
    linears: float
    attention: float
    other: float
    host: float


_LINEAR_OPS = (
    "ember_cpu::packed_linear",
    "ember_cpu::group_linear",
    "ember_cpu::fp32_linear",
    "ember_cpu::bf16_linear",
)
_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear")
# Each backend's top-level attention op (the C++ torch backend's nests nothing on decodes).
_ATTENTION_OPS = (
    "ember_cpu::paged_attention",
    "ember::paged_attention",
    "ember_cpu::paged_attention_opaque",  # in compiled regions (ember.compile.regions)
    "ember::paged_attention_opaque",
    "ember::paged_attention_ipex",
    "ember::paged_attention_triton",
)


def profile_decode_steps(llm: Any, context: int = 128, steps: int = 32) -> StepProfile:
    """Profile `steps` batch-1 decode steps at about `context` tokens with torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    prompt = prompts_for(Workload("profile", 1, context, 0), engine.vocab_size)[0]
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    engine.add_request("profile", {"prompt_token_ids": prompt}, params)
    for _ in range(4):  # the prefill, then warm decodes
        engine.step()
    walls = []
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - t)
    finally:
        engine.abort_request("profile")
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        totals[event.key] = totals.get(event.key, 0.0) + event.cpu_time_total / 1e3
    self_times = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    per = 1.0 / steps
    graph = totals.get("ember::forward", 0.0) * per
    linears = sum(totals.get(k, 0.0) for k in _LINEAR_OPS)
    linears += sum(self_times.get(k, 0.0) for k in _GEMM_OPS)
    attention = sum(totals.get(k, 0.0) for k in _ATTENTION_OPS)
    step = statistics.fmean(walls) * 1e3
    linears, attention = linears * per, attention * per
    return StepProfile(
        step=step,
        graph=graph,
        linears=linears,
        attention=attention,
        other=max(graph - linears - attention, 0.0),
        host=max(step - graph, 0.0),
    )


def format_profile(p: StepProfile, bytes_per_token: int, bandwidth_gbs: float) -> str:
    linear_gbs = bytes_per_token / (p.linears * 1e-3) / 1e9 if p.linears else 0.0
    return (
        f"batch-1 decode step (profiled, ms): step {p.step:.2f} = graph {p.graph:.2f} "
        f"[linears {p.linears:.2f} ({linear_gbs:.1f} GB/s of {bandwidth_gbs:.1f}), attention "
        f"{p.attention:.2f}, other {p.other:.2f}] + host {p.host:.2f}"
    )
