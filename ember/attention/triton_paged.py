"""The "triton" backend: a Triton paged-attention kernel, wrapped with `torch.library.triton_op`
so inductor sees the kernel rather than an opaque call.

Meant for GPUs; on CPU it runs only under `TRITON_INTERPRET=1` (how its tests run it).
One program per (query token, K/V head): it loads the `group` query heads that share the K/V
head, walks the token's visible context block by block through the block table with an online
softmax, and writes `[group, head_dim]` outputs. Each K/V row is read once per query token and
K/V head, never per query head. Mixed batches need no host-side split: each token carries its
sequence and position. Cache layout: `[2, num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ember.attention.ops import paged_attention_fake, write_kv


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    tok_seq_ptr,
    tok_pos_ptr,
    tok_len_ptr,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tok_seq_ptr + t)
    pos = tl.load(tok_pos_ptr + t)
    length = tl.load(tok_len_ptr + t)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    hi = length
    if CAUSAL:
        hi = tl.minimum(pos + 1, length)
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        rows = block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_N]
        if USE_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), exact and portable across Triton targets.
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    # Padding tokens (length 0) attend to nothing: their rows stay zero.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


def _token_map(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: its sequence, its position, and its sequence's context length (0 = padding)."""
    qsl = query_start_loc.long()
    t = torch.arange(num_tokens, device=qsl.device)
    seq = torch.searchsorted(qsl[1:], t, right=True).clamp(max=seq_lens.numel() - 1)
    real = t < qsl[-1]
    lens = seq_lens.long()[seq]
    pos = lens - (qsl[seq + 1] - t)
    zero = torch.zeros_like(t)
    return seq.int(), torch.where(real, pos, zero).int(), torch.where(real, lens, zero).int()


@triton_op("ember::paged_attention_triton", mutates_args=("kv_cache",))
def paged_attention_triton(
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
    write_kv(kv_cache, key, value, slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype)  # contiguous (ops.paged_attention_fake)
    tok_seq, tok_pos, tok_len = _token_map(query_start_loc, seq_lens, num_tokens)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    tables = block_tables.contiguous()
    wrap_triton(_paged_attention_kernel)[(num_tokens, num_kv_heads)](
        out,
        query,
        k_cache,
        v_cache,
        tables,
        tok_seq,
        tok_pos,
        tok_len,
        scale,
        softcap,
        sliding_window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        GROUP=group,
        BLOCK_G=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=16,
        CAUSAL=causal,
        USE_SOFTCAP=softcap > 0,
    )
    return out


paged_attention_triton.register_fake(paged_attention_fake)
