"""Every attention backend against the per-sequence float32 oracle.

"torch" always runs; "triton" runs its kernel in Triton's CPU interpreter (TRITON_INTERPRET=1)
when triton is installed; "ipex" runs IPEX when it imports and matches torch, else its stand-in
(`fake_ipex.py`: IPEX's entry points over the naive attention), so the backend's glue runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from ember.attention import BackendUnavailableError, select_backend
from ember.attention.metadata import build_attention_metadata
from ember.attention.ops import dequantize_kv_rows, kv_row_width, quantize_kv_rows
from tests.attention.reference import ref_attention

pytestmark = pytest.mark.host_isa  # on this CPU and as an AVX2-only host: tests/host_isa.py

# int8: against the oracle over the dequantized K/V (what the cache holds), so only the order of
# the scale's multiply differs.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.int8: 1e-4}
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"]
)
BACKENDS = ["torch", "triton", "ipex"]


def load_backend(name: str):
    """(backend, op) or a skip naming why the backend is unavailable here."""
    try:
        backend = select_backend(name)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    return backend, backend.load_op()


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "ipex":  # IPEX's stand-in where IPEX cannot be installed
        request.getfixturevalue("fake_ipex")
    return load_backend(request.param)


def _to_layout(kv_cache, backend):
    """Our test caches are built as [2, N, block_size, Hkv, D]; view them in `backend`'s layout
    (and back: the transposition is its own inverse)."""
    if backend.kv_layout == "blocks_heads_slots":
        return kv_cache.transpose(2, 3).contiguous()
    return kv_cache


def _cache_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V values as a cache of `dtype` holds them: an int8 cache's rows (codes and scale)."""
    return quantize_kv_rows(x) if dtype == torch.int8 else x.to(dtype)


def _needs_int8_cache(backend, dtype) -> None:
    if dtype == torch.int8 and torch.int8 not in backend[0].kv_dtypes:
        pytest.skip(f"the {backend[0].name} backend keeps no int8 KV cache")


