"""Standard workloads (../shared/DESIGN.md) for `ember bench` and the benchmark suites.

W-THRU: 32 requests x 128 random prompt tokens (seed 0), 128 output tokens each, greedy, EOS
ignored; output tokens/s excluding load and warm-up. W-LAT: 1 request, 128 prompt tokens, 128
output tokens; TTFT and TPOT. Every figure is the median of `repeats` runs in this process, and
`--compare hf` runs the same workload with HF transformers (eager `generate`) in the same
process, so ratios come from one run on this noisy machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.runtime.request import SamplingParams


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


def prompts_for(workload: Workload, vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, vocab_size, (workload.prompt_len,), generator=g).tolist()
        for _ in range(workload.num_requests)
    ]


def _summary(engine: str, runs: list[dict[str, float]]) -> Result:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return Result(engine, med["out_tok_s"], med["ttft_ms"], med["tpot_ms"], runs)


def run_ember(
    llm: Any, workload: Workload, repeats: int, loras: Sequence[Any] | None = None
) -> Result:
    """Drive the engine step by step: TTFT = first step of a request's first token, TPOT =
    median time per step after it, throughput = all output tokens / wall time. `loras`:
    request i uses `loras[i % len(loras)]` (a LoRARequest or None)."""
    engine = llm.llm_engine
    prompts = prompts_for(workload, engine.vocab_size)
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    runs = []
    for rep in range(repeats):
        engine.block_manager.reset_prefix_cache()  # each repeat computes its prompts
        for i, p in enumerate(prompts):
            lora = loras[i % len(loras)] if loras else None
            engine.add_request(f"bench{rep}-{i}", {"prompt_token_ids": p}, params, lora)
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
    return _summary("ember", runs)


def run_hf(model_dir: str, dtype: torch.dtype, workload: Workload, repeats: int) -> Result:
    """HF transformers eager `generate` on the same prompts (one batch, no padding needed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor(prompts_for(workload, model.config.vocab_size))
    kw = dict(
        do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids)
    )
    runs = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(
                ids, max_new_tokens=workload.output_len, min_new_tokens=workload.output_len, **kw
            )
            wall = time.perf_counter() - t
            runs.append(
                {
                    "out_tok_s": workload.num_requests * workload.output_len / wall,
                    "ttft_ms": ttft * 1e3,
                    "tpot_ms": (wall - ttft) / (workload.output_len - 1) * 1e3,
                }
            )
    return _summary("hf-eager", runs)


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
    """Weight bytes one batch-1 decode step reads: every parameter except the input embedding
    table (one row of it is read), counting a tied LM head once."""
    embed = model.get_input_embeddings().weight  # type: ignore[operator]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    head = model.get_output_embeddings()  # type: ignore[operator]
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    return total if tied else total - embed.numel() * embed.element_size()


def format_table(
    workload: Workload,
    results: list[Result],
    startup_s: float,
    bandwidth_gbs: float,
    roofline_ms: float,
) -> str:
    lines = [
        f"{workload.name}: {workload.num_requests} req x {workload.prompt_len} prompt + "
        f"{workload.output_len} output tokens; medians of {len(results[0].runs)} runs",
        f"{'engine':10s} {'out tok/s':>10s} {'TTFT ms':>9s} {'TPOT ms':>9s}",
    ]
    for r in results:
        lines.append(f"{r.engine:10s} {r.out_tok_s:10.1f} {r.ttft_ms:9.1f} {r.tpot_ms:9.2f}")
    if len(results) > 1:
        a, b = results[0], results[1]
        lines.append(
            f"ratio ember/{b.engine}: throughput {a.out_tok_s / b.out_tok_s:.2f}x, "
            f"TTFT {b.ttft_ms / a.ttft_ms:.2f}x faster, TPOT {b.tpot_ms / a.tpot_ms:.2f}x faster"
        )
    line = (
        f"ember start-up {startup_s:.1f} s; memory bandwidth {bandwidth_gbs:.1f} GB/s; "
        f"batch-1 decode roofline {roofline_ms:.2f} ms/token"
    )
    if workload.num_requests == 1:  # the roofline is for batch-1 decode
        line += f" (ember TPOT at {roofline_ms / results[0].tpot_ms:.0%} of it)"
    lines.append(line)
    return "\n".join(lines)
