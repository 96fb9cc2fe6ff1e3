"""Hypothesis state machine over Scheduler + BlockManager with a tiny cache. Pure Python.

A shadow KV cache stands in for the model: each slot holds the token prefix whose K/V it
contains. A step writes the slots of its tokens, then every scheduled request must read its
whole prefix back from its block table (prefix-cache hits included). A failing step writes a
random part of its slots, then is rolled back; later steps must never read what it left."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ember.runtime.batch import RunnerOutput, StepPlan
from ember.runtime.block_manager import BlockManager
from ember.runtime.request import Request, RequestStatus, SamplingParams
from ember.runtime.scheduler import Scheduler

BLOCK_SIZE = 2
MAX_MODEL_LEN = 16
NUM_BLOCKS = 12  # 11 usable: room for fewer than two max-length requests
SHARED = [11, 12, 13, 14, 15, 16, 17]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.sched = Scheduler(
            self.bm, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=MAX_MODEL_LEN
        )
        self.count = 0
        self.finished: list[Request] = []
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix

    def _write(self, plan: StepPlan, keep: list[bool] | None = None) -> None:
        """Write the K/V of the plan's tokens (only the slots where `keep` is True)."""
        i = 0
        for r in plan.requests:
            tokens = self.sched.requests[r.request_id].all_token_ids
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens):
                if keep is None or keep[i % len(keep)]:
                    slot = (r.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                    self.slots[slot] = tuple(tokens[: pos + 1])
                i += 1

    def _check_reads(self, plan: StepPlan) -> None:
        """Every request of the step attends to exactly its own prefix."""
        for r in plan.requests:
            tokens = self.sched.requests[r.request_id].all_token_ids
            for pos in range(r.num_computed_tokens + r.num_new_tokens):
                slot = (r.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                assert self.slots.get(slot) == tuple(tokens[: pos + 1]), (
                    f"{r.request_id} reads stale K/V at position {pos}"
                )

    @rule(
        length=st.integers(1, 12),
        shared=st.booleans(),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 8),
        data=st.data(),
    )
    def add(self, length: int, shared: bool, n: int, max_tokens: int, data: st.DataObject) -> None:
        tail = data.draw(st.lists(st.integers(3, 40), min_size=length, max_size=length))
        prompt = (SHARED + tail)[: MAX_MODEL_LEN - 1] if shared else tail
        for _ in range(n):  # parallel samples: same prompt, own request
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            budget = min(max_tokens, MAX_MODEL_LEN - len(prompt))
            self.sched.add_request(
                Request(f"r{self.count}", prompt, params, 2, budget, torch.Generator())
            )
            self.count += 1

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    @rule(tokens=st.lists(st.integers(2, 40), min_size=4, max_size=4))
    def step(self, tokens: list[int]) -> None:
        plan = self.sched.schedule()
        assert plan.num_tokens <= 6 and plan.num_seqs <= 4
        ids = [r.request_id for r in plan.requests]
        assert len(set(ids)) == len(ids)
        for r in plan.requests:
            assert len(r.block_ids) * BLOCK_SIZE >= r.num_computed_tokens + r.num_new_tokens
        self._write(plan)
        self._check_reads(plan)
        sampled = {r.request_id: tokens[i] for i, r in enumerate(plan.requests) if r.sample}
        _, finished = self.sched.update(plan, RunnerOutput(sampled, {}))
        self.finished.extend(finished)

    @rule(keep=st.lists(st.booleans(), min_size=1, max_size=6))
    def failed_step(self, keep: list[bool]) -> None:
        """The model raises part-way through a step: some slots were written, then rollback."""
        plan = self.sched.schedule()
        self._write(plan, keep)
        self.sched.rollback(plan)
        for r in plan.requests:
            request = self.sched.requests[r.request_id]
            assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0

    @invariant()
    def pool_is_consistent(self) -> None:
        self.bm.assert_invariants()
        for rid, req in self.sched.requests.items():
            owned = self.bm.block_ids(rid)
            if req.status == RequestStatus.RUNNING:
                assert len(owned) * BLOCK_SIZE >= req.num_computed_tokens
            else:
                assert owned == [] and req.num_computed_tokens == 0

    def teardown(self) -> None:
        for _ in range(500):
            if not self.sched.has_unfinished_requests():
                break
            self.step([5, 6, 7, 8])
        assert not self.sched.has_unfinished_requests(), "requests left after draining"
        assert self.bm.num_free_blocks == NUM_BLOCKS - 1
        for r in self.finished:
            assert len(r.output_token_ids) <= r.max_tokens


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
