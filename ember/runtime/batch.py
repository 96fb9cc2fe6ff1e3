"""What one step runs: `StepPlan` (plain Python, built by the scheduler or by the runner's warm-up)
and `ForwardBatch` (the tensors a forward consumes), with the one function that builds the
latter from the former (`build_forward_batch`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ember.attention.metadata import (
    NULL_BLOCK,
    AttentionMetadata,
    build_attention_metadata,
    padding_slots,
    slot_of,
)
from ember.runtime.logits import LogitsControls
from ember.runtime.multimodal import ImageInputs
from ember.runtime.request import SamplingParams
from ember.runtime.structured import GrammarState


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    `token_ids` are the `num_new_tokens` tokens computed this step, starting at position
    `num_computed_tokens`; `block_ids` is the request's whole block table. `sample` is True when
    this step reaches the end of the request's tokens, so a new token is sampled; `pool` when
    the request is an embedding (its whole prompt runs in this step and is pooled).
    `prompt_token_ids`/`output_token_ids`/`block_ids` are read-only views of the request's own
    lists (valid for this step; never copied per step), for the sampler's penalties.
    """

    request_id: str
    num_computed_tokens: int
    token_ids: tuple[int, ...]
    block_ids: Sequence[int]
    sample: bool
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Encoder-decoder only: the encoder input (set on the step that must run the encoder),
    # the blocks holding the cross-attention K/V, and the encoder length.
    encoder_token_ids: tuple[int, ...] = ()
    cross_block_ids: Sequence[int] = ()
    num_encoder_tokens: int = 0
    # Vision-language models: the request's images (their ranges, every step) and whether this
    # step runs them through the vision tower (the step that admits the request).
    images: ImageInputs | None = None
    encode_images: bool = False
    lora_id: int | None = None
    pool: bool = False
    controls: LogitsControls | None = None  # the request's logits controls, if any
    grammar: GrammarState | None = None  # structured outputs: the request's matcher
    # Speculative decoding: the draft tokens at the end of `token_ids` (after the request's
    # last real token), verified this step.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """Everything one step computes: decodes first, then prefill chunks (and embeddings).

    Steps that are not engine steps are plans too: an encoder pass (`encoder_plan`), and the
    warm-up's dummy steps (`warmup_plan`).
    """

    requests: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    def select(self, pool: bool) -> StepPlan:
        """The sub-plan of requests whose `pool` flag equals `pool`."""
        return StepPlan(tuple(r for r in self.requests if r.pool == pool))


def encoder_plan(plan: StepPlan) -> StepPlan:
    """The encoder pass of the requests admitted in `plan`: each request's whole encoder input,
    its scratch K/V written into its own cross blocks."""
    return StepPlan(
        tuple(
            ScheduledRequest(r.request_id, 0, r.encoder_token_ids, r.cross_block_ids, False)
            for r in plan.requests
            if r.encoder_token_ids
        )
    )


def warmup_plan(num_tokens: int, chunk: int, block_size: int, cross: bool = False) -> StepPlan:
    """Dummy prefills totalling `num_tokens`, each at most `chunk` tokens, all in the null block
    (which real requests never read). `cross`: each with a one-token encoder context."""
    sizes = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
    return StepPlan(
        tuple(
            ScheduledRequest(
                f"warmup-{i}",
                0,
                (0,) * n,
                (NULL_BLOCK,) * -(-n // block_size),
                False,
                cross_block_ids=(NULL_BLOCK,) if cross else (),
                num_encoder_tokens=1 if cross else 0,
            )
            for i, n in enumerate(sizes)
        )
    )


@dataclass(frozen=True)
class ForwardBatch:
    """The tensors one forward consumes, padded to a bucket.

    input_ids [num_tokens], positions [num_tokens], logits_indices [num_seqs + extra] (the
    last token of each sequence; padding sequences point at row 0 and are dropped; then the
    rows of `spec_rows`, then those of `prompt_rows`), lora_slots [num_tokens] (the adapter
    slot of each token, -1 for none; None without LoRA). `spec_rows`: (request index, k) per
    request verifying k draft tokens: logits rows `num_seqs + ...` predict its draft tokens,
    in order. `prompt_rows`: (request index, first prompt position predicted, count) per
    request with
    `prompt_logprobs` whose prompt tokens this step computes: the last logits rows predict
    those prompt tokens, in order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    lora_slots: torch.Tensor | None = None
    prompt_rows: tuple[tuple[int, int, int], ...] = ()
    spec_rows: tuple[tuple[int, int], ...] = ()


