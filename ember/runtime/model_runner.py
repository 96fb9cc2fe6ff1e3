"""StepPlan -> ForwardBatch -> forward -> sampled ids. The only model runner.

The runner owns the KV-cache tensors (one per layer) and the model's forward callable (compiled
or eager). Every step is padded to a token bucket, so compiled graphs are reused across any mix
of prefills and decodes; padding tokens write into the reserved null block and are dropped.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ember.attention import get_backend, torch_cpu
from ember.attention.metadata import AttentionMetadata, build_attention_metadata
from ember.compiler import cache
from ember.compiler.capture import (
    capture_encoder_forward,
    capture_forward,
    capture_hidden_forward,
    compile_forward,
    kv_layer_shapes,
)
from ember.compiler.inductor import compile_settings
from ember.lora.manager import LoRAManager
from ember.runtime.batch import RunnerOutput, StepPlan
from ember.runtime.buckets import graph_sizes, is_static, padded_num_seqs, padded_num_tokens
from ember.runtime.config import EngineConfig
from ember.runtime.sampler import sample


@dataclass(frozen=True)
class ForwardBatch:
    """The tensors one forward consumes, padded to a bucket.

    input_ids [num_tokens], positions [num_tokens], logits_indices [num_seqs] (the last token
    of each sequence; padding sequences point at row 0 and are dropped).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor


def build_forward_batch(
    plan: StepPlan,
    block_size: int,
    max_blocks: int,
    num_tokens_padded: int,
    num_seqs_padded: int,
    max_cross_blocks: int = 0,
) -> ForwardBatch:
    """Lay the plan's requests end to end in one token stream, padded to the given sizes.
    `max_cross_blocks` > 0: an encoder-decoder step, with each request's cross context."""
    reqs = plan.requests
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
    input_ids = torch.zeros(num_tokens_padded, dtype=torch.long)
    input_ids[: plan.num_tokens] = torch.tensor(
        [t for r in reqs for t in r.token_ids], dtype=torch.long
    )
    logits_indices = torch.zeros(num_seqs_padded, dtype=torch.long)
    logits_indices[: len(reqs)] = torch.tensor(num_new).cumsum(0) - 1
    return ForwardBatch(input_ids, positions, meta, logits_indices)


def _mark_dynamic(batch: ForwardBatch, dynamic_tokens: bool) -> None:
    """num_seqs and the block-table width are always dynamic graph dims; num_tokens is dynamic
    only past the static bucket ladder."""
    meta = batch.attn_metadata
    for t in (meta.query_start_loc, meta.seq_lens, batch.logits_indices):
        torch._dynamo.mark_dynamic(t, 0)
    for tables in (meta.block_tables, meta.cross_block_tables):
        if tables is not None:
            torch._dynamo.mark_dynamic(tables, 0)
            torch._dynamo.mark_dynamic(tables, 1)
    if meta.cross_seq_lens is not None:
        torch._dynamo.mark_dynamic(meta.cross_seq_lens, 0)
    if dynamic_tokens:
        for t in (batch.input_ids, batch.positions, meta.slot_mapping):
            torch._dynamo.mark_dynamic(t, 0)


