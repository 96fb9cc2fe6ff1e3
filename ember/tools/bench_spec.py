"""W-SPEC: speculative decoding against plain decoding on the same model, in one process, runs
alternated (`ember bench --workload spec`, `benchmarks/bench_spec.py`).

Tasks (chat prompts through the model's template; a model without a tokenizer gets token-id
prompts of the same lengths):
- quote: repeat a 90-word passage word for word (the answer is the prompt's text);
- edit: rename a variable in a 12-line Python function (most of the answer is the prompt's);
- json: fill a JSON template from a short description (keys and layout come from the prompt);
- free: a short poem, sampled at temperature 0.8 (nothing to copy: the proposer must back off).

Greedy tasks give token-identical outputs with and without speculation, so their TPOTs compare
the same tokens. A request's TPOT is (time of its last token - time of its first) / (tokens - 1);
each figure is the median over `repeats` alternated runs of the mean over the batch.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ember.runtime.request import SamplingParams

PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the "
    "coast of Queensland, Australia. It can be seen from outer space and is the world's "
    "biggest single structure made by living organisms. This reef structure is composed of "
    "and built by billions of tiny organisms, known as coral polyps."
)
CODE = '''def total_price(items, x):
    """Sum the prices of items, with tax rate x."""
    result = 0.0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("taxable", True):
            price = price * (1 + x)
        result += price
    if result > 100:
        result = result * 0.95
    return round(result, 2)
'''
TEMPLATE = '{"name": "", "age": 0, "city": "", "email": "", "languages": [], "employed": false}'
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "quote": (
        "Repeat this passage exactly, word for word:\n\n" + PASSAGE,
        {"temperature": 0.0},
    ),
    "edit": (
        "Rename the parameter x to tax_rate in this function and return the whole function:"
        "\n\n" + CODE,
        {"temperature": 0.0},
    ),
    "json": (
        "Fill in this JSON template for Maria Lopez, 34, a software engineer in Madrid who "
        "speaks Spanish and English, email maria@example.com. Answer with the JSON only.\n\n"
        + TEMPLATE,
        {"temperature": 0.0},
    ),
    "free": ("Write a short poem about the sea at night.", {"temperature": 0.8, "top_p": 0.95}),
}


@dataclass(frozen=True)
class SpecRow:
    task: str
    batch: int
    tpot_base_ms: float
    tpot_spec_ms: float
    out_tokens: float  # mean output tokens per request (speculative runs)
    proposed: int  # draft tokens over the speculative runs
    accepted: int

    @property
    def speedup(self) -> float:
        return self.tpot_base_ms / self.tpot_spec_ms

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def task_prompt(llm: Any, text: str) -> list[int]:
    """`text` as a user message through the model's chat template (or plain, without one)."""
    tokenizer = llm.llm_engine.tokenizer
    if tokenizer is None:  # random ids of the text's length in characters / 4
        rng = random.Random(len(text))
        return [rng.randrange(3, llm.llm_engine.vocab_size) for _ in range(len(text) // 4)]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    return list(tokenizer(text)["input_ids"])


def timed_batch(
    llm: Any, prompt: list[int], params: SamplingParams, batch: int, tag: str
) -> tuple[float, float]:
    """(mean TPOT ms, mean output tokens) of `batch` copies of `prompt` run together; copy i
    of a sampled task gets seed i (the same seeds in every run)."""
    engine = llm.llm_engine
    for i in range(batch):
        p = params if params.temperature == 0 else dataclasses.replace(params, seed=i)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, p)
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            last[out.request_id] = (now, n)
    tpots = [(last[r][0] - first[r]) / (last[r][1] - 1) for r in first if last[r][1] > 1]
    mean_tokens = statistics.mean(n for _, n in last.values())
    # A model that answers in one token (EOS at once) has no TPOT.
    return (statistics.mean(tpots) * 1e3 if tpots else float("nan")), mean_tokens


def run_spec(
    base: Any,
    spec: Any,
    tasks: tuple[str, ...] = tuple(TASKS),
    batches: tuple[int, ...] = (1, 8),
    repeats: int = 3,
    max_tokens: int = 128,
) -> list[SpecRow]:
    """W-SPEC on two engines of one model: `base` plain, `spec` with a speculative_config."""
    rows = []
    scheduler = spec.llm_engine.scheduler
    for task in tasks:
        text, sampling = TASKS[task]
        prompt = task_prompt(base, text)
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        for batch in batches:
            t_base, t_spec, tokens = [], [], []
            proposed, accepted = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
            for rep in range(repeats):
                t_base.append(timed_batch(base, prompt, params, batch, f"b{task}{batch}-{rep}")[0])
                t, n = timed_batch(spec, prompt, params, batch, f"s{task}{batch}-{rep}")
                t_spec.append(t)
                tokens.append(n)
            rows.append(
                SpecRow(
                    task,
                    batch,
                    statistics.median(t_base),
                    statistics.median(t_spec),
                    statistics.mean(tokens),
                    scheduler.num_draft_tokens - proposed,
                    scheduler.num_accepted_tokens - accepted,
                )
            )
    return rows


def format_spec(rows: list[SpecRow], description: str) -> str:
    lines = [
        f"W-SPEC: {description}",
        f"{'task':6s} {'batch':>5s} {'TPOT plain ms':>14s} {'TPOT spec ms':>13s} "
        f"{'speed-up':>9s} {'acceptance':>11s} {'tokens/req':>10s}",
    ]
    for r in rows:
        lines.append(
            f"{r.task:6s} {r.batch:5d} {r.tpot_base_ms:14.2f} {r.tpot_spec_ms:13.2f} "
            f"{r.speedup:8.2f}x {r.acceptance:10.0%} {r.out_tokens:10.0f}"
        )
    return "\n".join(lines)