def build_forward_batch(
    plan: StepPlan,
    block_size: int,
    max_blocks: int,
    num_tokens_padded: int,
    num_seqs_padded: int,
    max_cross_blocks: int = 0,
    lora_slot_of: dict[int, int] | None = None,
    cross_ranges: bool = False,
    buffers: DecodeBuffers | None = None,
) -> ForwardBatch:
    """Lay the plan's requests end to end in one token stream, padded to the given sizes.

    `max_cross_blocks` > 0: a decoder step of an encoder-decoder model, with each request's
    cross context. `lora_slot_of` (lora id -> resident slot): give the batch per-token slots.
    `cross_ranges`: a vision-language model's step, with each token's range of its request's
    image tokens and its row mask (`ember.runtime.multimodal`).
    """
    reqs = plan.requests
    lora_slots = None
    if lora_slot_of is not None:
        lora_slots = torch.tensor(
            [
                -1 if r.lora_id is None else lora_slot_of.get(r.lora_id, -1)
                for r in reqs
                for _ in range(r.num_new_tokens)
            ],
            dtype=torch.long,
        )
    if (
        buffers is not None
        and not max_cross_blocks
        and not cross_ranges
        and all(r.num_new_tokens == 1 and r.params.prompt_logprobs is None for r in reqs)
    ):
        return buffers.fill(
            reqs, block_size, max_blocks, num_tokens_padded, num_seqs_padded, lora_slots
        )
    num_new = [r.num_new_tokens for r in reqs]
    cross: dict = {}
    if max_cross_blocks:
        cross = dict(
            cross_lens=[r.num_encoder_tokens for r in reqs],
            cross_tables=[r.cross_block_ids for r in reqs],
            max_cross_blocks=max_cross_blocks,
        )
    meta, positions = build_attention_metadata(
        num_computed=[r.num_computed_tokens for r in reqs],
        num_new=num_new,
        block_tables=[r.block_ids for r in reqs],
        block_size=block_size,
        max_blocks=max_blocks,
        num_tokens_padded=num_tokens_padded,
        num_seqs_padded=num_seqs_padded,
        **cross,
    )
    if cross_ranges:
        meta = _with_cross_ranges(meta, reqs, num_tokens_padded)
    # numpy, not torch, for the small per-step arrays: after a step has streamed the weights
    # through the caches, each torch op here took 20-60 us (numpy's are a few).
    input_ids = np.zeros(num_tokens_padded, dtype=np.int64)
    input_ids[: plan.num_tokens] = [t for r in reqs for t in r.token_ids]
    logits_indices, prompt_rows, spec_rows = _logits_rows(reqs, num_new, num_seqs_padded)
    return ForwardBatch(
        torch.from_numpy(input_ids),
        positions,
        meta,
        logits_indices,
        lora_slots,
        tuple(prompt_rows),
        tuple(spec_rows),
    )


def _logits_rows(
    reqs: Sequence[ScheduledRequest], num_new: list[int], num_seqs_padded: int
) -> tuple[torch.Tensor, list[tuple[int, int, int]], list[tuple[int, int]]]:
    """(`logits_indices`: each request's sampling row, padded to `num_seqs_padded`, then the
    rows of draft tokens and of prompt logprobs; `prompt_rows`; `spec_rows`)."""
    ends = list(itertools.accumulate(num_new))
    indices = [np.zeros(num_seqs_padded, dtype=np.int64)]
    indices[0][: len(reqs)] = [e - 1 for e in ends]
    # Speculative decoding: the rows of a request's last real token and all of its draft
    # tokens but the last predict its draft tokens (the last one's row is the sampling row).
    spec_rows = []
    for i, r in enumerate(reqs):
        k = len(r.spec_token_ids)
        if k:
            indices.append(np.arange(ends[i] - k - 1, ends[i] - 1, dtype=np.int64))
            spec_rows.append((i, k))
    # Prompt logprobs: the logits of every computed prompt token but the last predict the
    # next prompt token (the last one's row is the sampling row above).
    prompt_rows = []
    for i, r in enumerate(reqs):
        if r.params.prompt_logprobs is None or r.pool:
            continue
        count = min(r.num_new_tokens, len(r.prompt_token_ids) - 1 - r.num_computed_tokens)
        if count > 0:
            first = ends[i] - r.num_new_tokens
            indices.append(np.arange(first, first + count, dtype=np.int64))
            prompt_rows.append((i, r.num_computed_tokens + 1, count))
    logits_indices = torch.from_numpy(np.concatenate(indices) if len(indices) > 1 else indices[0])
    return logits_indices, prompt_rows, spec_rows


