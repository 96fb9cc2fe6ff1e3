"""Per-step plans (what to run) and runner results. Plain Python, immutable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.runtime.request import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    `token_ids` are the `num_new_tokens` tokens computed this step, starting at position
    `num_computed_tokens`; `block_ids` is the request's whole block table. `sample` is True when
    this step reaches the end of the request's tokens, so a new token is sampled.
    """

    request_id: str
    num_computed_tokens: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    sample: bool
    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    # Encoder-decoder only: the encoder input (set on the step that must run the encoder),
    # the blocks holding the cross-attention K/V, and the encoder length.
    encoder_token_ids: tuple[int, ...] = ()
    cross_block_ids: tuple[int, ...] = ()
    num_encoder_tokens: int = 0
    lora_id: int | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """Everything one engine step computes: decodes first, then prefill chunks."""

    requests: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def num_seqs(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of one generated position: the sampled token and the top-N, with ranks."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RunnerOutput:
    """Sampled token (and optional logprobs) per request that sampled this step."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
