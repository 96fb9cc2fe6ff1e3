"""StepPlan -> ForwardBatch -> forward -> sampled ids. The only model runner.

The runner owns the KV-cache tensors (one per layer) and the model's forward callable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention.metadata import AttentionMetadata, build_attention_metadata
from ember.compiler.capture import capture_forward, kv_geometry
from ember.runtime.batch import RunnerOutput, StepPlan
from ember.runtime.config import EngineConfig, KVCacheSpec
from ember.runtime.sampler import sample


@dataclass(frozen=True)
class ForwardBatch:
    """The tensors one forward consumes.

    input_ids [num_tokens], positions [num_tokens], logits_indices [num_sampled].
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor


def build_forward_batch(plan: StepPlan, block_size: int, max_blocks: int) -> ForwardBatch:
    """Lay the plan's requests end to end in one token stream."""
    reqs = plan.requests
    num_new = [r.num_new_tokens for r in reqs]
    meta, positions = build_attention_metadata(
        num_computed=[r.num_computed_tokens for r in reqs],
        num_new=num_new,
        block_tables=[r.block_ids for r in reqs],
        block_size=block_size,
        max_blocks=max_blocks,
        num_tokens_padded=plan.num_tokens,
        num_seqs_padded=plan.num_seqs,
    )
    input_ids = torch.tensor([t for r in reqs for t in r.token_ids], dtype=torch.long)
    ends = torch.tensor(num_new).cumsum(0) - 1
    sampled = torch.tensor([r.sample for r in reqs], dtype=torch.bool)
    return ForwardBatch(input_ids, positions, meta, ends[sampled])


class ModelRunner:
    """Runs one step of the model over the paged KV cache and samples."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, num_blocks: int) -> None:
        self.config = config
        num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
        self.kv_spec = KVCacheSpec(
            num_layers, num_kv_heads, head_dim, config.block_size, num_blocks, config.dtype
        )
        # Zeros, not empty: attention masks unused slots, and masked NaNs would still poison
        # the weighted sum.
        self.kv_caches = [
            torch.zeros(2, num_blocks, config.block_size, num_kv_heads, head_dim, dtype=config.dtype)
            for _ in range(num_layers)
        ]
        self.model = model
        self.forward = capture_forward(model)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        batch = build_forward_batch(plan, self.config.block_size, self.config.max_blocks_per_seq)
        logits = self.forward(
            batch.input_ids, batch.positions, batch.logits_indices, batch.attn_metadata,
            self.kv_caches,
        )
        sampling = [r for r in plan.requests if r.sample]
        if not sampling:
            return RunnerOutput({}, {})
        tokens, logprobs = sample(logits, sampling)
        return RunnerOutput({r.request_id: t for r, t in zip(sampling, tokens)}, logprobs)
