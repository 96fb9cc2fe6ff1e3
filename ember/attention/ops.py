"""The paged-attention op contract every backend implements, and the shared K/V writer.

`ember::paged_attention*(query, key, value, kv_cache, slot_mapping, query_start_loc, seq_lens,
block_tables, scale, sliding_window, softcap, causal)` writes this step's K/V into the layer's
paged cache (mutated in place, declared `Tensor(a!)` in the schema, so functionalization does
not copy the cache) and attends each sequence's new tokens over its context: decodes, prefill
chunks and prefix hits in one call. Shapes:

    query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim];
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (the backend's layout; mutated:
    new K/V written at `slot_mapping [num_tokens]`); query_start_loc [num_seqs + 1];
    seq_lens [num_seqs]; block_tables [num_seqs, max_blocks]. sliding_window 0 and softcap 0
    mean off. Returns [num_tokens, num_heads, head_dim]; rows of padding tokens are zero.

Each backend module defines its op with `paged_attention_fake` beside it (the torch backend:
`ember::paged_attention`). This module imports no backend.

`ember::write_kv_cache(kv_cache, key, value, slot_mapping)` only writes K/V (default layout):
the cross-attention K/V of encoder-decoder models, computed once per request from the encoder
output.

An int8 cache (`kv_cache_dtype="int8"`) holds each token's K/V head row as head_dim int8 codes
followed by the row's float32 scale in 4 bytes (`kv_row_width`): one scale per token and head,
symmetric (`quantize_kv_rows`). The cache's last dimension is then head_dim + 4.
"""

from __future__ import annotations

import torch

from ember.kernels.library import define_op


def paged_attention_fake(query: torch.Tensor, *args: object) -> torch.Tensor:
    """Shape function of every backend's paged-attention op: a contiguous tensor of query's
    shape and dtype, as every op returns, whatever query's strides. (`empty_like` kept a
    transposed query's strides, which the real output does not have: a compiled graph then
    read the output at the wrong offsets, so Persimmon, gpt-oss and MiMo-V2-Flash, whose
    queries reach attention as a transposed view, decoded other tokens compiled.)"""
    return query.new_empty(query.shape)


# Bytes after an int8 cache row's codes: its float32 scale.
KV_SCALE_BYTES = 4


def kv_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one K/V head's row in a cache of `kv_dtype`: head_dim, and an int8 cache's
    4 bytes of scale after its codes."""
    return head_dim + KV_SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """`x [..., D]` as int8 cache rows `[..., D + 4]`: per row, scale = max |x| / 127 and
    codes round-half-even(x * (127 / max |x|)) (all 0 for a zero row), then the scale's 4
    bytes. The same float32 arithmetic as the C++ writer (`quantize_kv_row`), so both store
    the same bytes."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)  # [..., 4]
    return torch.cat((codes, scale), dim=-1)


def dequantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows `[..., D + 4]` as float32 `[..., D]`: codes times their row's scale."""
    scale = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :-KV_SCALE_BYTES].float() * scale