class ModelRunner:
    """Runs one step of the model over the paged KV cache and samples."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig,
        num_blocks: int,
        lora: LoRAManager | None = None,
    ) -> None:
        self.config = config
        self.lora = lora
        backend = get_backend(config.attention_backend)
        # One tensor per layer, each with that layer's K/V heads and head_dim. Zeros, not
        # empty: attention masks unused slots, and masked NaNs would still poison the sum.
        self.kv_caches = [
            torch.zeros(
                backend.kv_cache_shape(num_blocks, config.block_size, num_kv_heads, head_dim),
                dtype=config.dtype,
            )
            for num_kv_heads, head_dim in kv_layer_shapes(model)
        ]
        self.model = model
        self.buckets = config.token_buckets
        # The main forward: logits for a (causal or encoder-decoder) LM; hidden states for an
        # embedding model. Encoder-decoder models also get the encoder pass.
        if config.task == "embed":
            self.forward = capture_hidden_forward(model)
        else:
            self.forward = capture_forward(model)
        self.encoder_forward: Callable[..., torch.Tensor] | None = None
        self.max_cross_blocks = 0
        if config.task == "encdec":
            self.encoder_forward = capture_encoder_forward(model)
            max_source = model.config.max_position_embeddings
            self.max_cross_blocks = -(-max_source // config.block_size)
        self._eager_hidden: Callable[..., torch.Tensor] | None = None
        if config.compile:
            # The cache size is a dynamic dim, so graphs do not depend on kv_cache_gib.
            for kv in self.kv_caches:
                torch._dynamo.mark_dynamic(kv, 1)
            self.forward = compile_forward(self.forward)
            if self.encoder_forward is not None:
                self.encoder_forward = compile_forward(self.encoder_forward)

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """One example token count per compiled graph (static buckets, then the dynamic one)."""
        return graph_sizes(self.buckets, self.config.max_num_batched_tokens)

    def close(self) -> None:
        """Release the KV cache, the forward (and its compiled graphs) and the model."""
        self.kv_caches = []
        torch_cpu.release_scratch()
        self.forward = None  # type: ignore[assignment]
        self._eager_hidden = None
        self.model = None  # type: ignore[assignment]
        gc.collect()

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        return build_forward_batch(
            plan,
            self.config.block_size,
            self.config.max_blocks_per_seq,
            padded_num_tokens(plan.num_tokens, self.buckets),
            padded_num_seqs(plan.num_seqs),
            self.max_cross_blocks,
        )

    def run_encoders(self, requests: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> torch.Tensor:
        """Encoder pass over `(encoder_token_ids, cross_block_ids)` of requests admitted this
        step: fills their cross blocks with every decoder layer's cross-attention K/V. Returns
        the encoder output [num_tokens, d] (padding rows dropped)."""
        token_ids = [ids for ids, _ in requests]
        batch = self._prompt_batch(token_ids, [b for _, b in requests], self.max_cross_blocks, True)
        if self.config.compile:
            _mark_dynamic(batch, not is_static(batch.input_ids.shape[0], self.buckets))
        assert self.encoder_forward is not None
        hidden = self.encoder_forward(
            batch.input_ids, batch.positions, batch.attn_metadata, self.kv_caches
        )
        return hidden[: sum(map(len, token_ids))]

    def _prompt_batch(
        self,
        token_ids: Sequence[Sequence[int]],
        block_ids: Sequence[Sequence[int]],
        max_blocks: int,
        pad_to_bucket: bool,
    ) -> ForwardBatch:
        """Whole prompts (nothing computed yet) laid end to end, each writing its K/V into its
        `block_ids`; the token count is padded to a bucket when `pad_to_bucket`."""
        lens = [len(t) for t in token_ids]
        num_tokens = sum(lens)
        padded_tokens = padded_num_tokens(num_tokens, self.buckets) if pad_to_bucket else num_tokens
        padded_seqs = padded_num_seqs(len(lens))
        meta, positions = build_attention_metadata(
            [0] * len(lens),
            lens,
            [tuple(b) for b in block_ids],
            self.config.block_size,
            max_blocks,
            padded_tokens,
            padded_seqs,
        )
        input_ids = torch.zeros(padded_tokens, dtype=torch.long)
        input_ids[:num_tokens] = torch.tensor([t for ids in token_ids for t in ids])
        return ForwardBatch(input_ids, positions, meta, torch.zeros(padded_seqs, dtype=torch.long))

    def _run(
        self, batch: ForwardBatch, forward: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        if forward is None and self.config.compile:
            _mark_dynamic(batch, not is_static(batch.input_ids.shape[0], self.buckets))
        return (forward or self.forward)(
            batch.input_ids,
            batch.positions,
            batch.logits_indices,
            batch.attn_metadata,
            self.kv_caches,
        )

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[list[int]], block_ids: list[list[int]]) -> torch.Tensor:
        """Last hidden states [sum(len), hidden] of whole prompts laid end to end, each written
        to its `block_ids` (one pass, no chunking: an encoder's attention is bidirectional).

        Embedding models run their compiled graphs; a causal LM's base model runs eagerly (its
        compiled graphs produce logits).
        """
        if self.lora is not None:
            self.lora.set_token_slots([])  # embeddings use the base model
        forward = None
        if self.config.task != "embed":
            if self._eager_hidden is None:
                self._eager_hidden = capture_hidden_forward(self.model)
            forward = self._eager_hidden
        batch = self._prompt_batch(
            token_ids, block_ids, self.config.max_blocks_per_seq, forward is None
        )
        return self._run(batch, forward)[: sum(map(len, token_ids))]

    def _encode_admitted(self, plan: StepPlan) -> None:
        """Run the encoder for requests admitted this step, in groups within the token budget
        (an encoder input longer than the budget runs alone: encoders are not chunked)."""
        group: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        size = 0
        for r in plan.requests:
            if not r.encoder_token_ids:
                continue
            n = len(r.encoder_token_ids)
            if group and size + n > self.config.max_num_batched_tokens:
                self.run_encoders(group)
                group, size = [], 0
            group.append((r.encoder_token_ids, r.cross_block_ids))
            size += n
        if group:
            self.run_encoders(group)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        if self.encoder_forward is not None:
            self._encode_admitted(plan)
        if self.lora is not None:
            slots = self.lora.activate({r.lora_id for r in plan.requests if r.lora_id is not None})
            self.lora.set_token_slots(
                [slots.get(r.lora_id, -1) for r in plan.requests for _ in r.token_ids]  # type: ignore[arg-type]
            )
        logits = self._run(self.prepare(plan))  # [num_seqs_padded, vocab]
        rows = [i for i, r in enumerate(plan.requests) if r.sample]
        if not rows:
            return RunnerOutput({}, {})
        sampling = [plan.requests[i] for i in rows]
        tokens, logprobs = sample(logits[rows], sampling)
        return RunnerOutput(
            {r.request_id: t for r, t in zip(sampling, tokens, strict=True)}, logprobs
        )

    @torch.inference_mode()
    def warmup(self, show_progress: bool = True) -> bool:
        """Compile every token bucket now, so no request ever waits on a compile.

        With `compile_cache_dir`, matching artefacts are loaded first (nothing is compiled
        then), and fresh ones are saved after compiling. Dummy steps run entirely in the null
        block (block 0), which real requests never read. Returns True on a cache hit.
        """
        if not self.config.compile:
            return False
        cache_dir = self.config.compile_cache_dir
        parts = cache.key_parts(
            self.model.config,
            self.config.dtype,
            self.buckets,
            self.config.block_size,
            self.config.freeze_weights,
            len(self.graph_sizes) > len(self.buckets),
            self.config.attention_backend,
            (self.config.max_loras, self.config.max_lora_rank) if self.config.enable_lora else None,
            self.config.quantization,
        )
        hit = cache_dir is not None and cache.lookup(cache_dir, parts)
        inductor_dir = cache.inductor_dir(cache_dir, parts) if cache_dir is not None else None
        with compile_settings(self.config.freeze_weights, inductor_dir):
            for num_tokens in tqdm(
                self.graph_sizes,
                desc="Compiling graphs",
                unit="graph",
                disable=not show_progress,
                dynamic_ncols=True,
            ):
                self._run(self._dummy_batch(num_tokens))
                if self.encoder_forward is not None:
                    self.run_encoders(self._dummy_encoder_inputs(num_tokens))
        if cache_dir is not None and not hit:
            cache.mark_complete(cache_dir, parts)
        return hit

    def _dummy_encoder_inputs(
        self, num_tokens: int
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Encoder inputs totalling `num_tokens`, each within the encoder's positions, all in
        the null block."""
        bs = self.config.block_size
        chunk = self.model.config.max_position_embeddings
        sizes = [chunk] * (num_tokens // chunk) + (
            [num_tokens % chunk] if num_tokens % chunk else []
        )
        return [((0,) * n, (0,) * -(-n // bs)) for n in sizes]

    def _dummy_batch(self, num_tokens: int) -> ForwardBatch:
        """Prefills totalling `num_tokens`, each within max_model_len, all in the null block."""
        bs, max_blocks = self.config.block_size, self.config.max_blocks_per_seq
        chunk = max_blocks * bs
        num_new = [chunk] * (num_tokens // chunk) + (
            [num_tokens % chunk] if num_tokens % chunk else []
        )
        num_seqs = padded_num_seqs(len(num_new))
        cross: dict = {}
        if self.max_cross_blocks:
            cross = dict(
                cross_lens=[1] * len(num_new),
                cross_tables=[(0,)] * len(num_new),
                max_cross_blocks=self.max_cross_blocks,
            )
        meta, positions = build_attention_metadata(
            [0] * len(num_new),
            num_new,
            [(0,) * -(-n // bs) for n in num_new],
            bs,
            max_blocks,
            num_tokens,
            num_seqs,
            **cross,
        )
        logits_indices = torch.zeros(num_seqs, dtype=torch.long)
        return ForwardBatch(
            torch.zeros(num_tokens, dtype=torch.long), positions, meta, logits_indices
        )
