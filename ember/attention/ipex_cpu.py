"""The "ipex" backend: Intel Extension for PyTorch's paged-attention kernels.

Imported only when the backend is selected and `intel_extension_for_pytorch` imports and matches
the installed torch (see `ember.attention._ipex_unavailable`). IPEX's last release supports
torch 2.8 only, so on ember's pinned torch this backend reports itself unavailable and its tests
skip. Cache layout (IPEX's): `[2, num_blocks, num_kv_heads, block_size, head_dim]`.

- `reshape_and_cache` writes the step's K/V at `slot_mapping`;
- a step of decodes only goes to `single_query_cached_kv_attention`;
- any other step (prefill chunks, prefix hits, mixed) goes to one `flash_attn_varlen_func` call.
"""

from __future__ import annotations

import intel_extension_for_pytorch as ipex
import torch

from ember.attention.ops import paged_attention_fake
from ember.kernels.library import define_op

_paged = ipex.llm.modules.PagedAttention


def paged_attention_ipex(
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
    """Same contract as `ember::paged_attention` (see `ember.attention.ops`)."""
    if softcap > 0:
        raise ValueError(
            "attention logit soft-capping is not supported by attention backend 'ipex'"
        )
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _paged.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.long())
    num_tokens, num_heads, _ = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=query.dtype)  # contiguous (ops.paged_attention_fake)
    qsl = query_start_loc.int()
    real_tokens = int(qsl[-1])
    q_lens = qsl[1:] - qsl[:-1]
    num_seqs = int(torch.count_nonzero(seq_lens))
    lens = seq_lens[:num_seqs].int()
    tables = block_tables[:num_seqs].int()
    if bool((q_lens[:num_seqs] == 1).all()) and causal and sliding_window <= 0:
        head_mapping = torch.arange(num_kv_heads, dtype=torch.int32).repeat_interleave(
            num_heads // num_kv_heads
        )
        _paged.single_query_cached_kv_attention(
            out[:real_tokens],
            query[:real_tokens].contiguous(),
            key_cache,
            value_cache,
            head_mapping,
            scale,
            tables,
            lens,
            block_size,
            int(lens.max()),
            None,
        )
        return out
    cu_kv = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=cu_kv[1:])
    _paged.flash_attn_varlen_func(
        out[:real_tokens],
        query[:real_tokens].contiguous(),
        key_cache,
        value_cache,
        qsl[: num_seqs + 1],
        cu_kv,
        int(q_lens[:num_seqs].max()),
        int(lens.max()),
        scale,
        causal,
        tables,
        None,
        window_size_left=sliding_window - 1 if sliding_window > 0 else -1,
        window_size_right=0 if causal else -1,
    )
    return out


paged_attention_ipex_op = define_op(
    "paged_attention_ipex", paged_attention_ipex, paged_attention_fake, mutates_args=("kv_cache",)
)
