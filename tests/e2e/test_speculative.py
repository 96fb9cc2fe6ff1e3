"""Speculative decoding end to end on tiny seeded checkpoints, each against the same engine
without speculation (itself tested against HF transformers): greedy outputs token for token
(batch 1, mixed batches with chunked prefill, preemption, LoRA, structured outputs, stop rules,
logprobs, penalties, n > 1), compiled graphs with no recompile, the sampled distribution
(a two-sample chi-square test), and no leaked KV blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.lora.adapter import LoRARequest
from tests.conftest import gib_for_blocks, make_prompts
from tests.runtime.test_speculative import FixedProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


def _llm(d: str, spec: dict | None = NGRAM, **kw) -> LLM:
    kw = {"compile": False, "dtype": "float32", "kv_cache_gib": 0.02, "max_model_len": 256} | kw
    return LLM(model=d, speculative_config=spec, **kw)


def repetitive_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat their own phrases, so n-grams of the output recur in them."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num):
        phrase = rng.integers(3, 500, size=int(rng.integers(3, 9))).tolist()
        noise = rng.integers(3, 500, size=int(rng.integers(0, 6))).tolist()
        prompts.append(noise + phrase * int(rng.integers(2, 6)))
    return prompts


def _same(a, b, logprobs: bool = False) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.error is None and y.error is None, (x.error, y.error)
        assert len(x.outputs) == len(y.outputs)
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            assert (cx.text, cx.finish_reason, cx.stop_reason) == (
                cy.text,
                cy.finish_reason,
                cy.stop_reason,
            )
            if logprobs:
                assert len(cx.logprobs) == len(cy.logprobs) == len(cx.token_ids)
                for ex, ey in zip(cx.logprobs, cy.logprobs, strict=True):
                    assert list(ex) == list(ey)  # the same ids, in the same order
                    for t in ex:
                        assert ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-4)
                        assert ex[t].rank == ey[t].rank


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    return d, _llm(d, None), _llm(d)


def _stats(llm: LLM) -> tuple[int, int]:
    s = llm.llm_engine.scheduler
    return s.num_draft_tokens, s.num_accepted_tokens


def test_greedy_batch_one_equals_plain_decoding(engines):
    _, base, spec = engines
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=3)
    before = _stats(spec)
    for prompt in repetitive_prompts(4):
        _same(base.generate([prompt], params), spec.generate([prompt], params), logprobs=True)
    proposed, accepted = (a - b for a, b in zip(_stats(spec), before, strict=True))
    assert accepted > 0 and proposed > accepted  # drafts were kept and rejected
    assert spec.llm_engine.num_free_blocks() == spec.llm_engine.block_manager.num_usable_blocks


def test_greedy_mixed_batches_chunked_prefill_and_request_rules(engines, checkpoint_dir):
    d, base, _ = engines
    prompts = repetitive_prompts(12, seed=1) + make_prompts(4, seed=2)
    # Small steps: drafts ride beside prefill chunks of other requests.
    spec = _llm(d, max_num_batched_tokens=24, max_num_seqs=6, block_size=4)
    base = _llm(d, None, max_num_batched_tokens=24, max_num_seqs=6, block_size=4)
    tok = base.get_tokenizer()
    text = tok.decode(prompts[0][-6:])
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=0.0, min_tokens=10, stop_token_ids=[7, 9]),
        SamplingParams(max_tokens=40, temperature=0.0, stop=[text[-3:]], logprobs=1),
        SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(max_tokens=30, temperature=0.0, n=2, logit_bias={11: 3.0}),
        SamplingParams(max_tokens=25, temperature=0.0, bad_words=[tok.decode([prompts[0][-1]])]),
        SamplingParams(max_tokens=20, temperature=0.0, prompt_logprobs=2, logprobs=2),
    ]  # fmt: skip
    per = [params[i % len(params)] for i in range(len(prompts))]
    want, got = base.generate(prompts, per), spec.generate(prompts, per)
    _same(want, got)
    for w, g in zip(want, got, strict=True):
        if w.prompt_logprobs is not None:
            assert [None if e is None else list(e) for e in w.prompt_logprobs] == [
                None if e is None else list(e) for e in g.prompt_logprobs
            ]
    proposed, accepted = _stats(spec)
    assert accepted > 0 and proposed > accepted
    engine = spec.llm_engine
    engine.block_manager.assert_invariants()
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks


def test_greedy_under_preemption(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    gib = gib_for_blocks(d, 24, 4)
    prompts = repetitive_prompts(8, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = _llm(d, None, kv_cache_gib=gib, block_size=4, max_model_len=80)
    spec = _llm(d, kv_cache_gib=gib, block_size=4, max_model_len=80)
    _same(base.generate(prompts, params), spec.generate(prompts, params))
    assert spec.llm_engine.scheduler.num_preemptions > 0
    assert _stats(spec)[1] > 0
    spec.llm_engine.block_manager.assert_invariants()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_lora_adapters(checkpoint_dir, tmp_path, method):
    from tests.lora.test_lora_e2e import make_adapter

    d = checkpoint_dir("tiny-llama")
    lora = LoRARequest("qv", 1, make_adapter(d, str(tmp_path / "qv"), 1, 8, ["q_proj", "v_proj"]))
    prompts = repetitive_prompts(4, seed=4)
    loras = [lora, None, lora, None]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    kw = dict(enable_lora=True, max_lora_rank=8, block_size=4)
    base, spec = _llm(d, None, **kw), _llm(d, NGRAM if method == "ngram" else _draft(d), **kw)
    _same(
        base.generate(prompts, params, lora_request=loras),
        spec.generate(prompts, params, lora_request=loras),
    )
    assert _stats(spec)[1] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_structured_outputs(engines, method):
    d, base, spec = engines
    if method == "draft_model":
        spec = _llm(d, _draft(d))
    # A regex whose repeated part the n-gram proposer can copy from the output.
    so = StructuredOutputsParams(regex=r"(ab|cd)(ab|cd)(ab|cd)(ab|cd)x[0-9]{3}")
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so), plain] * 3
    prompts = repetitive_prompts(6, seed=5)
    before = _stats(spec)
    _same(base.generate(prompts, params), spec.generate(prompts, params))
    assert _stats(spec)[0] > before[0]


def test_sampling_matches_the_targets_distribution(checkpoint_dir):
    """Many seeded samples of the 2nd and 3rd output tokens, with and without speculation: a
    two-sample chi-square test per position. Every request's first decode verifies two drafts:
    the tokens the plain engine sampled most often at those positions, so drafts are both kept
    and rejected often (a random model's outputs rarely repeat its prompt for n-grams to hit)."""
    d = checkpoint_dir("tiny-llama")
    prompt = [5, 6, 7, 8, 9] * 6
    trials = 3000
    kw = dict(max_num_seqs=128, max_model_len=64, kv_cache_gib=0.05)
    params = [
        SamplingParams(max_tokens=4, temperature=0.3, ignore_eos=True, seed=s)
        for s in range(trials)
    ]
    outs = _llm(d, None, **kw).generate([prompt] * trials, params, use_tqdm=False)
    base = np.array([o.outputs[0].token_ids for o in outs])
    draft = tuple(int(np.bincount(base[:, pos]).argmax()) for pos in (1, 2))
    spec = _llm(d, **kw)
    spec.llm_engine.scheduler.proposer = FixedProposer(draft)
    spec.llm_engine.scheduler.step_costs.token_value = lambda _: 1e9  # always propose
    # Other seeds: the two runs are independent samples.
    params = [dataclasses.replace(p, seed=trials + p.seed) for p in params]
    outs = spec.generate([prompt] * trials, params, use_tqdm=False)
    ours = np.array([o.outputs[0].token_ids for o in outs])
    proposed, accepted = _stats(spec)
    assert proposed >= 2 * trials and trials // 10 < accepted < proposed - trials // 10
    for pos in (1, 2):
        a, b = base[:, pos], ours[:, pos]
        tokens, counts = np.unique(np.concatenate([a, b]), return_counts=True)
        common = tokens[counts >= 10]  # rarer tokens pooled into one bin
        table = np.array(
            [[np.sum(x == t) for t in common] + [np.sum(~np.isin(x, common))] for x in (a, b)]
        )
        table = table[:, table.sum(0) > 0]
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        assert chisquare_pvalue_2d(table, expected) > 1e-3, (pos, table)


def chisquare_pvalue_2d(table: np.ndarray, expected: np.ndarray) -> float:
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = (table.shape[0] - 1) * (table.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_compiled_steps_verify_drafts_without_recompiling(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    prompts = repetitive_prompts(6, seed=6)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = _llm(d, None).generate(prompts, params)
    spec = _llm(d, compile=True, max_num_batched_tokens=64)
    runner = spec.llm_engine.runner
    compiled = runner.graphs_compiled
    with torch.compiler.set_stance("fail_on_recompile"):
        _same(expected, spec.generate(prompts, params))
        _same(expected[:1], spec.generate(prompts[:1], params))  # batch 1
    assert runner.graphs_compiled == compiled
    assert _stats(spec)[1] > 0
    # A compiled draft model too: its catch-up chunks and batched decodes reuse its graphs.
    spec = _llm(d, _draft(d), compile=True, max_num_batched_tokens=64)
    draft_runner = spec.llm_engine.scheduler.proposer.engine.runner
    compiled = (spec.llm_engine.runner.graphs_compiled, draft_runner.graphs_compiled)
    with torch.compiler.set_stance("fail_on_recompile"):
        _same(expected, spec.generate(prompts, params))
    assert (spec.llm_engine.runner.graphs_compiled, draft_runner.graphs_compiled) == compiled
    assert _stats(spec)[1] > 0


def test_bad_configs_are_value_errors_naming_the_field(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    for spec, field in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2},
         "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": -1},
         "prompt_lookup_min"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            _llm(d, spec)


def test_served_with_speculative_config_and_metrics(engines):
    import json
    import urllib.request

    from tests.e2e.servers import metrics, start_serve, stop_serve

    d, base, _ = engines
    spec = json.dumps(NGRAM)
    args = [d, "--no-compile", "--kv-cache-gib", "0.02", "--max-model-len", "256",
            "--speculative-config", spec]  # fmt: skip
    proc, url = start_serve(args)
    try:
        prompt = repetitive_prompts(1, seed=7)[0]
        body = {"model": d, "prompt": prompt, "max_tokens": 32, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        req = urllib.request.Request(
            url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            text = json.load(r)["choices"][0]["text"]
        want = base.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0,
                                                      ignore_eos=True))  # fmt: skip
        assert text == want[0].outputs[0].text
        values = metrics(url)
        drafts = values["ember_spec_decode_num_draft_tokens_total"]
        accepted = values["ember_spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and 0 < accepted <= drafts
        assert values["ember_spec_decode_num_drafts_total"] > 0
    finally:
        stop_serve(proc)


def test_w_spec_benchmark_runs_and_reports(engines):
    """The W-SPEC rows report what the engines did: the draft tokens the speculative engine's
    scheduler counted, each request's whole answer, TPOTs in milliseconds within the run's
    wall time; the table prints those rows, its speed-up and acceptance computed from them."""
    import re
    import time

    from ember.tools.bench_spec import TASKS, format_spec, run_spec, task_prompt

    d = engines[0]
    base, spec = _llm(d, None, max_model_len=1024), _llm(d, max_model_len=1024)
    before = _stats(spec)
    start = time.perf_counter()
    rows = run_spec(base, spec, tasks=("quote", "free"), batches=(1, 2), repeats=1, max_tokens=12)
    wall_ms = (time.perf_counter() - start) * 1e3
    assert [(r.task, r.batch) for r in rows] == [("quote", 1), ("quote", 2), ("free", 1),
                                                 ("free", 2)]  # fmt: skip
    proposed, accepted = (a - b for a, b in zip(_stats(spec), before, strict=True))
    assert (sum(r.proposed for r in rows), sum(r.accepted for r in rows)) == (proposed, accepted)
    assert proposed > 0
    for r in rows:
        assert 0 <= r.accepted <= r.proposed
        # Each request's whole answer (12 tokens unless EOS comes first, as plain decoding
        # gives it for the greedy task), its TPOT in ms: (tokens - 1) of them fit in the run.
        params = SamplingParams(max_tokens=12, **TASKS[r.task][1])
        if params.temperature == 0:
            prompt = {"prompt_token_ids": task_prompt(base, TASKS[r.task][0])}
            plain = base.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            assert r.out_tokens == len(plain)
        assert 1 < r.out_tokens <= 12
        for tpot in (r.tpot_base_ms, r.tpot_spec_ms):
            assert 0 < tpot and tpot * (r.out_tokens - 1) < wall_ms
    table = format_spec(rows, "tiny").splitlines()
    assert table[0] == "W-SPEC: tiny" and table[1].split() == [
        "task", "batch", "TPOT", "plain", "ms", "TPOT", "spec", "ms", "speed-up", "acceptance",
        "tokens/req",
    ]  # fmt: skip
    assert len(table) == 2 + len(rows)
    for line, r in zip(table[2:], rows, strict=True):
        task, batch, base_ms, spec_ms, speedup, acceptance, tokens = line.split()
        assert (task, int(batch)) == (r.task, r.batch)
        assert float(base_ms) == pytest.approx(r.tpot_base_ms, abs=0.006)
        assert float(spec_ms) == pytest.approx(r.tpot_spec_ms, abs=0.006)
        assert re.fullmatch(r"\d+\.\d\dx", speedup)
        assert float(speedup[:-1]) == pytest.approx(r.tpot_base_ms / r.tpot_spec_ms, abs=0.006)
        share = r.accepted / r.proposed if r.proposed else 0.0
        assert acceptance == f"{share:.0%}"
        assert float(tokens) == pytest.approx(r.out_tokens, abs=0.5)


# ---- draft_model ------------------------------------------------------------------------------


def _draft(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.mark.parametrize("same", [True, False], ids=["self-draft", "other-draft"])
def test_draft_model_greedy_equals_plain_decoding(checkpoint_dir, same):
    """A draft that is the target itself (every draft kept) and one with other weights (most
    rejected), in mixed batches with chunked prefill (the draft catches up in chunks too) and
    logprobs; no block leaks in either cache."""
    d = checkpoint_dir("tiny-llama")
    draft = d if same else checkpoint_dir("tiny-llama", seed=1)
    prompts = repetitive_prompts(6, seed=8) + make_prompts(3, seed=9)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    kw = dict(max_num_batched_tokens=24, max_num_seqs=5, block_size=4)
    want = _llm(d, None, **kw).generate(prompts, params)
    spec = _llm(d, _draft(draft), **kw)
    _same(want, spec.generate(prompts, params), logprobs=True)
    proposed, accepted = _stats(spec)
    assert proposed > 0
    assert (accepted == proposed) if same else (accepted < proposed)
    proposer = spec.llm_engine.scheduler.proposer
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_usable_blocks
    assert not proposer.computed
    engine = spec.llm_engine
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks


def test_draft_model_shares_the_kv_budget(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    alone = _llm(d, None).llm_engine.block_manager.num_blocks
    spec = _llm(d, _draft(d)).llm_engine
    # Same geometry: each cache gets half the budget, and they hold as many tokens.
    assert spec.block_manager.num_blocks == spec.scheduler.proposer.blocks.num_blocks
    assert abs(spec.block_manager.num_blocks - alone // 2) <= 1


def test_draft_model_under_preemption_and_sampling(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    gib = 2 * gib_for_blocks(d, 24, 4)  # 24 blocks each for target and draft
    prompts = repetitive_prompts(8, seed=10)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_gib=gib, block_size=4, max_model_len=80)
    spec = _llm(d, _draft(d), **kw)
    want = _llm(d, None, kv_cache_gib=gib / 2, block_size=4, max_model_len=80)
    _same(want.generate(prompts, params), spec.generate(prompts, params))
    assert spec.llm_engine.scheduler.num_preemptions > 0
    # Sampled requests run (seeded: reproducible run to run).
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    first = spec.generate(prompts[:3], sampled)
    again = spec.generate(prompts[:3], sampled)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


def test_draft_model_with_another_vocabulary_is_a_value_error(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    other = checkpoint_dir("tiny-llama", vocab_size=300)
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        _llm(d, _draft(other))
