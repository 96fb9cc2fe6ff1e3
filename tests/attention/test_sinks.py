"""Attention sinks (`ember::sink_scale`) against a naive oracle: each head's learned logit
joins the softmax's denominator as a key with a zero value (gpt-oss, Granite-SWA)."""

from __future__ import annotations

import pytest
import torch

from ember.attention import select_backend
from ember.attention.metadata import build_attention_metadata
from ember.attention.ops import dequantize_kv_rows, kv_row_width, quantize_kv_rows, write_kv
from tests.attention.reference import ref_attention


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (6, 0.0), (0, 5.0)])
def test_sinks_match_the_oracle_in_a_mixed_batch(kv_dtype, window, softcap):
    g = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    specs = [(9, 1), (0, 11), (5, 3), (12, 1)]  # (computed, new): decodes, a prefill, a chunk
    op = select_backend("torch").load_op()
    num_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in specs)
    cache = torch.zeros(
        2, num_blocks, block_size, num_kv_heads, kv_row_width(head_dim, kv_dtype), dtype=kv_dtype
    )
    tables, ks, vs, next_block = [], [], [], 1
    for c, n in specs:
        nb = -(-(c + n) // block_size)
        tables.append(tuple(range(next_block, next_block + nb)))
        next_block += nb
        ks.append(torch.randn(c + n, num_kv_heads, head_dim, generator=g))
        vs.append(torch.randn(c + n, num_kv_heads, head_dim, generator=g))
    meta, _ = build_attention_metadata(
        [c for c, _ in specs], [n for _, n in specs], tables, block_size,
        max_blocks=max(len(t) for t in tables), num_tokens_padded=sum(n for _, n in specs) + 2,
        num_seqs_padded=len(specs),
    )  # fmt: skip
    for (c, _n), table, k, v in zip(specs, tables, ks, vs):  # the history, already cached
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(c)]
        )
        write_kv(cache, k[:c], v[:c], slots.long())
    tokens = meta.slot_mapping.shape[0]
    query = torch.randn(tokens, num_heads, head_dim, generator=g)
    key = torch.zeros(tokens, num_kv_heads, head_dim)
    value = torch.zeros(tokens, num_kv_heads, head_dim)
    start = 0
    for (c, n), k, v in zip(specs, ks, vs):
        key[start : start + n], value[start : start + n] = k[c:], v[c:]
        start += n
    sinks = torch.randn(num_heads, generator=g) * 2
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables)
    scale = head_dim**-0.5
    out = op(query, key, value, cache, meta.slot_mapping, *args, scale, window, softcap, True)
    got = torch.ops.ember.sink_scale(out, query, cache, *args, sinks, scale, window, softcap, True)
    start = 0
    for (_c, n), k, v in zip(specs, ks, vs):
        if kv_dtype == torch.int8:  # what the cache holds
            k, v = dequantize_kv_rows(quantize_kv_rows(k)), dequantize_kv_rows(quantize_kv_rows(v))
        want = ref_attention(query[start : start + n], k, v, scale, True, window, softcap, sinks)
        torch.testing.assert_close(got[start : start + n], want, atol=1e-4, rtol=1e-4)
        start += n
    assert not got[start:].any()  # padding rows stay zero
    # without the sinks, the op's rows differ (the test would catch a no-op)
    assert not torch.allclose(got[:start], out[:start], atol=1e-3)
