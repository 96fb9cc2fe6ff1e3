"""Serving benchmark: Poisson arrivals at a request rate against any OpenAI-compatible server
(`ember serve`, llama.cpp's `llama-server`, vLLM), streaming `/v1/completions`, reporting TTFT,
TPOT and end-to-end latency percentiles and output tokens per second.

    ember bench --serve http://127.0.0.1:8000 --served-model NAME --request-rate 4 --num-prompts 64

Prompts are random words (seeded), so every server tokenizes the same text; each request asks
for exactly `output_len` tokens (`ignore_eos`, which ember, vLLM and llama-server all take).
TPOT is per request (last token chunk - first) / (tokens - 1), tokens as the server's `usage`
reports them (`stream_options.include_usage`), else the chunks.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact river stone light paper music "
    "water garden window mountain engine market story science winter letter doctor city"
).split()


@dataclass
class ServeResult:
    num_requests: int
    duration_s: float
    output_tokens: int
    ttft_ms: list[float]
    tpot_ms: list[float]
    e2e_ms: list[float]
    errors: int

    @property
    def out_tok_s(self) -> float:
        return self.output_tokens / self.duration_s

    def summary(self) -> str:
        def pct(xs: list[float]) -> str:
            if not xs:
                return "n/a"
            q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
            return f"p50 {q[49]:.1f} p90 {q[89]:.1f} p99 {q[98]:.1f}"

        return (
            f"{self.num_requests} requests in {self.duration_s:.1f} s, {self.errors} errors; "
            f"output {self.out_tok_s:.1f} tok/s\n"
            f"  TTFT ms {pct(self.ttft_ms)}\n  TPOT ms {pct(self.tpot_ms)}\n"
            f"  E2E  ms {pct(self.e2e_ms)}"
        )


def make_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _one(client: Any, model: str, prompt: str, output_len: int) -> tuple[float, ...]:
    start = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        # Any chunk with a choice is a token arriving (llama-server streams tokens whose text
        # is empty, such as byte pieces, as chunks too).
        if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason is None):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            chunks += 1
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage.completion_tokens
    if first is None or last is None:
        raise RuntimeError("the server streamed no token")
    return start, first, last, usage if usage is not None else chunks


async def _run(
    url: str, model: str, rate: float, num: int, input_words: int, output_len: int,
    api_key: str, seed: int,
) -> ServeResult:  # fmt: skip
    import openai  # noqa: PLC0415

    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0)
    rng = random.Random(seed)
    prompts = [make_prompt(rng, input_words) for _ in range(num)]
    gaps = [rng.expovariate(rate) if rate > 0 else 0.0 for _ in range(num)]
    tasks = []
    t0 = time.perf_counter()
    for prompt, gap in zip(prompts, gaps, strict=True):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(_one(client, model, prompt, output_len)))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.perf_counter() - t0
    await client.close()
    ok = [r for r in results if not isinstance(r, BaseException)]
    return ServeResult(
        num_requests=num,
        duration_s=duration,
        output_tokens=sum(r[3] for r in ok),
        ttft_ms=[(f - s) * 1e3 for s, f, _, _ in ok],
        tpot_ms=[(la - f) * 1e3 / (n - 1) for _, f, la, n in ok if n > 1],
        e2e_ms=[(la - s) * 1e3 for s, _, la, _ in ok],
        errors=len(results) - len(ok),
    )


def run_serve_bench(
    url: str,
    model: str,
    request_rate: float = 4.0,
    num_prompts: int = 64,
    input_words: int = 96,
    output_len: int = 128,
    api_key: str = "none",
    seed: int = 0,
) -> ServeResult:
    """Run the benchmark (request_rate <= 0: all requests at once)."""
    return asyncio.run(
        _run(url, model, request_rate, num_prompts, input_words, output_len, api_key, seed)
    )
