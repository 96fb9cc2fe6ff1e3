"""Encoder-decoder generation (BART) against HF transformers greedy `generate` (fp32,
token-identical): batches of different encoder and decoder lengths, staggered arrivals, chunked
prefill, preemption, compiled graphs with zero recompiles after warm-up."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from ember import LLM, SamplingParams
from tests.conftest import build_tiny_bart, gib_for_blocks, hf_bart_greedy

MAX_NEW = 10
VOCAB = 200


@pytest.fixture(scope="module")
def tiny_bart(tmp_path_factory) -> str:
    return build_tiny_bart(str(tmp_path_factory.mktemp("tiny-bart")), VOCAB)


def _cases(num: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(encoder ids, decoder prompt ids after the start token) of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i in range(num):
        enc_len = int(torch.randint(1, 60, (1,), generator=g))
        dec_len = [0, 0, 3, 30][i % 4]
        enc = torch.randint(3, VOCAB, (enc_len,), generator=g).tolist()
        dec = torch.randint(3, VOCAB, (dec_len,), generator=g).tolist()
        cases.append((enc, dec))
    return cases


def _prompt(enc: list[int], dec: list[int]) -> dict:
    return {
        "encoder_prompt": {"prompt_token_ids": enc},
        "decoder_prompt": {"prompt_token_ids": dec},
    }


chunked = False
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _run_staggered(llm: LLM, cases) -> list[list[int]]:
    """Submit 3 requests every other step; returns token ids in order. Sets the global
    `chunked` if any step scheduled part of a decoder prompt."""
    global chunked
    engine = llm.llm_engine
    schedule = engine.scheduler.schedule

    def spy():
        global chunked
        plan = schedule()
        for r in plan.requests:
            req = engine.scheduler.requests[r.request_id]
            chunked |= 1 < r.num_new_tokens < req.num_tokens - r.num_computed_tokens
        return plan

    engine.scheduler.schedule = spy
    pending = list(enumerate(cases))
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            for _ in range(min(3, len(pending))):
                i, (enc, dec) = pending.pop(0)
                engine.add_request(f"b{i}", _prompt(enc, dec), GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [done[f"b{i}"] for i in range(len(cases))]


def test_bart_batched_mixed_lengths_match_hf(tiny_bart):
    cases = _cases(8, seed=1)
    want = hf_bart_greedy(tiny_bart, cases, MAX_NEW)
    assert len({tuple(w) for w in want}) == len(want)  # the reference is not degenerate
    llm = LLM(
        model=tiny_bart,
        compile=False,
        dtype="float32",
        kv_cache_gib=0.01,
        block_size=4,
        max_num_batched_tokens=64,
    )
    outs = llm.generate([_prompt(e, d) for e, d in cases], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    # Staggered arrivals, a 24-token budget (chunked decoder prompts next to decodes) and a
    # cache of 40 blocks (preemption: the encoder reruns when a request is readmitted).
    llm = LLM(
        model=tiny_bart,
        compile=False,
        dtype="float32",
        kv_cache_gib=gib_for_blocks(tiny_bart, 40, 4),
        block_size=4,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        max_model_len=48,
    )
    assert _run_staggered(llm, cases) == want
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert chunked  # some decoder prompt was split across steps
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks
    engine.block_manager.assert_invariants()


def test_bart_text_prompts_and_errors(tiny_bart):
    llm = LLM(
        model=tiny_bart,
        compile=False,
        dtype="float32",
        kv_cache_gib=0.01,
        max_num_batched_tokens=32,
    )
    assert llm.config.task == "encdec"
    with pytest.raises(ValueError, match="encoder prompt has 129 tokens; it must have at most"):
        llm.generate({"prompt_token_ids": [5] * 129}, GREEDY)
    with pytest.raises(ValueError, match="encoder prompt is empty"):
        llm.generate({"encoder_prompt": [], "decoder_prompt": [4]}, GREEDY)
    with pytest.raises(ValueError, match="encoder-decoder"):
        llm.embed({"prompt_token_ids": [5, 6]})
    # A plain token list is the encoder input; the decoder starts from decoder_start_token_id.
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_bart_greedy(tiny_bart, [([5, 6, 7], [])], MAX_NEW)[0]
    assert out.prompt_token_ids == [2]
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.block_manager.num_usable_blocks


def test_bart_compiled_matches_hf_with_zero_recompiles_after_warmup(tiny_bart):
    cases = _cases(6, seed=2)
    want = hf_bart_greedy(tiny_bart, cases, MAX_NEW)
    llm = LLM(
        model=tiny_bart, dtype="float32", kv_cache_gib=0.01, block_size=4, max_num_batched_tokens=64
    )
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    assert _run_staggered(llm, cases) == want
    assert counters["stats"]["unique_graphs"] == graphs  # warm-up compiled every graph
    assert llm.llm_engine.runner.graphs_compiled == 2 * len(llm.llm_engine.runner.graph_sizes)
    assert sum(counters["graph_break"].values()) == breaks
