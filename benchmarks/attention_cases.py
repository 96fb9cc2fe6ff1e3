"""Op-level paged-attention cases shared by the benchmark suite and `ember bench`-style scripts.

Shapes follow llama-160m's attention (12 heads, 4 KV heads, head_dim 64), fp32 KV cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ember.attention.metadata import build_attention_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16

# name -> list of (num_computed, num_new) per sequence
CASES: dict[str, list[tuple[int, int]]] = {
    "decode_b1_ctx128": [(127, 1)],
    "decode_b8_ctx1k": [(1023, 1)] * 8,
    "decode_b32_ctx128": [(127, 1)] * 32,
    "decode_b32_ctx1k": [(1023, 1)] * 32,
    "decode_b1_ctx4k": [(4095, 1)],
    "decode_b8_ctx4k": [(4095, 1)] * 8,
    "prefill_512": [(0, 512)],
    "mixed_31dec_1k_plus_prefill256": [(1023, 1)] * 31 + [(0, 256)],
}


def make_case(
    specs: list[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layout: Callable[[int, int, int, int], tuple[int, ...]] | None = None,
):
    """Random inputs for one op call; returns (args tuple, bytes of KV read by attention).

    `layout(num_blocks, block_size, num_kv_heads, head_dim)` gives the backend's cache shape.
    """
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-(c + n) // BLOCK_SIZE) for c, n in specs]
    num_blocks = 1 + sum(blocks)
    shape = (layout or (lambda *a: (2, *a)))(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.randn(shape, generator=g).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, start = [], 0
    for nb in blocks:
        tables.append(tuple(perm[start : start + nb]))
        start += nb
    num_tokens = sum(n for _, n in specs)
    meta, _ = build_attention_metadata(
        [c for c, _ in specs],
        [n for _, n in specs],
        tables,
        BLOCK_SIZE,
        max(blocks),
        num_tokens,
        max(len(specs), 2),
    )
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    args = (
        q,
        k,
        v,
        kv_cache,
        meta.slot_mapping,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        HEAD_DIM**-0.5,
        0,
        0.0,
        True,
    )
    kv_bytes = sum(c + n for c, n in specs) * 2 * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()
    return args, kv_bytes
