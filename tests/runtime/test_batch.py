"""ForwardBatch building: the decode-only fast path (persistent `DecodeBuffers`) lays out exactly
what the general path does, across reused shapes."""

from __future__ import annotations

import random

import torch

from ember.runtime.batch import DecodeBuffers, ScheduledRequest, StepPlan, build_forward_batch
from ember.runtime.request import SamplingParams


def _decodes(rng: random.Random, n: int, block_size: int, max_blocks: int) -> StepPlan:
    reqs = []
    for i in range(n):
        computed = rng.randrange(0, block_size * max_blocks)
        blocks = tuple(rng.sample(range(1, 500), computed // block_size + 1))
        tok = (rng.randrange(0, 1000),)
        reqs.append(ScheduledRequest(f"r{i}", computed, tok, blocks, True))
    return StepPlan(tuple(reqs))


def _tensors(batch):
    m = batch.attn_metadata
    return [
        batch.input_ids,
        batch.positions,
        batch.logits_indices,
        m.slot_mapping,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
    ]


def test_decode_buffers_match_the_general_path_across_reused_shapes():
    rng = random.Random(0)
    buffers = DecodeBuffers()
    block_size, max_blocks = 4, 6
    # Repeated shapes: a later, shorter request must not see an earlier one's table entries.
    for n, tokens, seqs in [(1, 1, 2), (3, 4, 4), (1, 1, 2), (3, 3, 3), (2, 4, 4), (3, 4, 4)]:
        plan = _decodes(rng, n, block_size, max_blocks)
        for lora in (None, {7: 0}):
            args = (plan, block_size, max_blocks, tokens, seqs, 0, lora)
            want = build_forward_batch(*args)
            got = build_forward_batch(*args, buffers=buffers)
            for a, b in zip(_tensors(got), _tensors(want), strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
            assert (got.lora_slots is None) == (lora is None)
            if lora is not None:
                assert torch.equal(got.lora_slots, want.lora_slots)
            assert got.prompt_rows == want.prompt_rows == ()


def test_prefills_and_prompt_logprobs_take_the_general_path():
    buffers = DecodeBuffers()
    prefill = StepPlan((ScheduledRequest("p", 0, (5, 6, 7), (3,), True),))
    batch = build_forward_batch(prefill, 4, 2, 3, 2, buffers=buffers)
    assert batch.input_ids.tolist() == [5, 6, 7] and not buffers._shapes
    lp = SamplingParams(prompt_logprobs=1)
    one = StepPlan((ScheduledRequest("q", 0, (5,), (3,), True, lp, prompt_token_ids=(5, 6)),))
    build_forward_batch(one, 4, 2, 1, 2, buffers=buffers)
    assert not buffers._shapes