def _run_case(
    backend,
    seq_specs,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    causal=True,
    sliding_window=0,
    softcap=0.0,
    seed=0,
    pad_tokens=0,
    pad_seqs=0,
    query_dtype=None,
):
    """seq_specs: list of (num_computed, num_new). Returns (op output, oracle outputs).
    `query_dtype`: the queries' and the new K/V's dtype when it differs from the cache's
    `dtype` (the K/V values are `dtype`'s either way, so the oracle sees what the cache holds)."""
    _needs_int8_cache(backend, dtype)
    act = query_dtype or (torch.float32 if dtype == torch.int8 else dtype)
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in seq_specs) + 3
    row = kv_row_width(head_dim, dtype)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, row, dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered, never block 0
    tables, full_k, full_v = [], [], []
    for c, n in seq_specs:
        nb = -(-(c + n) // block_size)
        table = tuple(perm[:nb])
        perm = perm[nb:]
        tables.append(table)
        k = torch.randn(c + n, num_kv_heads, head_dim, generator=g)
        v = torch.randn(c + n, num_kv_heads, head_dim, generator=g)
        # values the cache (or, for an int8 cache, the queries' dtype) holds exactly
        k, v = (
            k.to(act if dtype == torch.int8 else dtype),
            v.to(act if dtype == torch.int8 else dtype),
        )
        for p in range(c):  # history already in the cache
            kv_cache[0, table[p // block_size], p % block_size] = _cache_values(k[p], dtype)
            kv_cache[1, table[p // block_size], p % block_size] = _cache_values(v[p], dtype)
        full_k.append(k)
        full_v.append(v)
    num_tokens = sum(n for _, n in seq_specs)
    meta, _ = build_attention_metadata(
        [c for c, _ in seq_specs],
        [n for _, n in seq_specs],
        tables,
        block_size,
        max_blocks=max(len(t) for t in tables) + 2,
        num_tokens_padded=num_tokens + pad_tokens,
        num_seqs_padded=len(seq_specs) + pad_seqs,
    )
    T = num_tokens + pad_tokens
    query = torch.randn(T, num_heads, head_dim, generator=g).to(act)
    key = torch.zeros(T, num_kv_heads, head_dim, dtype=act)
    value = torch.zeros(T, num_kv_heads, head_dim, dtype=act)
    start = 0
    for (c, n), k, v in zip(seq_specs, full_k, full_v):
        key[start : start + n], value[start : start + n] = k[c:], v[c:]
        start += n
    scale = head_dim**-0.5
    backend, op = backend
    kv_cache = _to_layout(kv_cache, backend)
    out = op(
        query,
        key,
        value,
        kv_cache,
        meta.slot_mapping,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        sliding_window,
        softcap,
        causal,
    )
    refs, start = [], 0
    for (c, n), k, v in zip(seq_specs, full_k, full_v):
        if dtype == torch.int8:  # what the cache holds
            k, v = dequantize_kv_rows(quantize_kv_rows(k)), dequantize_kv_rows(quantize_kv_rows(v))
        refs.append(
            ref_attention(query[start : start + n], k, v, scale, causal, sliding_window, softcap)
        )
        start += n
    # The cache now holds every token's K/V at its slot.
    kv_cache = _to_layout(kv_cache, backend)
    for table, k, v in zip(tables, full_k, full_v):
        for p in range(len(k)):
            blk, off = table[p // block_size], p % block_size
            # An int8 cache's rows are the same bytes from either writer (C++ and Python).
            torch.testing.assert_close(kv_cache[0, blk, off], _cache_values(k[p], dtype))
            torch.testing.assert_close(kv_cache[1, blk, off], _cache_values(v[p], dtype))
    return out, refs, num_tokens


CASES = {
    "decode": [(7, 1), (30, 1), (1, 1), (16, 1)],
    "prefill": [(0, 9), (0, 17)],
    "mixed": [(12, 1), (0, 11), (5, 1), (0, 3)],
    "prefix_hit": [(16, 5), (8, 9), (20, 1)],
    "single_token_prompt": [(0, 1)],
    "long_chunks_mixed": [(0, 40), (3, 1), (24, 33), (0, 5)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@DTYPES
def test_paged_attention_matches_reference(backend, case, heads, block_size, dtype):
    out, refs, _ = _run_case(backend, CASES[case], heads[0], heads[1], 16, block_size, dtype)
    start = 0
    for ref in refs:
        n = ref.shape[0]
        torch.testing.assert_close(
            out[start : start + n].float(), ref, atol=TOL[dtype], rtol=TOL[dtype]
        )
        start += n


@pytest.mark.parametrize("head_dim", [64, 72, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@DTYPES
def test_paged_attention_decodes_at_model_head_dims(backend, head_dim, block_size, dtype):
    """Real head sizes (72: not a multiple of AVX-512's 16 lanes), contexts that end mid-block
    and mid-vector, several blocks, GQA."""
    specs = [(4, 1), (40, 1), (77, 1), (130, 1), (15, 1)]
    out, refs, _ = _run_case(backend, specs, 8, 2, head_dim, block_size, dtype, seed=3)
    torch.testing.assert_close(
        out[: len(refs)].float(), torch.cat(refs), atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.parametrize("head_dim", [64, 72])
@DTYPES
@pytest.mark.parametrize("window", [0, 9])
def test_paged_attention_many_decodes(backend, head_dim, dtype, window):
    """More decoding sequences than 4x the threads: the C++ kernel gives each task all of a
    sequence's K/V heads (a block's rows read contiguously), not one head."""
    rng = torch.Generator().manual_seed(5)
    n = 4 * torch.get_num_threads() + 2
    specs = [(int(torch.randint(1, 70, (1,), generator=rng)), 1) for _ in range(n)]
    out, refs, _ = _run_case(
        backend, specs, 8, 2, head_dim, 16, dtype, seed=7, sliding_window=window
    )
    torch.testing.assert_close(
        out[: len(refs)].float(), torch.cat(refs), atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.parametrize("specs", [[(299, 1)], [(516, 1), (40, 1)], [(20, 1)]], ids=str)
@DTYPES
@pytest.mark.parametrize("window", [0, 100])
def test_paged_attention_splits_few_long_decodes(backend, specs, dtype, window):
    """Fewer decodes than threads have work for: the C++ kernel splits each context into parts
    (of at least 32 tokens; parts with no positions in a short sequence or outside the window)
    and merges them by their log-sum-exp."""
    out, refs, _ = _run_case(backend, specs, 8, 2, 64, 16, dtype, seed=9, sliding_window=window)
    torch.testing.assert_close(
        out[: len(refs)].float(), torch.cat(refs), atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_paged_attention_long_chunks_beside_short_ones_and_decodes(monkeypatch, causal):
    """A step whose chunks' query rows see more positions in all than the C++ kernel takes on
    (2^18; an 800-token prompt alone is 320,400 causal) leaves them to the PyTorch code, the
    decodes still attended in C++; without the long one, every chunk row is attended in C++.
    Against the pure-PyTorch path (SDPA for the chunks; the naive reference would take a
    minute over 800 rows), the torch backend only."""
    from benchmarks.attention_cases import make_case
    from ember import kernels
    from ember.attention import torch_cpu

    if not kernels.available():
        pytest.skip("ember's C++ kernels are not built here")
    for specs in ([(0, 800), (100, 1), (50, 30), (7, 1)], [(100, 1), (50, 30), (0, 61), (7, 1)]):
        args, _ = make_case(specs, seed=3)
        args = (*args[:3], args[3].clone(), *args[4:11], causal)
        got = torch.ops.ember_cpu.paged_attention(*args)
        with monkeypatch.context() as m:
            m.setattr(kernels, "available", lambda isa=None: False)
            want = torch_cpu.paged_attention(*args)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 5, 13])
def test_paged_attention_sliding_window(backend, window):
    out, refs, _ = _run_case(
        backend, CASES["mixed"] + [(20, 4)], 4, 2, 8, 4, torch.float32, sliding_window=window
    )
    torch.testing.assert_close(
        out[: sum(r.shape[0] for r in refs)], torch.cat(refs), atol=2e-5, rtol=2e-5
    )


def test_paged_attention_bidirectional(backend):
    out, refs, _ = _run_case(backend, [(0, 7), (0, 12)], 4, 2, 8, 4, torch.float32, causal=False)
    torch.testing.assert_close(out, torch.cat(refs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_paged_attention_softcap(backend, dtype):
    if not backend[0].softcap:
        pytest.skip(f"backend {backend[0].name} has no soft-capping")
    out, refs, _ = _run_case(backend, CASES["mixed"], 4, 2, 8, 4, dtype, softcap=0.5)
    torch.testing.assert_close(out, torch.cat(refs), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_int8_cache(backend, query_dtype, window):
    """An int8 cache (codes and a scale per token and K/V head) under float32 or bfloat16
    queries: decodes, chunks and prefix hits, at a head size of whole vectors (64: the tiles
    and the SIMD decode) and one of neither (40), against the oracle over the dequantized
    K/V; the cache's bytes equal the Python writer's."""
    specs = [(37, 1), (0, 23), (20, 9), (3, 1)]
    for head_dim in (64, 40):
        out, refs, n = _run_case(
            backend, specs, 8, 2, head_dim, 16, torch.int8, sliding_window=window,
            query_dtype=query_dtype,
        )  # fmt: skip
        tol = 1e-4 if query_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[:n].float(), torch.cat(refs), atol=tol, rtol=tol)


def test_int8_cache_rows_round_trip():
    """quantize_kv_rows: a scale per row (max |x| / 127), codes within [-127, 127], a zero row
    all zero, and each value back within half a step."""
    x = torch.randn(5, 3, 64) * torch.tensor([1e-3, 1.0, 50.0])[None, :, None]
    x[2, 1] = 0.0
    rows = quantize_kv_rows(x)
    assert rows.shape == (5, 3, 68) and rows.dtype == torch.int8
    back = dequantize_kv_rows(rows)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 + 1e-7).all())
    assert int(rows[..., :64].abs().max()) == 127
    assert torch.count_nonzero(rows[2, 1]) == 0


def test_paged_attention_padding_rows_are_zero_and_harmless(backend):
    out, refs, n = _run_case(
        backend, CASES["mixed"], 4, 2, 8, 4, torch.float32, pad_tokens=5, pad_seqs=3
    )
    torch.testing.assert_close(out[:n], torch.cat(refs), atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(out[n:]) == 0


def _opcheck_args(backend, softcap: float = 0.0, kv_dtype=torch.float32) -> tuple:
    """A mixed step for opcheck (a decode and a 6-token prefill, padded to 9 tokens and 3
    sequences): 4 query heads on 2 K/V heads of 8, 4-token blocks."""
    block_size, H, Hkv, D = 4, 4, 2, 8
    shape = backend.kv_cache_shape(8, block_size, Hkv, D, kv_dtype)
    kv_cache = _cache_values(torch.randn(*shape[:-1], D), kv_dtype)
    meta, _ = build_attention_metadata([3, 0], [1, 6], [(1, 2), (3, 4)], block_size, 4, 9, 3)
    return (
        torch.randn(9, H, D), torch.randn(9, Hkv, D), torch.randn(9, Hkv, D), kv_cache,
        meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables, D**-0.5, 0,
        softcap, True,
    )  # fmt: skip


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_paged_attention_opcheck(backend, kv_dtype):
    _needs_int8_cache(backend, kv_dtype)
    backend, op = backend
    args = _opcheck_args(backend, kv_dtype=kv_dtype)
    utils = (
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    )
    if backend.name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        # AOT dispatch traces through the kernel launch, which the CPU interpreter cannot run
        # on traced tensors; on a GPU the full check runs.
        utils = utils[:3]
    torch.library.opcheck(op.default, args, test_utils=utils)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("op_name", ["ember::paged_attention", "ember_cpu::paged_attention"])
def test_torch_backend_ops_agree_and_opcheck(op_name, softcap):
    """The torch backend's two registrations of the op: the C++ one (which calls back into
    `ember::paged_attention_rest` for prefill chunks and into the Python op for soft-capping)
    and the Python one; both give the oracle's output on a mixed step."""
    from ember import kernels

    if op_name.startswith("ember_cpu") and not kernels.available():
        pytest.skip("no C++ compiler")
    load_backend("torch")
    namespace, name = op_name.split("::")
    op = getattr(getattr(torch.ops, namespace), name)
    backend = select_backend("torch")
    out, refs, n = _run_case(
        (backend, op), CASES["mixed"], 4, 2, 8, 4, torch.float32, softcap=softcap
    )
    torch.testing.assert_close(out[:n], torch.cat(refs), atol=2e-5, rtol=2e-5)
    torch.library.opcheck(op.default, _opcheck_args(backend, softcap))


@pytest.mark.parametrize(
    "op_name", ["ember::paged_attention_opaque", "ember_cpu::paged_attention_opaque"]
)
def test_opaque_ops_are_the_ops_without_the_cache_in_their_schema(op_name):
    """Compiled regions (`ember.compile.regions`) call the torch backend's op under a schema
    that declares no mutation: the same arguments and result, the same output on the oracle's
    mixed step (whose prefill reads what the op wrote to the cache). opcheck without its
    schema test, which by design would find the undeclared cache write."""
    from ember import kernels

    if op_name.startswith("ember_cpu") and not kernels.available():
        pytest.skip("no C++ compiler")
    load_backend("torch")
    namespace, name = op_name.split("::")
    opaque = getattr(getattr(torch.ops, namespace), name).default
    plain = getattr(torch.ops, namespace).paged_attention.default
    assert not opaque._schema.is_mutable and plain._schema.is_mutable
    assert [a.name for a in opaque._schema.arguments] == [a.name for a in plain._schema.arguments]
    assert [str(a.type) for a in opaque._schema.arguments] == [
        str(a.type) for a in plain._schema.arguments
    ]
    backend = select_backend("torch")
    out, refs, n = _run_case(
        (backend, getattr(getattr(torch.ops, namespace), name)), CASES["mixed"], 4, 2, 8, 4,
        torch.float32,
    )  # fmt: skip
    torch.testing.assert_close(out[:n], torch.cat(refs), atol=2e-5, rtol=2e-5)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(opaque, _opcheck_args(backend), test_utils=utils)


def test_cpp_decode_kernel_builds_here():
    """The C++ decode path is the one the engine takes on this machine (g++ is present, as
    inductor needs it too), so the oracle cases above exercise it."""
    from ember import kernels

    assert kernels.available()


@pytest.mark.parametrize("case", ["decode", "mixed", "prefix_hit"])
@DTYPES
def test_torch_backend_pytorch_fallback_without_cpp_kernels(monkeypatch, case, dtype):
    """Where ember's C++ kernels cannot be built, decodes take the pure-PyTorch path."""
    from ember import kernels

    monkeypatch.setattr(kernels, "available", lambda isa=None: False)
    out, refs, _ = _run_case(load_backend("torch"), CASES[case], 4, 2, 16, 4, dtype)
    torch.testing.assert_close(
        out[: sum(r.shape[0] for r in refs)].float(),
        torch.cat(refs),
        atol=TOL[dtype],
        rtol=TOL[dtype],
    )
