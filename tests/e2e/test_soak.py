"""Soak: 300 requests with random lengths, shared prefixes, n > 1 and aborts on a cache small
enough to force preemption; every surviving request equals its solo greedy run."""

from __future__ import annotations

import random

from ember import LLM, SamplingParams
from tests.conftest import drive_random, gib_for_blocks, make_prompts


def test_soak_300_requests_with_aborts_and_preemption(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    kw = dict(
        compile=False,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=24,
        max_num_seqs=16,
    )
    llm = LLM(model=d, kv_cache_gib=gib_for_blocks(d, 40, 4), **kw)
    engine = llm.llm_engine
    rng = random.Random(1)
    prefixes = make_prompts(3, seed=30, low=8, high=20)
    tails = make_prompts(300, seed=31, low=1, high=30)
    prompts = [(rng.choice(prefixes) if rng.random() < 0.5 else []) + t for t in tails]
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 20),
            temperature=0.0,
            ignore_eos=True,
            n=2 if rng.random() < 0.1 else 1,
        )
        for _ in prompts
    ]
    done, aborted, _ = drive_random(
        engine,
        prompts,
        params,
        rng,
        lambda: rng.randint(0, 4),
        abort_prob=0.1,
        check=engine.block_manager.assert_invariants,
    )
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "blocks leaked"
    assert engine.scheduler.num_preemptions > 10
    assert len(aborted) > 10 and len(done) + len(aborted) == 300

    solo = LLM(model=d, kv_cache_gib=0.01, **kw)
    mismatches = 0
    for rid, outputs in done.items():
        i = int(rid)
        want = solo.generate({"prompt_token_ids": prompts[i]}, params[i], use_tqdm=False)[0]
        mismatches += outputs != [c.token_ids for c in want.outputs]
    assert mismatches == 0
    print(
        f"soak: requests=300 finished={len(done)} aborted={len(aborted)} "
        f"preemptions={engine.scheduler.num_preemptions} mismatches={mismatches}"
    )
