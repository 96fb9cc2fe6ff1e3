"""A stand-in `intel_extension_for_pytorch` for this torch (IPEX's last release needs torch 2.8),
so the "ipex" backend's own glue (cache layout, argument order and types, decode-only vs mixed
steps) runs in the default suite.

`install(root)` writes a package with a distribution (`dist-info`, version matching torch, which
the backend's availability check reads) under `root`. Its three `PagedAttention` entry points
have IPEX's signatures and layout (`key_cache [num_blocks, num_kv_heads, block_size, head_dim]`)
and check the argument types IPEX's C++ checks; the math is the naive per-sequence float32
attention.
"""

from __future__ import annotations

import os
import textwrap

import torch

SOURCE = textwrap.dedent('''
    """Fake IPEX for ember's tests (tests/attention/fake_ipex.py)."""
    import types

    import torch


    def _check(t, dtype, name):
        assert t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}"


    def _attend(q, k, v, scale, q_pos, k_pos, causal, left):
        """q [Q, H, D], k/v [L, H, D], float32 math; positions decide the mask."""
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        keep = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
        if causal:
            keep &= k_pos[None, :] <= q_pos[:, None]
        if left >= 0:
            keep &= k_pos[None, :] >= q_pos[:, None] - left
        s = s.masked_fill(~keep, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float())


    def _gather(cache, table, length, group):
        """The first `length` tokens of a sequence from `cache [N, Hkv, BS, D]`, as
        [length, H, D] with each K/V head repeated for its `group` query heads."""
        bs = cache.shape[2]
        rows = [cache[int(table[p // bs]), :, p % bs] for p in range(length)]
        return torch.stack(rows).repeat_interleave(group, dim=1)


    class PagedAttention:
        @staticmethod
        def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *args, **kw):
            _check(slot_mapping, torch.int64, "slot_mapping")
            assert key_cache.dim() == 4 and key.dim() == 3, "key [T, Hkv, D], cache 4-D"
            bs = key_cache.shape[2]
            for t, slot in enumerate(slot_mapping.tolist()):
                if slot >= 0:
                    key_cache[slot // bs, :, slot % bs] = key[t]
                    value_cache[slot // bs, :, slot % bs] = value[t]

        @staticmethod
        def single_query_cached_kv_attention(
            output, query, key_cache, value_cache, head_mapping, scale, block_tables,
            context_lens, block_size, max_context_len, alibi_slopes, *args, **kw
        ):
            for t, name in ((head_mapping, "head_mapping"), (block_tables, "block_tables"),
                            (context_lens, "context_lens")):
                _check(t, torch.int32, name)
            assert query.is_contiguous() and block_size == key_cache.shape[2]
            assert alibi_slopes is None
            assert int(context_lens.max()) <= max_context_len
            group = query.shape[1] // key_cache.shape[1]
            assert torch.equal(head_mapping, torch.arange(query.shape[1]).int() // group)
            for i, length in enumerate(context_lens.tolist()):
                k = _gather(key_cache, block_tables[i], length, group)
                v = _gather(value_cache, block_tables[i], length, group)
                pos = torch.arange(length)
                out = _attend(query[i : i + 1], k, v, scale, pos[-1:], pos, True, -1)
                output[i] = out[0].to(output.dtype)

        @staticmethod
        def flash_attn_varlen_func(
            output, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
            max_seqlen_kv, scale, is_causal, block_table, alibi_slopes=None,
            window_size_left=-1, window_size_right=-1, *args, **kw
        ):
            for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_kv, "cu_seqlens_kv"),
                            (block_table, "block_table")):
                _check(t, torch.int32, name)
            assert query.is_contiguous() and alibi_slopes is None
            assert window_size_right == (0 if is_causal else -1)
            group = query.shape[1] // key_cache.shape[1]
            for i in range(len(cu_seqlens_q) - 1):
                qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
                length = int(cu_seqlens_kv[i + 1] - cu_seqlens_kv[i])
                assert qe - qs <= max_seqlen_q and length <= max_seqlen_kv
                k = _gather(key_cache, block_table[i], length, group)
                v = _gather(value_cache, block_table[i], length, group)
                k_pos = torch.arange(length)
                q_pos = k_pos[length - (qe - qs):]
                out = _attend(query[qs:qe], k, v, scale, q_pos, k_pos, is_causal,
                              window_size_left)
                output[qs:qe] = out.to(output.dtype)


    llm = types.SimpleNamespace(modules=types.SimpleNamespace(PagedAttention=PagedAttention))
''')


def install(root: str) -> str:
    """Write the fake package and its distribution metadata under `root`; returns `root`."""
    version = torch.__version__.split("+")[0]
    pkg = os.path.join(root, "intel_extension_for_pytorch")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write(SOURCE)
    info = os.path.join(root, f"intel_extension_for_pytorch-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: intel_extension_for_pytorch\nVersion: {version}\n")
    return root
