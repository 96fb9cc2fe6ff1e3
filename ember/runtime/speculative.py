"""Speculative decoding, vLLM's `speculative_config`: a proposer guesses each decoding request's
next k tokens, the target model scores them as one (k+1)-token chunk of the ordinary mixed step,
and the sampler keeps the longest prefix the target agrees with, plus one token of its own.

A batch-1 decode step reads every weight to make one token; a chunk of k+1 tokens reads them
once too, so every accepted draft token is a token below the bandwidth floor.

Methods:
- `ngram` (prompt lookup): the continuation of the longest n-gram (between `prompt_lookup_min`
  and `prompt_lookup_max` tokens) that ends the request's tokens and also occurs earlier in
  them (prompt and output), its most recent occurrence; host-side, no model.
- `draft_model`: a smaller model with the same vocabulary, run by the same machinery (its own
  compiled graphs and paged KV cache; `ember.runtime.draft`), proposing k tokens greedily.

Exactness: greedy requests keep a draft token only where it equals the target's argmax, so
their output is the non-speculative output token for token. Sampled requests use rejection
sampling with a point-mass proposal (both proposers are deterministic): draft d is kept with
probability p(d) under the target's processed distribution p (temperature, top-k/p, min-p,
penalties and controls at that position), else a token is drawn from p with d removed; the
emitted token is then distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023).

How many tokens to propose (`SpecState`, `StepCosts`): each request estimates how often its
drafts are kept, the engine times its decode steps against their token counts, and each step a
request proposes the number of drafts (at most `num_speculative_tokens`) whose expected kept
tokens outweigh their cost at the current batch size. A step whose drafts were all rejected
doubles the number of decode steps the request then skips proposing (1, 2, 4 ... up to 16), so
a request with nothing to copy soon runs plain one-token decodes (its static graph) and only
probes now and then; a kept draft resets that.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 64
# Longest run of plain decode steps a request skips proposing after rejected drafts.
MAX_BACKOFF_STEPS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """The checked `speculative_config` (vLLM's keys and defaults: without `prompt_lookup_*`
    ngram matches exactly 5 tokens; with one of them, both are that value)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    model: str | None = None

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A config from a dict, a JSON string (the CLI's `--speculative-config`), an instance
        or None. Raises ValueError naming the field for anything wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        method, model = value.get("method"), value.get("model")
        if method is None:  # vLLM infers it from the model: "[ngram]" or a draft checkpoint
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if method == "ngram":
            if model not in (None, "ngram", "[ngram]"):
                raise ValueError(f"speculative_config.model={model!r}: method ngram takes no model")
            model = None
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
                    raise ValueError(
                        f"speculative_config.{name} must be an integer in [1, 1024], got {n!r}"
                    )
            if lo > hi:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}"
                )
        else:
            if not isinstance(model, str) or not model:
                raise ValueError(
                    "speculative_config.model must name the draft model (a checkpoint "
                    f"directory or GGUF file) for method draft_model, got {model!r}"
                )
            if lo is not None or hi is not None:
                raise ValueError(
                    "speculative_config.prompt_lookup_min/max apply to method ngram only"
                )
            lo = hi = 5
        return cls(method, k, hi, lo, model)


