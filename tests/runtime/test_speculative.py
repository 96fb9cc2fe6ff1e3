"""Speculative decoding without a model: the config's checks, the n-gram proposer against a naive
search, the verifying sampler against the target distribution (a chi-square test that a wrong
acceptance rule fails), and the scheduler's draft plans (KV roll-back, no draft in the prefix
cache, no leaked block)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ember.runtime.batch import RunnerOutput, ScheduledRequest
from ember.runtime.block_manager import BlockManager
from ember.runtime.request import Request, SamplingParams
from ember.runtime.sampler import _draw, verify
from ember.runtime.scheduler import Scheduler
from ember.runtime.speculative import (
    Proposer,
    SpecState,
    SpeculativeConfig,
    StepCosts,
    ngram_propose,
)

# ---- config -----------------------------------------------------------------------------------


def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 4})  # fmt: skip
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.parse('{"model": "[ngram]", "num_speculative_tokens": 2}')
    assert c.method == "ngram" and c.model is None
    c = SpeculativeConfig.parse({"model": "/some/dir", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.model == "/some/dir"
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    "value,field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),  # fmt: skip
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "model"),
        ("{not json", "JSON"),
        ([1, 2], "dict"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)


# ---- the n-gram proposer --------------------------------------------------------------------


def naive_ngram(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The longest suffix n-gram (n_max down to n_min) with an earlier occurrence followed by
    at least one token; its most recent such occurrence's next k tokens."""
    num = len(tokens)
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        suffix = tokens[num - n :]
        for start in range(num - n - 1, -1, -1):  # occurrence tokens[start:start+n]
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_matches_naive_search():
    rng = random.Random(0)
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        n_min = rng.randrange(1, 4)
        n_max = n_min + rng.randrange(0, 4)
        k = rng.randrange(1, 6)
        got = ngram_propose(np.array(tokens, dtype=np.int64), n_min, n_max, k).tolist()
        assert got == naive_ngram(tokens, n_min, n_max, k), (trial, tokens, n_min, n_max, k)


def test_ngram_proposes_the_copy_of_a_quoted_passage():
    passage = list(range(100, 130))
    tokens = [1, 2, 3, *passage, 4, 5, *passage[:6]]
    got = ngram_propose(np.array(tokens), 3, 5, 4).tolist()
    assert got == passage[6:10]


def test_backoff_skips_doubling_steps_after_rejections():
    s = SpecState()
    pattern = []
    for _ in range(20):
        wants = s.num_drafts(4) > 0
        pattern.append(wants)
        if wants:
            s.record(1, 0)  # every draft rejected
    # Proposes, skips 1, proposes, skips 2, proposes, skips 4, ...
    assert pattern[:11] == [True, False, True, False, False, True] + [False] * 4 + [True]
    s.record(3, 2)
    assert s.backoff == 1 and (s.proposed, s.accepted) == (sum(pattern) + 3, 2)


def test_draft_length_weighs_expected_kept_tokens_against_their_cost():
    s = SpecState()  # prior rate 0.8: 0.8 ** 3 >= 1/2 > 0.8 ** 4
    assert s.num_drafts(8, value=11.0) == 3  # batch 1: a draft costs a tenth of a step
    # A batch of 8: expected kept tokens 0.8, 1.44, 1.95: 1.44 * 1.6 - 2 beats 0.8 * 1.6 - 1
    # and 1.95 * 1.6 - 3.
    assert s.num_drafts(8, value=1.6) == 2
    for _ in range(10):
        s.record(4, 4)  # everything kept
    assert s.rate > 0.95 and s.num_drafts(8, value=11.0) == 8 and s.num_drafts(3) == 3
    for _ in range(30):
        s.record(4, 1)  # one kept, then a rejection: rate -> 1/2
    assert 0.48 < s.rate < 0.52
    assert s.num_drafts(8, value=11.0) == 1  # 0.5 ** 2 < 1/2
    assert s.num_drafts(8, value=2.3) == 1  # 0.5 * 2.3 - 1 > 0
    # Not worth one draft: no drafts, a pause, then a probe with one.
    assert s.num_drafts(8, value=1.5) == 0
    assert s.skip == 1 and s.num_drafts(8, value=1.5) == 0
    assert s.num_drafts(8, value=1.5) == 1


