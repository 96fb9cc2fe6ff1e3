"""The paged-attention custom op. Opaque to torch.compile; its fake impl derives shapes only.

`ember::paged_attention` writes this step's K/V into the layer's paged cache (mutated in place,
declared in `mutates_args`, so functionalization does not copy the cache) and attends each
sequence's new tokens over its context: decodes, prefill chunks and prefix hits in one call.
"""

from __future__ import annotations

import torch

from ember.attention import torch_cpu


@torch.library.custom_op("ember::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    causal: bool,
) -> torch.Tensor:
    """Paged attention over a flattened mixed batch.

    query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim];
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (mutated: new K/V written at
    `slot_mapping [num_tokens]`); query_start_loc [num_seqs + 1]; seq_lens [num_seqs];
    block_tables [num_seqs, max_blocks]. sliding_window 0 and softcap 0 mean off.
    Returns [num_tokens, num_heads, head_dim]; rows of padding tokens are zero.
    """
    return torch_cpu.paged_attention(
        query,
        key,
        value,
        kv_cache,
        slot_mapping,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        sliding_window,
        softcap,
        causal,
    )


@paged_attention.register_fake
def _(
    query,
    key,
    value,
    kv_cache,
    slot_mapping,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    sliding_window,
    softcap,
    causal,
):
    return torch.empty_like(query)


@torch.library.custom_op("ember::write_kv_cache", mutates_args=("kv_cache",))
def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `key`/`value [num_tokens, num_kv_heads, head_dim]` at `slot_mapping` (layout
    [2, num_blocks, block_size, num_kv_heads, head_dim]). Used for the cross-attention K/V of
    encoder-decoder models, computed once per request from the encoder output."""
    torch_cpu.write_kv(kv_cache, key, value, slot_mapping)


@write_kv_cache.register_fake
def _(kv_cache, key, value, slot_mapping):
    return None