def cache_rows(kv_cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache of `kv_cache`'s dtype in `dtype`: an int8 cache's dequantized
    (float32), others cast."""
    if kv_cache.dtype == torch.int8:
        return dequantize_kv_rows(rows)
    return rows.to(dtype)


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter `key`/`value [num_tokens, num_kv_heads, head_dim]` into their slots of
    `kv_cache [2, num_blocks, block_size, num_kv_heads, row]` (row: `kv_row_width`)."""
    _, _, _, num_kv_heads, row = kv_cache.shape
    if kv_cache.dtype == torch.int8:
        key, value = quantize_kv_rows(key), quantize_kv_rows(value)
    kv_cache[0].view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _write_kv_fake(*args: object) -> None:
    return None


write_kv_cache = define_op("write_kv_cache", write_kv, _write_kv_fake, mutates_args=("kv_cache",))


def visible_keys(
    q_pos: torch.Tensor, length: int, seq_lens: torch.Tensor, causal: bool, sliding_window: int
) -> torch.Tensor:
    """mask [n, 1, Lq, L] (True = visible) from query positions `q_pos [n, Lq]` and context
    lengths `seq_lens [n]`."""
    k_pos = torch.arange(length)
    mask = k_pos[None, None, :] < seq_lens[:, None, None]
    if causal:
        mask = mask & (k_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window > 0:
        mask = mask & (k_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
    return mask[:, None]


def context_rows(
    kv_cache: torch.Tensor, table: torch.Tensor, length: int, half: int
) -> torch.Tensor:
    """One sequence's first `length` K (`half` 0) or V (1) rows `[length, num_kv_heads, D]`
    in float32, read from its blocks `table` of a cache in the default layout."""
    _, _, block_size, num_kv_heads, row = kv_cache.shape
    blocks = table[: -(-length // block_size)].long()
    rows = kv_cache[half].index_select(0, blocks).view(-1, num_kv_heads, row)[:length]
    return cache_rows(kv_cache, rows, torch.float32)


def cross_attention_ranges_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    cross_seq_lens: torch.Tensor,
    cross_block_tables: torch.Tensor,
    token_ranges: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Cross-attention of a vision-language model over paged image K/V, one range per token.

    query [num_tokens, num_heads, head_dim]; kv_cache in the default layout, read only (the
    image K/V were written by `write_kv_cache`); cross_seq_lens [num_seqs] image tokens per
    sequence in the blocks `cross_block_tables [num_seqs, max_cross_blocks]`; token_ranges
    [num_tokens, 2]: the [start, end) of its sequence's image tokens each token attends (no
    causal order: every image token is context). A token with start == end (text-only
    sequences, padding) gets zeros. Math in fp32; returns query's dtype.
    """
    out = torch.zeros(query.shape, dtype=query.dtype)  # contiguous, as the fake says
    starts = query_start_loc.tolist()
    lens = cross_seq_lens.tolist()
    for s, length in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if length <= 0 or b <= a:
            continue
        ranges = token_ranges[a:b].long()
        live = ranges[:, 1] > ranges[:, 0]
        if not bool(live.any()):
            continue
        k = context_rows(kv_cache, cross_block_tables[s], length, 0)
        v = context_rows(kv_cache, cross_block_tables[s], length, 1)
        pos = torch.arange(length)
        mask = (pos[None, :] >= ranges[:, :1]) & (pos[None, :] < ranges[:, 1:])
        mask[~live] = True  # rows computed but dropped below
        attended = torch.nn.functional.scaled_dot_product_attention(
            query[a:b].float().transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask[None, None],
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
        out[a:b] = torch.where(live[:, None, None], attended, 0.0).to(query.dtype)
    return out


cross_attention_ranges = define_op(
    "cross_attention_ranges", cross_attention_ranges_ref, paged_attention_fake
)


def sink_scale_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    causal: bool,
) -> torch.Tensor:
    """`out` (a paged-attention op's output for `query`, same arguments) with attention sinks
    applied: each head's learned logit `sinks [num_heads]` joins the softmax's denominator
    as a key with a zero value, so a row's output is scaled by Z / (Z + e^sink) =
    sigmoid(lse - sink), lse the log-sum-exp of its visible (soft-capped) scores. gpt-oss and
    Granite-SWA apply sinks so; HF computes the same sum by concatenating the sink logit.

    Taking `out` keeps this after the attention op that wrote the step's K/V, which a graph
    otherwise has no edge for. Reads the cache in the default layout; math in fp32.
    """
    res = out.clone()
    group = query.shape[1] // kv_cache.shape[3]
    starts = query_start_loc.tolist()
    sink = sinks.float()[:, None]  # [H, 1]
    for s, length in enumerate(seq_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        if b <= a or length <= 0:
            continue
        k = context_rows(kv_cache, block_tables[s], length, 0).repeat_interleave(group, dim=1)
        q = query[a:b].float()  # [T, H, D]
        scores = torch.einsum("thd,lhd->htl", q, k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(length - (b - a), length)[None]
        visible = visible_keys(q_pos, length, torch.tensor([length]), causal, sliding_window)[0]
        lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)  # [H, T]
        factor = torch.sigmoid(lse - sink).transpose(0, 1)[..., None]  # [T, H, 1]
        res[a:b] = (out[a:b].float() * factor).to(out.dtype)
    return res


def _sink_scale_fake(out: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(out)


sink_scale = define_op("sink_scale", sink_scale_ref, _sink_scale_fake)