def test_step_costs_fit_a_line_through_decode_steps():
    costs = StepCosts()
    t0, t1 = costs.fit()
    assert t1 / t0 == pytest.approx(0.1)  # the prior before any step
    for _ in range(3):
        for tokens in (1, 2, 5, 9):
            costs.observe(tokens, 5.0 + 0.5 * tokens)
    t0, t1 = costs.fit()
    assert (t0, t1) == (pytest.approx(5.0), pytest.approx(0.5))
    assert costs.token_value(1) == pytest.approx(11.0)
    assert costs.token_value(8) == pytest.approx(2.25)
    one_size = StepCosts()
    for _ in range(5):
        one_size.observe(1, 6.6)
    t0, t1 = one_size.fit()
    assert t0 + t1 == pytest.approx(6.6) and t1 / t0 == pytest.approx(0.1)


def chisquare_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square goodness-of-fit p-value (len - 1 degrees of freedom)."""
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


# ---- the verifying sampler --------------------------------------------------------------------


def _row(params: SamplingParams, seed: int, output=()) -> ScheduledRequest:
    return ScheduledRequest(
        "r", 0, (1,), (1,), True, params, torch.Generator().manual_seed(seed), (1,), output
    )


def test_verify_greedy_keeps_drafts_up_to_the_first_disagreement():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 4, 6, 1]):
        logits[row, best] = 5.0
    rows = [_row(SamplingParams(temperature=0.0), 0)] * 4
    for drafts, want in [
        ((3, 4, 6), [3, 4, 6, 1]),  # all kept, then the bonus token
        ((3, 5, 6), [3, 4]),  # the second draft rejected: the target's own token
        ((2, 4, 6), [3]),
    ]:
        tokens, _ = verify(logits, rows, [(0, drafts)])
        assert tokens == [want]


def _first_token_counts(p: torch.Tensor, draft: int, trials: int, wrong: bool = False):
    """How often each token comes out first when verifying `draft` against distribution `p`
    (as logits of a temperature-1 request), over `trials` seeds. `wrong`: a broken rule that
    redraws from p itself after a rejection (d keeps extra mass)."""
    logits = torch.log(p)[None].repeat(2, 1)
    counts = np.zeros(len(p))
    for seed in range(trials):
        row = _row(SamplingParams(temperature=1.0), seed)
        if wrong:
            g = row.generator
            token = draft if float(torch.rand((), generator=g)) < p[draft] else _draw(p, g)
        else:
            token = verify(logits, [row, row], [(0, (draft,))])[0][0][0]
        counts[token] += 1
    return counts


@pytest.mark.parametrize("draft", [0, 2])
def test_verify_sampling_emits_the_target_distribution(draft):
    p = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    trials = 4000
    counts = _first_token_counts(p, draft, trials)
    assert chisquare_pvalue(counts, p.numpy() * trials) > 1e-3
    # The same test has the power to reject a rule that is wrong by that much.
    wrong = _first_token_counts(p, draft, trials, wrong=True)
    assert chisquare_pvalue(wrong, p.numpy() * trials) < 1e-6


def test_verify_logprobs_are_the_targets_rows():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    drafts = tuple(int(t) for t in logits[:2].argmax(-1))
    rows = [_row(SamplingParams(temperature=0.0, logprobs=2), 0)] * 3
    tokens, lps = verify(logits, rows, [(0, drafts)])
    assert tokens[0] == [*drafts, int(logits[2].argmax())]
    for j, entry in enumerate(lps[0]):
        want = torch.log_softmax(logits[j], -1)
        assert entry.token_ids[0] == tokens[0][j]
        assert entry.logprobs[0] == pytest.approx(float(want[tokens[0][j]]), abs=1e-6)


# ---- scheduling drafts ------------------------------------------------------------------------


class FixedProposer(Proposer):
    """Proposes `draft` (cut to the room left) for every request."""

    def __init__(self, draft: tuple[int, ...]) -> None:
        self.num_speculative_tokens = len(draft)
        self.draft = draft

    def propose(self, wanted):
        return {r.request_id: self.draft[:room] for r, room in wanted}


def _request(rid: str, prompt: list[int], max_tokens: int = 12) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    # A request that has kept every draft so far: it proposes as many as there is room for.
    spec = SpecState(kept=1e6)
    return Request(rid, prompt, params, None, max_tokens, torch.Generator(), spec=spec)


def test_scheduler_rolls_back_rejected_drafts_without_leaks_or_cached_drafts():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 32, 64, proposer=FixedProposer((90, 91, 92, 93, 94, 95)))
    sched.add_request(_request("a", [1, 2, 3, 4, 5, 6, 7]))
    plan = sched.schedule()  # the prefill: no drafts
    assert plan.requests[0].spec_token_ids == ()
    sched.update(plan, RunnerOutput({"a": 8}, {}))
    plan = sched.schedule()  # a decode verifying 6 drafts: 7 tokens from position 7
    item = plan.requests[0]
    assert item.token_ids == (8, 90, 91, 92, 93, 94, 95) and item.num_computed_tokens == 7
    assert len(bm.block_ids("a")) == 4  # positions 0..13
    # Two drafts kept, then the target's own token 50.
    sched.update(plan, RunnerOutput({"a": 50}, {}, accepted={"a": (90, 91)}))
    r = sched.requests["a"]
    assert r.output_token_ids == [8, 90, 91, 50]
    assert r.num_computed_tokens == 10  # 8, 90, 91 computed; 50 is next step's input
    assert len(bm.block_ids("a")) == 3  # positions 0..10: the rejected drafts' block freed
    bm.assert_invariants()
    # Only full blocks of real tokens were ever hashed: 0..3 and 4..7.
    cached = {bm._block_hash[b] for b in bm.block_ids("a")} - {None}
    assert len(cached) == 2
    # The next step's drafts are cut to the room max_tokens leaves (12 - 4 - 1 = 7 > 6).
    plan = sched.schedule()
    assert plan.requests[0].token_ids[0] == 50 and len(plan.requests[0].spec_token_ids) == 6
    sched.update(plan, RunnerOutput({"a": 60}, {}, accepted={"a": (90, 91, 92, 93, 94, 95)}))
    assert r.output_token_ids[4:] == [90, 91, 92, 93, 94, 95, 60]
    assert r.num_computed_tokens == 17
    plan = sched.schedule()  # 11 tokens out of 12: no room for a draft
    assert plan.requests[0].spec_token_ids == ()
    sched.update(plan, RunnerOutput({"a": 61}, {}))
    assert "a" not in sched.requests
    bm.assert_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_scheduler_stops_mid_draft_and_drops_the_rest():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 32, 64, proposer=FixedProposer((90, 91, 92)))
    request = _request("a", [1, 2, 3])
    request.params.stop_token_ids = [91]
    sched.add_request(request)
    plan = sched.schedule()
    sched.update(plan, RunnerOutput({"a": 8}, {}))
    plan = sched.schedule()
    _, finished = sched.update(plan, RunnerOutput({"a": 7}, {}, accepted={"a": (90, 91, 92)}))
    assert finished == [request] and request.output_token_ids == [8, 90, 91]
    assert request.stop_reason == 91
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_drafts_never_preempt_and_fall_back_to_one_token():
    bm = BlockManager(4, 4)  # 3 usable blocks: 12 positions
    sched = Scheduler(bm, 8, 32, 12, proposer=FixedProposer((90, 91, 92, 93, 94, 95)))
    sched.add_request(_request("a", [1, 2, 3, 4]))
    sched.add_request(_request("b", [1, 2, 3]))
    plan = sched.schedule()
    sched.update(plan, RunnerOutput({"a": 9, "b": 9}, {}))
    assert bm.num_free_blocks == 1
    # Drafts would need 2 more blocks for each: both decode one token, nobody is preempted.
    plan = sched.schedule()
    assert [r.token_ids for r in plan.requests] == [(9,), (9,)]
    assert plan.preempted_ids == ()
    bm.assert_invariants()


def test_a_failing_proposer_leaves_the_step_without_drafts():
    class Broken(FixedProposer):
        forgotten: list[str] = []

        def propose(self, wanted):
            raise MemoryError("draft cache")

        def forget(self, request_id):
            self.forgotten.append(request_id)

    bm = BlockManager(64, 4)
    proposer = Broken((90, 91))
    sched = Scheduler(bm, 8, 32, 64, proposer=proposer)
    sched.add_request(_request("a", [1, 2, 3]))
    sched.update(sched.schedule(), RunnerOutput({"a": 8}, {}))
    plan = sched.schedule()
    assert plan.requests[0].token_ids == (8,) and proposer.forgotten == ["a"]