def _with_cross_ranges(
    meta: AttentionMetadata, reqs: Sequence[ScheduledRequest], num_tokens_padded: int
) -> AttentionMetadata:
    """`meta` with `cross_token_ranges` and `cross_row_mask` of the step's tokens: text-only
    requests and padding get an empty range and row mask 0 (cross-attention layers leave
    them unchanged)."""
    ranges = np.zeros((num_tokens_padded, 2), dtype=np.int32)
    row_mask = np.zeros(num_tokens_padded, dtype=np.float32)
    start = 0
    for r in reqs:
        n = r.num_new_tokens
        if r.images is not None:
            lo, hi, attends = r.images.ranges(r.num_computed_tokens, n)
            ranges[start : start + n, 0], ranges[start : start + n, 1] = lo, hi
            row_mask[start : start + n] = attends
        start += n
    return dataclasses.replace(
        meta,
        cross_token_ranges=torch.from_numpy(ranges),
        cross_row_mask=torch.from_numpy(row_mask),
    )


def vision_plan(plan: StepPlan) -> list[ScheduledRequest]:
    """The requests of `plan` whose images the vision tower runs this step."""
    return [r for r in plan.requests if r.encode_images and r.images is not None]


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of one generated position: the sampled token and the top-N, with ranks."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RunnerOutput:
    """Per request of the step: the sampled token (and optional logprobs) of each request that
    sampled, the pooled embedding of each embedding request, and the error of each request
    that failed on its own (its logits row held NaN or inf): it gets no token and finishes."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    pooled: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # Requests with prompt_logprobs: (first prompt position, logprobs of each position on).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Speculative decoding: the draft tokens each request kept, which come before its
    # `sampled` token, and the logprobs of all of them in order (when it asked for logprobs).
    accepted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)


class DecodeBuffers:
    """The input tensors of decode-only steps, kept per padded shape and refilled in place.

    A decode step's host work runs cache-cold: the step before it streamed the model's weights
    through every cache level, so each distinct numpy or torch call building its inputs cost
    10-60 us (llama-160m, batch 1: 308 us to build a one-token batch; the same code warm, ~20).
    Here a step writes two Python lists into two persistent arrays (int64: input ids,
    positions, slots, logits indices; int32: query starts, sequence lengths, block tables), and
    the tensors and metadata handed to the graph are fixed views of them.

    The runner owns one instance and uses a batch before building the next (the graph does not
    keep its inputs), so reuse is safe; `build_forward_batch` without `buffers` builds fresh
    tensors.
    """

    def __init__(self) -> None:
        self._shapes: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, ForwardBatch]] = {}

    def _views(self, num_tokens: int, num_seqs: int, max_blocks: int) -> tuple:
        key = (num_tokens, num_seqs, max_blocks)
        if key not in self._shapes:
            t, s = num_tokens, num_seqs
            i64 = torch.zeros(3 * t + s, dtype=torch.long)
            i32 = torch.zeros(2 * s + 1 + s * max_blocks, dtype=torch.int32)
            meta = AttentionMetadata(
                slot_mapping=i64[2 * t : 3 * t],
                query_start_loc=i32[: s + 1],
                seq_lens=i32[s + 1 : 2 * s + 1],
                block_tables=i32[2 * s + 1 :].view(s, max_blocks),
            )
            batch = ForwardBatch(i64[:t], i64[t : 2 * t], meta, i64[3 * t :])
            self._shapes[key] = (i64.numpy(), i32.numpy(), batch)
        return self._shapes[key]

    def fill(
        self,
        reqs: Sequence[ScheduledRequest],
        block_size: int,
        max_blocks: int,
        num_tokens_padded: int,
        num_seqs_padded: int,
        lora_slots: torch.Tensor | None,
    ) -> ForwardBatch:
        """The batch of `reqs`, each one new token, laid out as `build_forward_batch` does."""
        i64, i32, batch = self._views(num_tokens_padded, num_seqs_padded, max_blocks)
        n = len(reqs)
        pad_tokens, pad_seqs = num_tokens_padded - n, num_seqs_padded - n
        pos = [r.num_computed_tokens for r in reqs]
        slots = [slot_of(r.block_ids, c, block_size) for r, c in zip(reqs, pos, strict=True)]
        tables = []
        for r in reqs:
            tables += r.block_ids
            tables += [NULL_BLOCK] * (max_blocks - len(r.block_ids))
        # Padding sequences are empty.
        i64[:] = (
            [r.token_ids[0] for r in reqs]
            + [0] * pad_tokens
            + pos
            + [0] * pad_tokens
            + slots
            + padding_slots(pad_tokens, block_size)
            + list(range(n))
            + [0] * pad_seqs
        )
        i32[:] = (
            list(range(n))
            + [n] * (pad_seqs + 1)
            + [c + 1 for c in pos]
            + [0] * pad_seqs
            + tables
            + [NULL_BLOCK] * (pad_seqs * max_blocks)
        )
        if lora_slots is None:
            return batch
        return dataclasses.replace(batch, lora_slots=lora_slots)
