"""The "torch" CPU backend of `ember::paged_attention`: PyTorch ops over the paged cache.

Cache layout per layer: `kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). All new K/V of the step are written before any sequence reads,
so a sequence may read blocks that another sequence of the same step fills (prefix hits).
Decodes are attended together in one batched call; each prefill chunk gets its own call.
Math runs in float32 whatever the cache dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter `key`/`value [num_tokens, num_kv_heads, head_dim]` into their slots."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, key.to(kv_cache.dtype)
    )
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(kv_cache.dtype)
    )


# Gather destinations, reused across calls and layers: a fresh multi-MB tensor per call is
# page-faulted in every time (measured: index_select of 33 MB, 17.2 ms into a new tensor vs
# 1.7 ms into a reused one). The op is not reentrant: one engine step runs at a time.
_scratch: dict[str, torch.Tensor] = {}


def _scratch_rows(name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    buf = _scratch.get(name)
    if buf is None or buf.numel() < rows * cols or buf.dtype != dtype:
        # A normal tensor, usable both inside and outside inference mode.
        with torch.inference_mode(False):
            buf = torch.empty(rows * cols, dtype=dtype)
        _scratch[name] = buf
    return buf[: rows * cols].view(rows, cols)


def release_scratch() -> None:
    """Free the gather buffers (called when an engine closes)."""
    _scratch.clear()


def _gather(
    kv_cache: torch.Tensor, tables: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of `tables [n, num_blocks_used]` as float32 `[n, num_kv_heads, length, head_dim]`.

    index_select over whole blocks (rows of the flattened cache), not advanced indexing:
    measured 0.55 vs 1.50 ms for 32 decodes at context 144 (llama-160m heads).
    """
    n = tables.shape[0]
    _, num_blocks, _, num_kv_heads, head_dim = kv_cache.shape
    flat = tables.reshape(-1)
    row = kv_cache[0].view(num_blocks, -1).shape[1]
    k = _scratch_rows("k", flat.numel(), row, kv_cache.dtype)
    v = _scratch_rows("v", flat.numel(), row, kv_cache.dtype)
    torch.index_select(kv_cache[0].view(num_blocks, -1), 0, flat, out=k)
    torch.index_select(kv_cache[1].view(num_blocks, -1), 0, flat, out=v)
    k = k.view(n, -1, num_kv_heads, head_dim)[:, :length]
    v = v.view(n, -1, num_kv_heads, head_dim)[:, :length]
    return k.transpose(1, 2).float(), v.transpose(1, 2).float()


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """q [n, H, Lq, D], k/v [n, Hkv, L, D], mask [n, 1, Lq, L] (True = visible)."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _visible(
    q_pos: torch.Tensor, length: int, seq_lens: torch.Tensor, causal: bool, sliding_window: int
) -> torch.Tensor:
    """mask [n, 1, Lq, L] from query positions `q_pos [n, Lq]` and context lengths `[n]`."""
    k_pos = torch.arange(length)
    mask = k_pos[None, None, :] < seq_lens[:, None, None]
    if causal:
        mask = mask & (k_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window > 0:
        mask = mask & (k_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
    return mask[:, None]


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
    """Write the step's K/V into `kv_cache`, then attend. Shapes: see `ember.attention.ops`."""
    write_kv(kv_cache, key, value, slot_mapping)
    block_size = kv_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decodes:
        idx = torch.tensor(decodes)
        tok = query_start_loc[idx].long()
        length = max(lens[i] for i in decodes)
        k, v = _gather(kv_cache, block_tables[idx, : -(-length // block_size)].long(), length)
        sl = seq_lens[idx].long()
        mask = _visible((sl - 1)[:, None], length, sl, causal, sliding_window)
        q = query[tok].float()[:, :, None, :]  # [n, H, 1, D]
        out[tok] = _attend(q, k, v, mask, scale, softcap)[:, :, 0, :]
    for i in range(len(lens)):
        num_q = starts[i + 1] - starts[i]
        if num_q <= 1:
            continue
        length = lens[i]
        k, v = _gather(kv_cache, block_tables[i : i + 1, : -(-length // block_size)].long(), length)
        q_pos = torch.arange(length - num_q, length)[None]
        mask = _visible(q_pos, length, seq_lens[i : i + 1].long(), causal, sliding_window)
        q = query[starts[i] : starts[i + 1]].float().transpose(0, 1)[None]  # [1, H, Lq, D]
        out[starts[i] : starts[i + 1]] = _attend(q, k, v, mask, scale, softcap)[0].transpose(0, 1)
    return out.to(query.dtype)
