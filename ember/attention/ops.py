"""The "torch" backend's custom ops. Opaque to torch.compile; their fake impls derive shapes only.

`ember::paged_attention(query, key, value, kv_cache, slot_mapping, query_start_loc, seq_lens,
block_tables, scale, sliding_window, softcap, causal)` writes this step's K/V into the layer's
paged cache (mutated in place, declared `Tensor(a!)` in the schema, so functionalization does
not copy the cache) and attends each sequence's new tokens over its context: decodes, prefill
chunks and prefix hits in one call. Every backend's op has this contract:

    query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim];
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (the backend's layout; mutated:
    new K/V written at `slot_mapping [num_tokens]`); query_start_loc [num_seqs + 1];
    seq_lens [num_seqs]; block_tables [num_seqs, max_blocks]. sliding_window 0 and softcap 0
    mean off. Returns [num_tokens, num_heads, head_dim]; rows of padding tokens are zero.

`ember::write_kv_cache(kv_cache, key, value, slot_mapping)` only writes K/V: the cross-attention
K/V of encoder-decoder models, computed once per request from the encoder output.
"""

from __future__ import annotations

import torch

from ember.attention import torch_cpu
from ember.library import define_op


def _paged_attention_fake(query: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(query)


def _write_kv_fake(*args: object) -> None:
    return None


paged_attention = define_op(
    "paged_attention", torch_cpu.paged_attention, _paged_attention_fake, mutates_args=("kv_cache",)
)
write_kv_cache = define_op(
    "write_kv_cache", torch_cpu.write_kv, _write_kv_fake, mutates_args=("kv_cache",)
)
