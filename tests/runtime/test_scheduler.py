"""Scheduler: budgets, chunking, decode-first order, preemption, prefix hits. No model."""

from __future__ import annotations

import random

import torch

from ember.runtime.batch import RunnerOutput, StepPlan
from ember.runtime.block_manager import BlockManager
from ember.runtime.request import Request, RequestStatus, SamplingParams
from ember.runtime.scheduler import Scheduler


def _request(rid: str, prompt: list[int], max_tokens: int = 4, eos: int | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, prompt, params, eos, max_tokens, torch.Generator())


def _fake_output(plan: StepPlan, token: int = 7) -> RunnerOutput:
    return RunnerOutput({r.request_id: token for r in plan.requests if r.sample}, {})


def _scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=64):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, budget, max_model_len), bm


def test_scheduler_chunks_long_prompt_under_token_budget():
    sched, bm = _scheduler(budget=8)
    sched.add_request(_request("a", list(range(1, 21))))
    sizes = []
    while sched.requests["a"].num_computed_tokens < 20:
        plan = sched.schedule()
        assert plan.num_tokens <= 8
        sizes.append(plan.requests[0].num_new_tokens)
        sched.update(plan, _fake_output(plan))
        bm.assert_invariants()
    assert sizes == [8, 8, 4]
    assert sched.requests["a"].output_token_ids == [7]


def test_scheduler_puts_decodes_before_prefill_chunks():
    sched, _ = _scheduler(budget=10)
    sched.add_request(_request("a", [1, 2, 3]))
    plan = sched.schedule()
    sched.update(plan, _fake_output(plan))
    sched.add_request(_request("b", list(range(1, 30))))
    plan = sched.schedule()
    sched.update(plan, _fake_output(plan))
    plan = sched.schedule()  # a decodes, b continues its prefill
    assert [r.request_id for r in plan.requests] == ["a", "b"]
    assert plan.requests[0].num_new_tokens == 1
    assert plan.num_tokens == 10


def test_scheduler_respects_max_num_seqs():
    sched, _ = _scheduler(max_num_seqs=2, budget=64)
    for i in range(4):
        sched.add_request(_request(str(i), [1, 2, i + 3]))
    plan = sched.schedule()
    assert plan.num_seqs == 2


def test_scheduler_preempts_newest_and_recomputes():
    sched, bm = _scheduler(num_blocks=7, block_size=4, budget=64, max_model_len=24)
    sched.add_request(_request("old", list(range(1, 9)), max_tokens=12))
    sched.add_request(_request("new", list(range(20, 28)), max_tokens=12))
    seen_preempt = False
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        plan = sched.schedule()
        seen_preempt |= "new" in plan.preempted_ids
        assert "old" not in plan.preempted_ids
        sched.update(plan, _fake_output(plan))
        bm.assert_invariants()
    assert seen_preempt
    assert not sched.has_unfinished_requests()
    assert bm.num_free_blocks == 6


def test_scheduler_prefix_hit_skips_computation():
    sched, bm = _scheduler(budget=64)
    prompt = list(range(1, 18))
    sched.add_request(_request("a", prompt))
    plan = sched.schedule()
    sched.update(plan, _fake_output(plan))
    sched.add_request(_request("b", prompt + [99]))
    plan = sched.schedule()
    b = next(r for r in plan.requests if r.request_id == "b")
    assert b.num_computed_tokens == 16 and b.num_new_tokens == 2
    assert sched.requests["b"].num_cached_tokens == 16


def test_scheduler_embedding_blocks_are_not_cached_and_are_reused_first():
    sched, bm = _scheduler(num_blocks=20, budget=64)
    prompt = list(range(1, 18))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    sched.add_request(Request("e", prompt, params, None, 1, torch.Generator(), pool=True))
    plan = sched.schedule()
    used = set(bm.block_ids("e"))
    assert len(used) == 5
    sched.update(plan, RunnerOutput({}, {}, pooled={"e": [0.0]}))
    assert bm.block_ids("e") == [] and bm.match_prefix("x", prompt) == []
    # The next prompt gets the embedding's warm blocks, not never-used ones.
    sched.add_request(_request("a", list(range(50, 67))))
    sched.schedule()
    assert set(bm.block_ids("a")) == used
    bm.assert_invariants()


def test_scheduler_abort_frees_blocks_in_every_state():
    sched, bm = _scheduler(num_blocks=9, block_size=4, budget=6, max_model_len=32)
    sched.add_request(_request("run", list(range(1, 10))))
    sched.add_request(_request("wait", list(range(1, 5))))
    plan = sched.schedule()  # "run" mid-prefill
    sched.update(plan, _fake_output(plan))
    for rid in ["run", "wait"]:
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        bm.assert_invariants()
    assert bm.num_free_blocks == 8 and not sched.has_unfinished_requests()


def test_scheduler_random_workload_keeps_invariants_and_drains():
    rng = random.Random(0)
    sched, bm = _scheduler(num_blocks=24, block_size=4, max_num_seqs=6, budget=12, max_model_len=40)
    shared = [rng.randrange(1, 50) for _ in range(12)]
    n = 0
    for step in range(400):
        if n < 40 and rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(1, 50) for _ in range(rng.randint(1, 14))
            ]
            sched.add_request(_request(f"r{n}", prompt, max_tokens=rng.randint(1, 10), eos=3))
            n += 1
        if sched.requests and rng.random() < 0.05:
            sched.finish_request(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
        plan = sched.schedule()
        assert plan.num_tokens <= 12 and plan.num_seqs <= 6
        sched.update(
            plan,
            RunnerOutput(
                {r.request_id: rng.randrange(1, 50) for r in plan.requests if r.sample}, {}
            ),
        )
        bm.assert_invariants()
        if n == 40 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    assert bm.num_free_blocks == 23


def test_scheduler_abort_preempted_and_decoding_requests_frees_everything():
    sched, bm = _scheduler(num_blocks=7, block_size=4, budget=64, max_model_len=24)
    sched.add_request(_request("old", list(range(1, 9)), max_tokens=12))
    sched.add_request(_request("new", list(range(20, 28)), max_tokens=12))
    while sched.requests["new"].status != RequestStatus.PREEMPTED:
        plan = sched.schedule()
        sched.update(plan, _fake_output(plan))
    assert sched.requests["old"].status == RequestStatus.RUNNING
    assert len(sched.requests["old"].output_token_ids) > 0  # mid-decode
    sched.finish_request("new", RequestStatus.FINISHED_ABORTED)  # preempted, waiting again
    bm.assert_invariants()
    sched.finish_request("old", RequestStatus.FINISHED_ABORTED)  # mid-decode
    bm.assert_invariants()
    assert bm.num_free_blocks == 6 and not sched.has_unfinished_requests()
