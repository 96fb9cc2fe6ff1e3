"""Every attention op's shape function gives the strides its real output has.

Inductor lays out a custom op's output by the fake's strides. `empty_like(query)` kept the
strides of a transposed query (Persimmon, gpt-oss and MiMo-V2-Flash give attention one) while
the ops return a contiguous tensor, so the compiled graphs read the output at the wrong
offsets and decoded other tokens than eager, with no error.
"""

from __future__ import annotations

import pytest
import torch

from ember import kernels
from ember.attention import select_backend
from ember.attention.metadata import build_attention_metadata
from ember.attention.ops import paged_attention_fake

pytestmark = pytest.mark.host_isa


def _transposed_query_case():
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    specs = [(3, 1), (0, 6)]
    meta, _ = build_attention_metadata(
        [c for c, _ in specs], [n for _, n in specs], [(1, 2), (3, 4)], block_size,
        max_blocks=2, num_tokens_padded=8, num_seqs_padded=2,
    )  # fmt: skip
    tokens = meta.slot_mapping.shape[0]
    # [H, T, D] memory, seen as [T, H, D]: what `query[0].transpose(0, 1)` is for a model
    # whose query reaches attention as a contiguous [B, H, T, D]
    query = torch.randn(num_heads, tokens, head_dim).transpose(0, 1)
    assert not query.is_contiguous()
    key = torch.randn(tokens, num_kv_heads, head_dim)
    value = torch.randn(tokens, num_kv_heads, head_dim)
    cache = torch.zeros(2, 5, block_size, num_kv_heads, head_dim)
    return query, key, value, cache, meta


@pytest.mark.parametrize("which", ["op", "opaque_op", "python"])
def test_the_paged_ops_output_has_the_fakes_strides(which):
    query, key, value, cache, meta = _transposed_query_case()
    backend = select_backend("torch")
    if which == "python":
        from ember.attention.torch_cpu import paged_attention as op
    elif which == "op":
        op = backend.load_op()
    else:
        op = backend.load_opaque_op()
    args = (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    out = op(query, key, value, cache, *args, 0.25, 0, 0.0, True)
    fake = paged_attention_fake(query)
    assert out.shape == fake.shape and out.stride() == fake.stride()
    if kernels.available() and which != "python":
        c_fake = kernels._attention_fake(query)
        assert out.stride() == c_fake.stride()


def test_the_sink_and_cross_attention_ops_output_has_the_fakes_strides():
    query, key, value, cache, meta = _transposed_query_case()
    op = select_backend("torch").load_op()
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables)
    out = op(query, key, value, cache, meta.slot_mapping, *args, 0.25, 0, 0.0, True)
    sunk = torch.ops.ember.sink_scale(out, query, cache, *args, torch.zeros(4), 0.25, 0, 0.0, True)
    assert sunk.stride() == out.stride()
    ranges = torch.zeros(query.shape[0], 2, dtype=torch.int32)
    cross = torch.ops.ember.cross_attention_ranges(
        query, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, ranges, 0.25
    )
    assert cross.stride() == paged_attention_fake(query).stride()
