"""The "torch" CPU backend of paged attention (`ember::paged_attention`, contract in
`ember.attention.ops`): ember's C++ decode kernel plus vectorised PyTorch ops over the paged cache.

Cache layout per layer: `kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). All new K/V of the step are written before any sequence reads,
so a sequence may read blocks that another sequence of the same step fills (prefix hits).

One call handles a whole mixed batch with no Python loop over sequences:
- the K/V writes and the decodes (one new token) go to `ember_cpu::paged_attention` (C++,
  reading the blocks in place, with its own flash-decoding split, `ember.kernels`; what it
  leaves comes back through `ember::paged_attention_rest`) when it is built; where no
  compiler is available, decodes are attended together: each sequence's context is gathered
  once from its blocks and the query heads of a GQA group are folded into the query-length
  axis, so each K/V head is read once for all the query heads that share it (no
  `repeat_interleave`);
  when there are fewer (sequence, K/V head) pairs than threads and the context is long, the
  context is split into partitions that are attended in parallel and merged by their
  log-sum-exp (flash-decoding);
- prefill chunks and prefix hits (several new tokens) go to the C++ kernel as well, one row
  per query token, while the step's chunk rows see at most 2^18 positions in all; longer ones
  (and every chunk without the kernels) are padded to the longest chunk of the step and
  attended in one batched SDPA call, with a mask per sequence (`[chunks, 1, q, k]`), never
  one dense mask across requests.
Math runs in float32, except that a bfloat16 cache attended by bfloat16 queries on a CPU with
native bf16 matrix math (AVX512-BF16 / AMX) is attended in bfloat16 by SDPA's flash kernel,
which accumulates in float32: converting the gathered K/V to float32 cost as much as the
attention itself there. A bfloat16 cache under float32 queries (`kv_cache_dtype`) is widened.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember import kernels
from ember.attention.ops import cache_rows, paged_attention_fake, visible_keys, write_kv
from ember.host.isa import cpu_has_native_bf16
from ember.kernels.library import define_op

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


def release() -> None:
    """Free the gather buffers (an engine closed; see `AttentionBackend.release`)."""
    _scratch.clear()


def compute_dtype(kv_dtype: torch.dtype, query_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention runs in for a cache of `kv_dtype` attended by queries of
    `query_dtype` (see the module docstring): a bf16 cache under fp32 queries is widened."""
    if kv_dtype == query_dtype == torch.bfloat16 and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _gather(
    kv_cache: torch.Tensor, tables: torch.Tensor, query_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of whole blocks `tables [n, nb]` as `[n, num_kv_heads, nb * block_size, D]` in
    `compute_dtype`.

    index_select over whole blocks (rows of the flattened cache), not advanced indexing:
    measured 0.55 vs 1.50 ms for 32 decodes at context 144 (llama-160m heads).
    """
    n = tables.shape[0]
    _, num_blocks, _, num_kv_heads, row_width = kv_cache.shape
    flat = tables.reshape(-1)
    row = kv_cache[0].view(num_blocks, -1).shape[1]
    k = _scratch_rows("k", flat.numel(), row, kv_cache.dtype)
    v = _scratch_rows("v", flat.numel(), row, kv_cache.dtype)
    torch.index_select(kv_cache[0].view(num_blocks, -1), 0, flat, out=k)
    torch.index_select(kv_cache[1].view(num_blocks, -1), 0, flat, out=v)
    dtype = compute_dtype(kv_cache.dtype, query_dtype)
    k = cache_rows(kv_cache, k.view(n, -1, num_kv_heads, row_width), dtype).transpose(1, 2)
    v = cache_rows(kv_cache, v.view(n, -1, num_kv_heads, row_width), dtype).transpose(1, 2)
    return k, v


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """Attention with logit soft-capping (SDPA has no such option). Shapes as in SDPA."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = (cap * torch.tanh(scores / cap)).masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


# Flash-decoding split: used when (decodes x K/V heads) leaves threads idle and each partition
# still holds at least this many blocks' worth of context.
_SPLIT_MIN_TOKENS = 512


def _decode_partitions(units: int, length: int) -> int:
    threads = torch.get_num_threads()
    if units >= threads or length < 2 * _SPLIT_MIN_TOKENS:
        return 1
    return min(-(-threads // units), length // _SPLIT_MIN_TOKENS)


def _attend_decodes(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tok: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
) -> None:
    """Decodes: one new token each, at position seq_len - 1."""
    n = tok.numel()
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_heads, head_dim = query.shape[1:]
    group = num_heads // num_kv_heads
    length = int(seq_lens.max())
    nb = -(-length // block_size)
    parts = _decode_partitions(n * num_kv_heads, length) if softcap <= 0 else 1
    nb = -(-nb // parts) * parts  # whole blocks per partition; extra columns: the null block
    tables = tables[:, :nb]
    if tables.shape[1] < nb:
        tables = F.pad(tables, (0, nb - tables.shape[1]))
    k, v = _gather(kv_cache, tables.long(), query.dtype)  # [n, Hkv, L, D]
    total = k.shape[2]
    mask = visible_keys((seq_lens - 1)[:, None], total, seq_lens, True, sliding_window)  # [n,1,1,L]
    # Fold the query heads of each K/V head into the query axis: [n, Hkv, group, D].
    q = query[tok].to(k.dtype).view(n, num_kv_heads, group, head_dim)
    if softcap > 0:
        res = _softcapped(q.float(), k.float(), v.float(), mask, scale, softcap)
    elif parts == 1:
        res = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        span = total // parts

        def split(x: torch.Tensor) -> torch.Tensor:  # [a, b, L, c] -> [a*P, b, L/P, c]
            return x.unflatten(2, (parts, span)).transpose(1, 2).flatten(0, 1)

        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        bias = split(bias.transpose(2, 3)).transpose(2, 3)  # [n*P, 1, 1, L/P]
        # A partition with no visible key is weighted 0 below; give it one visible column so
        # the kernel never sees an all-masked row.
        empty = torch.isinf(bias).all(dim=-1, keepdim=True)
        bias[..., :1].masked_fill_(empty, 0.0)
        qp = q[:, None].expand(n, parts, num_kv_heads, group, head_dim).flatten(0, 1)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qp, split(k), split(v), attn_mask=bias, scale=scale
        )
        lse = lse.masked_fill(empty[..., 0], float("-inf")).view(n, parts, num_kv_heads, group)
        w = torch.softmax(lse, dim=1)[..., None]  # merge partitions by their log-sum-exp
        res = (o.view(n, parts, num_kv_heads, group, head_dim) * w).sum(dim=1)
    out.index_copy_(0, tok, res.reshape(n, num_heads, head_dim).to(out.dtype))


def _attend_chunks(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    causal: bool,
) -> None:
    """Prefill chunks / prefix hits: `q_lens [m]` new tokens at the end of `seq_lens [m]`."""
    m = starts.numel()
    block_size = kv_cache.shape[2]
    max_q, length = int(q_lens.max()), int(seq_lens.max())
    k, v = _gather(kv_cache, tables[:, : -(-length // block_size)].long(), query.dtype)
    k, v = k[:, :, :length], v[:, :, :length]
    num_heads, head_dim = query.shape[1:]
    rows = torch.arange(max_q)
    valid = rows[None, :] < q_lens[:, None]  # [m, max_q]
    q_pos = (seq_lens - q_lens)[:, None] + rows[None, :]
    mask = visible_keys(q_pos, length, seq_lens, causal, sliding_window)  # [m, 1, max_q, L]
    if m == 1:  # one chunk: contiguous rows, no padding
        start = int(starts[0])
        q = query[start : start + max_q].to(k.dtype)[None]
    else:
        tok = torch.where(valid, starts[:, None] + rows[None, :], starts[:, None]).flatten()
        q = query.index_select(0, tok).to(k.dtype).view(m, max_q, num_heads, head_dim)
        # Padded query rows see key 0 only, so no row is fully masked; their output is dropped.
        mask = mask | ((~valid)[:, None, :, None] & (torch.arange(length) == 0))
    q = q.transpose(1, 2)  # [m, H, max_q, D]
    if softcap > 0:
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
        res = _softcapped(q.float(), k, v, mask, scale, softcap)
    else:
        res = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    res = res.transpose(1, 2).reshape(m * max_q, num_heads, head_dim).to(out.dtype)
    if m == 1:
        out[start : start + max_q] = res
    else:
        keep = torch.nonzero(valid.flatten()).flatten()
        out.index_copy_(0, tok[keep], res.index_select(0, keep))


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
    if softcap <= 0 and kernels.available():
        # `ember_cpu::paged_attention`: the same op in C++, which calls back into
        # `attend_rest` below for what its decode kernel leaves.
        return torch.ops.ember_cpu.paged_attention(
            query, key, value, kv_cache, slot_mapping, query_start_loc, seq_lens,
            block_tables, scale, sliding_window, softcap, causal,
        )  # fmt: skip
    write_kv(kv_cache, key, value, slot_mapping)
    out = torch.zeros(query.shape, dtype=compute_dtype(kv_cache.dtype, query.dtype))
    attend_rest(
        out, query, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window,
        softcap, causal, _DECODES | _CHUNKS,
    )  # fmt: skip
    return out.to(query.dtype)


# What `attend_rest` attends (the flags the C++ kernel's `attend_step` returns).
_CHUNKS, _DECODES = 1, 2


def attend_rest(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    causal: bool,
    which: int,
) -> None:
    """Attend the prefill chunks (`which & 1`) and/or the decodes (`which & 2`) of a step
    whose K/V are already written, into `out` (rows of the other kind are left alone)."""
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = seq_lens.long()
    # A one-token bidirectional sequence (an encoder input of length 1) is a decode too.
    if which & _DECODES:
        decodes = torch.nonzero(q_lens == 1).flatten()
        if decodes.numel():
            _attend_decodes(
                out, query, kv_cache, qsl[decodes], seq_lens[decodes], block_tables[decodes],
                scale, sliding_window, softcap,
            )  # fmt: skip
    if which & _CHUNKS:
        chunks = torch.nonzero(q_lens > 1).flatten()
        if chunks.numel():
            _attend_chunks(
                out, query, kv_cache, qsl[chunks], q_lens[chunks], seq_lens[chunks],
                block_tables[chunks], scale, sliding_window, softcap, causal,
            )  # fmt: skip


paged_attention_op = define_op(
    "paged_attention", paged_attention, paged_attention_fake, mutates_args=("kv_cache",)
)
# The same op with the cache write left out of its schema, for compiled regions
# (`ember.compile.regions` says why that is sound).
define_op("paged_attention_opaque", paged_attention, paged_attention_fake)
define_op("paged_attention_rest", attend_rest, lambda *args: None, mutates_args=("out",))


def load_op(cpu_isa: str | None = None) -> torch._ops.OpOverloadPacket:
    """The op compiled graphs call: `ember_cpu::paged_attention` when ember's kernels (the
    `cpu_isa` build) load, so decode steps run no Python, else `ember::paged_attention`."""
    if kernels.available(cpu_isa):
        return torch.ops.ember_cpu.paged_attention
    return torch.ops.ember.paged_attention


def load_opaque_op(cpu_isa: str | None = None) -> torch._ops.OpOverloadPacket:
    """`load_op`'s op with the cache write left out of its schema, for compiled regions:
    `ember_cpu::paged_attention_opaque` or `ember::paged_attention_opaque`."""
    if kernels.available(cpu_isa):
        return torch.ops.ember_cpu.paged_attention_opaque
    return torch.ops.ember.paged_attention_opaque
