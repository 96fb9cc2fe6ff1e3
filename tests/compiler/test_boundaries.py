"""The opaque-op list (`ember.compile.boundaries`) names real ops, each registered by the module
it names, and the ops not opchecked elsewhere pass `torch.library.opcheck`."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from ember import kernels
from ember.compile.boundaries import OPAQUE_OPS, register


def _optional_backend_missing(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return True
    return False


@pytest.mark.parametrize("op", sorted(OPAQUE_OPS))
def test_each_listed_op_is_registered_by_its_module(op):
    module = OPAQUE_OPS[op]
    if module.startswith("ember.attention.") and _optional_backend_missing(module):
        pytest.skip(f"{module} needs an optional library")
    if module == "ember.kernels" and not kernels.available():
        pytest.skip("no C++ compiler")
    register(op)
    namespace, name = op.split("::")
    assert hasattr(getattr(torch.ops, namespace), name)


def test_every_cpp_op_is_listed():
    source = open(kernels.SOURCES[0]).read()
    defined = set(re.findall(r'm\.def\(\s*"(\w+)\(', source))
    assert defined and {f"ember_cpu::{d}" for d in defined} <= set(OPAQUE_OPS)


def test_write_kv_cache_opcheck_and_reference():
    register("ember::write_kv_cache")
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 4, 4, 2, 8)
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([3, 4, 9, 10, 15])
    torch.ops.ember.write_kv_cache(cache, key, value, slots)
    assert torch.equal(cache[0].view(-1, 2, 8)[slots], key)
    assert torch.equal(cache[1].view(-1, 2, 8)[slots], value)
    torch.library.opcheck(torch.ops.ember.write_kv_cache.default, (cache, key, value, slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_attention_ranges_opcheck_and_reference(dtype):
    """Each token attends its own [start, end) of its sequence's paged cross K/V (GQA: 4 query
    heads on 2 K/V heads); an empty range gives zeros. Against dense softmax attention per
    token."""
    register("ember::cross_attention_ranges")
    g = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    cache = torch.randn(2, 12, block_size, kv_heads, dim, generator=g).to(dtype)
    lens = [10, 0, 7, 0]  # the second sequence is text-only, the last one padding
    tables = torch.tensor([[3, 5, 1, 0], [0, 0, 0, 0], [9, 2, 0, 0], [0, 0, 0, 0]])
    qsl = torch.tensor([0, 3, 5, 6, 6], dtype=torch.int32)
    ranges = torch.tensor([[0, 10], [4, 10], [2, 3], [0, 0], [0, 0], [1, 7]], dtype=torch.int32)
    query = torch.randn(6, heads, dim, generator=g).to(dtype)
    args = (query, cache, qsl, torch.tensor(lens, dtype=torch.int32), tables, ranges, 0.3)
    out = torch.ops.ember.cross_attention_ranges(*args)
    seq_of = [0, 0, 0, 1, 1, 2]
    for t in range(6):
        s, (lo, hi) = seq_of[t], ranges[t].tolist()
        if lo == hi:
            assert not out[t].any()
            continue
        rows = [
            int(tables[s, j // block_size]) * block_size + j % block_size for j in range(lo, hi)
        ]
        k = cache[0].reshape(-1, kv_heads, dim)[rows].float().repeat_interleave(2, dim=1)
        v = cache[1].reshape(-1, kv_heads, dim)[rows].float().repeat_interleave(2, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", query[t].float(), k) * 0.3, dim=-1)
        want = torch.einsum("hl,lhd->hd", p, v)
        torch.testing.assert_close(
            out[t].float(), want, atol=1e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2
        )
    torch.library.opcheck(torch.ops.ember.cross_attention_ranges.default, args)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_fp32_math_and_opcheck(rows, bias):
    if not kernels.available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 67, generator=g)  # odd K: the scalar tail of the SIMD loop
    w = torch.randn(45, 67, generator=g).bfloat16()
    b = torch.randn(45, generator=g) if bias else None
    out = torch.ops.ember_cpu.bf16_linear(x, w, b)
    ref = torch.nn.functional.linear(x, w.float(), b)
    # Steps past the GEMV size run ATen's bf16 GEMM (bf16 activations): a looser bar there.
    tol = 1e-4 if rows <= 8 else 5e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * 10)
    torch.library.opcheck(torch.ops.ember_cpu.bf16_linear.default, (x, w, b))


def test_compile_cache_key_covers_the_rewritten_model_structure(checkpoint_dir):
    """Graphs compiled for one rewrite of the model (GEMV or packed linears, a packed tied
    head) are keyed apart: the key hashes module types and tensor names, shapes and dtypes."""
    from transformers import AutoModelForCausalLM

    from ember.compile.cache import modules_fingerprint
    from ember.model.layers.rewrite import use_kernel_linears_

    d = checkpoint_dir("tiny-qwen2", tie_word_embeddings=True)
    a, b = (AutoModelForCausalLM.from_pretrained(d) for _ in range(2))
    assert modules_fingerprint(a) == modules_fingerprint(b)
    use_kernel_linears_(b, torch.float32)
    assert modules_fingerprint(a) != modules_fingerprint(b)