def ngram_propose(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> np.ndarray:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
    of `tokens` (int64) of at least `n_min` and at most `n_max` tokens; empty if none occurs.

    Vectorised: the positions holding the last token are the candidates, and each extra suffix
    token keeps the candidates that match it too, so a 4,000-token sequence costs a few
    passes over small arrays (tens of microseconds), not a Python loop over n-grams.
    """
    num = len(tokens)
    if num < 2 or k < 1:
        return tokens[:0]
    # An occurrence must end before the last token and have at least one token after it.
    cands = np.flatnonzero(tokens[: num - 1] == tokens[num - 1])
    if cands.size == 0:
        return tokens[:0]
    length = 1  # every candidate matches the last `length` tokens of the suffix
    best = cands if n_min <= 1 else cands[:0]
    while length < n_max:
        cands = cands[cands >= length]  # room for one more token before the match
        if cands.size == 0:
            break
        cands = cands[tokens[cands - length] == tokens[num - 1 - length]]
        if cands.size == 0:
            break
        length += 1
        if length >= n_min:
            best = cands
    if best.size == 0:
        return tokens[:0]
    start = int(best[-1]) + 1
    return tokens[start : start + k]


# A request proposes draft j only while its estimated chance of reaching and keeping it,
# rate ** j, is at least this. Measured on W-SPEC (SmolLM2-135M Q4_1, k = 8, Xeon, 2 cores):
# 0 (always k) / 0.3 / 0.5 gave batch-1 speed-ups of 3.29 / 3.78 / 3.67x (quote), 1.34 / 1.21 /
# 1.19x (json), 1.63 / 1.38 / 1.44x (free), and at batch 8 1.39 / 1.77 / 1.82x, 0.75 / 1.05 /
# 1.05x and 0.85 / 1.01 / 1.07x: without a threshold, batched steps pay for drafts they lose.
MIN_DRAFT_CHANCE = 0.5
# How fast the acceptance estimate forgets: each step's counts weigh 1, older ones decay by this.
RATE_DECAY = 0.8
# How fast the step-cost fit forgets older decode steps.
COST_DECAY = 0.95
# Extra time of one more token in a decode step, relative to the one-token step, until decode
# steps of several sizes have been timed (this Xeon, SmolLM2-135M Q4_1: 0.6 of 6.1 ms).
PRIOR_TOKEN_COST = 0.1


@dataclass
class StepCosts:
    """Decode-step time against its token count, t = t0 + t1 * tokens: a least-squares line
    through recent decode-only steps (`observe`), older ones decaying by `COST_DECAY`."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = COST_DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + num_tokens, d * self.sy + seconds
        self.sxx = d * self.sxx + num_tokens * num_tokens
        self.sxy = d * self.sxy + num_tokens * seconds

    def fit(self) -> tuple[float, float]:
        """(t0, t1); the prior's proportions (t1 = `PRIOR_TOKEN_COST` t0) before steps of
        different sizes were seen."""
        if self.n < 3:
            return 1.0, PRIOR_TOKEN_COST
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var < 0.25:  # all of (nearly) one size
            t0 = my / (1 + PRIOR_TOKEN_COST * mx)
            return t0, PRIOR_TOKEN_COST * t0
        t1 = max((self.sxy / self.n - mx * my) / var, 1e-3 * my)
        return max(my - t1 * mx, t1), t1

    def token_value(self, num_decodes: int) -> float:
        """What one more token of a request is worth in draft tokens' cost: a plain step's
        time per token, (t0 + t1 B) / B for B decoding requests, over t1."""
        t0, t1 = self.fit()
        b = max(num_decodes, 1)
        return (t0 + t1 * b) / b / t1


@dataclass
class SpecState:
    """One request's proposal schedule.

    `rate` estimates the chance that a draft token is kept given that the one before it was
    (a geometric model: the kept drafts of a step are successes, a rejection one failure),
    from decayed counts with a prior of 2 kept to 0.5 rejected (rate 0.8 at the start).

    Each step the request proposes the drafts j with rate ** j >= `MIN_DRAFT_CHANCE`, and of
    those at most the k that maximise the expected gain (E[tokens kept] * value - k), where
    E[tokens kept] = rate + rate^2 + ... + rate^k and `value` is what a token is worth in
    draft-token costs (`StepCosts.token_value`): at batch 1 a draft token costs a tenth of a
    step and the chance decides; in a batch of 8, drafts compete with the other requests'
    compute and k shrinks or is 0. (The gain alone, without the chance threshold, measured
    worse here: quote 3.39 / 1.27x at batch 1 / 8 against 3.90 / 1.77x, since the cost fit
    values a token high enough at batch 1 to draft 8 at a 70% rate.) When no k gains, and after a
    step whose drafts were all rejected, the request skips proposing for `backoff` steps
    (doubling up to `MAX_BACKOFF_STEPS`), then probes with at least one draft; a kept draft
    resets that. `proposed` / `accepted` count draft tokens over the request's life.
    """

    skip: int = 0
    backoff: int = 1
    probe: bool = False
    kept: float = 2.0
    rejected: float = 0.5
    proposed: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def num_drafts(self, limit: int, value: float = 1 / PRIOR_TOKEN_COST + 1) -> int:
        """How many draft tokens to propose this step (0: none), at most `limit`."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        rate, reach, kept, best, gain = self.rate, 1.0, 0.0, 0, 0.0
        for k in range(1, limit + 1):
            reach *= rate
            kept += reach
            if k > 1 and reach < MIN_DRAFT_CHANCE:
                break
            if kept * value - k > gain:
                best, gain = k, kept * value - k
        if self.probe:
            self.probe = False
            return max(best, 1)
        if best == 0:
            self._pause()
        return best

    def _pause(self) -> None:
        self.skip, self.probe = self.backoff, True
        self.backoff = min(2 * self.backoff, MAX_BACKOFF_STEPS)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.kept = RATE_DECAY * self.kept + accepted
        self.rejected = RATE_DECAY * self.rejected + (accepted < proposed)
        if accepted:
            self.backoff = 1
        elif proposed:
            self._pause()


class Proposer:
    """Proposes draft tokens for a step's decoding requests (`Scheduler._propose`)."""

    num_speculative_tokens: int

    def propose(self, wanted: list[tuple[Any, int]]) -> dict[str, tuple[int, ...]]:
        """request id -> up to `room` draft tokens, for each `(Request, room)` of `wanted`
        (requests with nothing to propose may be left out)."""
        raise NotImplementedError

    def forget(self, request_id: str) -> None:
        """The request has finished: drop what the proposer keeps for it."""

    def close(self) -> None:
        """Release the proposer's resources (a draft model's engine)."""


class NgramProposer(Proposer):
    """Prompt lookup (`ngram_propose`) over each request's own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, wanted: list[tuple[Any, int]]) -> dict[str, tuple[int, ...]]:
        drafts = {}
        for request, room in wanted:
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            draft = ngram_propose(tokens, self.n_min, self.n_max, room)
            if draft.size:
                drafts[request.request_id] = tuple(draft.tolist())
        return drafts
