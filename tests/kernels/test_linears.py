"""ember's linear kernels against float64 / fp32 references at odd sizes and opcheck: the packed
kernel (fp32, bf16 and int8 weights: every row-block size, k slices, partial panels) and the
[N, K]-layout ones (GEMV, tiles, whole widening). The AVX2 build runs the same checks in every
test's `[avx2-host]` run (tests/host_isa.py)."""

from __future__ import annotations

import pytest
import torch

from ember import kernels
from tests.conftest import group_quantized_x
from tests.kernels import needs_compiler

pytestmark = [
    needs_compiler,  # skipped where there is no C++ compiler at all, never on a failed build
    pytest.mark.host_isa,  # the x86-64-v3 build too: tests/host_isa.py
]

# Built and loaded at import (module-level marks read the build: `needs_pairs`); a failed
# build is logged here, and raised by `_built`.
kernels.available()


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    kernels.load()  # a failed build fails every test of the module, with the compiler's output


# The register-blocked GEMV (<= 64 rows; fp32 weights <= 16), then whole-weight widening into
# one GEMM (fp32 weights: ATen's GEMM); odd row counts hit every block remainder (4 rows each).
ROWS = [1, 3, 8, 9, 16, 17, 33, 64, 65, 130]


def _case(rows: int, n: int = 45, k: int = 67, bias: bool = True):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_linear_matches_aten(rows, bias):
    x, w, b = _case(rows, bias=bias)
    torch.testing.assert_close(
        torch.ops.ember_cpu.fp32_linear(x, w, b), torch.nn.functional.linear(x, w, b)
    )


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [45, 300])
def test_bf16_weights_fp32_activations_match_fp32_math(rows, n):
    x, w, b = _case(rows, n=n)
    wb = w.bfloat16()
    out = torch.ops.ember_cpu.bf16_linear(x, wb, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.nn.functional.linear(x, wb.float(), b))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_activations_match_fp32_math_rounded_once(rows, bias):
    """bf16 x (native bf16 CPUs): decodes run the GEMV in fp32 and round the result to bf16
    once; larger steps run ATen's bf16 GEMM."""
    x, w, b = _case(rows, bias=bias)
    xb, wb = x.bfloat16().view(1, rows, -1), w.bfloat16()
    bb = b.bfloat16() if b is not None else None
    out = torch.ops.ember_cpu.bf16_linear(xb, wb, bb)
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows, wb.shape[0])
    ref = torch.nn.functional.linear(xb.float(), wb.float(), bb.float() if bias else None)
    if rows <= 8:  # one rounding of the fp32 result: at most one bf16 step apart
        torch.testing.assert_close(out.float(), ref.bfloat16().float(), atol=1e-2, rtol=2**-7)
    else:
        torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.02)


def test_weights_too_large_to_widen_whole_run_in_tiles():
    """Past 2^25 elements a weight is widened in tiles of 128 rows per thread (the last one
    partial), not into one buffer."""
    x, w, b = _case(65, n=32771, k=1025)
    wb = w.bfloat16()
    out = torch.ops.ember_cpu.bf16_linear(x, wb, b)
    ref = torch.nn.functional.linear(x, wb.float(), b)  # |values| ~ 32: sums of 1025 products
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_linears_keep_leading_dims_and_opcheck():
    x, w, b = _case(6)
    x3 = x.view(2, 3, -1)
    assert torch.ops.ember_cpu.fp32_linear(x3, w, b).shape == (2, 3, 45)
    for rows in (2, 12):
        x, w, b = _case(rows)
        torch.library.opcheck(torch.ops.ember_cpu.fp32_linear.default, (x, w, b))
        torch.library.opcheck(torch.ops.ember_cpu.bf16_linear.default, (x, w.bfloat16(), b))
        xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
        torch.library.opcheck(torch.ops.ember_cpu.bf16_linear.default, (xb, wb, bb))


PACKED_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
PACKED_IDS = ["fp32", "bf16", "fp16", "int8"]


def _packed_case(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool = True):
    g = torch.Generator().manual_seed(rows * 7919 + n * 31 + k)
    x = torch.randn(rows, k, generator=g)
    if dtype == torch.int8:
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scales = torch.rand(n, generator=g) + 0.01
    else:
        w, scales = torch.randn(n, k, generator=g).to(dtype), None
    b = torch.randn(n, generator=g) if bias else None
    ref = x.double() @ w.double().t()
    if scales is not None:
        ref = ref * scales.double()
    if b is not None:
        ref = ref + b.double()
    return x, w, scales, b, ref


# Every row-block size (up to 12 rows per block with AVX-512, 6 with AVX2; M = 1 has its own
# loop), balanced splits (13 = 7 + 6) and many blocks.
PACKED_ROWS = [1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 25, 64, 130]


@pytest.mark.parametrize("dtype", PACKED_DTYPES, ids=PACKED_IDS)
@pytest.mark.parametrize("rows", PACKED_ROWS)
def test_packed_linear_matches_float64(dtype, rows):
    # n = 45: one full panel plus a partial one (16-wide AVX2 panels: 2 full + 13); k = 67: no
    # multiple of the 4-k unroll
    x, w, scales, b, ref = _packed_case(rows, 45, 67, dtype)
    packed = torch.ops.ember_cpu.pack_linear_weight(w)
    out = torch.ops.ember_cpu.packed_linear(x, packed, scales, b, 45)
    assert out.dtype == torch.float32 and out.shape == (rows, 45)
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-4)  # fp32 sums of 67 terms


@pytest.mark.parametrize("dtype", PACKED_DTYPES, ids=PACKED_IDS)
@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 2050), (257, 1030), (64, 1024), (33, 4100)])
@pytest.mark.parametrize("rows", [1, 4, 19, 130])
def test_packed_linear_odd_shapes_and_k_slices(dtype, n, k, rows):
    """k past one 1024-deep slice (partial sums carried in y), a single channel, panels of
    exactly the width (n = 64: across the row-block split of two panels too); k = 1024 (rows
    4 KiB apart: more than 4 are copied to a longer stride); 130 rows of k = 4100 go through x
    in two 2 MiB chunks."""
    x, w, scales, b, ref = _packed_case(rows, n, k, dtype, bias=n != 64)
    out = torch.ops.ember_cpu.packed_linear(
        x, torch.ops.ember_cpu.pack_linear_weight(w), scales, b, n
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-4)  # up to 2050 terms


def test_pack_layout_is_panels_of_output_channels():
    panel = kernels.panel_width()
    assert panel in (16, 32)  # two vectors: AVX2 / AVX-512
    w = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    packed = torch.ops.ember_cpu.pack_linear_weight(w)
    assert packed.shape == (-(-50 // panel), 3, panel)
    for n in (0, 17, 49):
        assert torch.equal(packed[n // panel, :, n % panel], w[n])
    assert not packed[-1, :, 50 % panel :].any()  # zeros past N
    assert torch.equal(torch.ops.ember_cpu.pack_linear_weight(w.bfloat16()).float(), packed)
    assert torch.equal(torch.ops.ember_cpu.pack_linear_weight(w.half()).float(), packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_linear_from_weights_packs_as_the_kernel_packs_their_rows_side_by_side(dtype):
    """Parts of odd sizes (the last one ends inside a panel), a bias on some parts only, a
    row permutation gathered a chunk at a time (wider than one chunk), as a GGUF load packs
    a fused projection straight from the file."""
    from ember.model.layers.packed import PackedLinear
    from ember.model.layers.panels import row_chunk

    panel = kernels.panel_width()
    k = 67
    g = torch.Generator().manual_seed(3)
    sizes = [2 * panel, row_chunk(k) + panel, 45]
    ws = [torch.randn(n, k, generator=g).to(dtype) for n in sizes]
    biases = [None, torch.randn(sizes[1], generator=g), None]
    order = torch.randperm(sizes[1], generator=g)
    read: list[tuple[int, int, int]] = []
    linear = PackedLinear.from_weights(
        list(zip(ws, biases, strict=True)), [None, order, None], lambda *r: read.append(r)
    )
    # Rows are reported read a chunk at a time, a permuted part's all at once.
    assert read == [(0, 0, sizes[0]), (1, 0, sizes[1]), (2, 0, 45)]
    rows = torch.cat([ws[0], ws[1][order], ws[2]])
    assert torch.equal(linear.packed, torch.ops.ember_cpu.pack_linear_weight(rows))
    assert linear.in_features == k and linear.out_features == sum(sizes)
    assert torch.equal(linear.bias, torch.cat([torch.zeros(sizes[0]), biases[1], torch.zeros(45)]))
    x = torch.randn(5, k, generator=g)
    ref = x.double() @ rows.double().T + linear.bias.double()
    torch.testing.assert_close(linear(x).double(), ref, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="multiple of"):
        PackedLinear.from_weights([(ws[2], None), (ws[0], None)])
    with pytest.raises(ValueError, match="dtype or input size"):
        PackedLinear.from_weights([(ws[0], None), (ws[2][:, :60], None)])


def test_packed_linear_contract():
    x, w, scales, b, _ = _packed_case(5, 45, 67, torch.int8)
    packed = torch.ops.ember_cpu.pack_linear_weight(w)
    out = torch.ops.ember_cpu.packed_linear(x.view(1, 5, 67).bfloat16(), packed, scales, b, 45)
    assert out.shape == (1, 5, 45) and out.dtype == torch.bfloat16  # y in x's dtype
    for rows in (0, 1, 13):
        args = (torch.randn(rows, 67), packed, scales, b, 45)
        torch.library.opcheck(torch.ops.ember_cpu.packed_linear.default, args)
    torch.library.opcheck(torch.ops.ember_cpu.pack_linear_weight.default, (w,))
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        torch.ops.ember_cpu.packed_linear(x, w, scales, b, 45)  # an unpacked weight
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.ember_cpu.packed_linear(x, packed, scales, b, 200)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.ember_cpu.packed_linear(x, packed, scales[:3], b, 45)
    with pytest.raises(RuntimeError, match="float32, bfloat16, float16 or int8"):
        torch.ops.ember_cpu.pack_linear_weight(torch.zeros(4, 4, dtype=torch.float64))


needs_pairs = pytest.mark.skipif(
    not kernels.bf16_pairs(), reason="this build has no AVX512-BF16 (bf16 pairs)"
)


def test_bf16_pairs_are_built_where_the_target_has_avx512_bf16():
    """The canary of `needs_pairs`: a build whose target has AVX512-BF16 (and AVX-512F) has
    the bf16 pairs; one that lost them would otherwise only skip the tests below."""
    from ember.host.isa import native_enables

    native = kernels.loaded_isa() == "native" and not kernels._no_simd()
    want = native and native_enables("avx512bf16") and native_enables("avx512f")
    assert kernels.bf16_pairs() == want


def _pairs_case(rows: int, n: int, k: int, bias: bool = True):
    g = torch.Generator().manual_seed(rows * 7919 + n * 31 + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    return x, w, b, ref, x.double().abs() @ w.double().abs().t()


def _assert_rounded_once(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    """`out` is bf16 and at most one bf16 step (2^-7 relative) from the exact result, plus the
    fp32 summation's own error (`magnitude`: the sum of |products|, times 2^-20)."""
    assert out.dtype == torch.bfloat16
    bound = ref.abs() * 2**-7 + magnitude * 2**-20
    assert ((out.double() - ref).abs() <= bound).all()


@needs_pairs
@pytest.mark.parametrize("rows", PACKED_ROWS)
@pytest.mark.parametrize(("n", "k"), [(45, 67), (1, 1), (257, 1030), (64, 4096), (33, 9001)])
def test_bf16_pairs_match_exact_products_rounded_once(rows, n, k):
    """bf16 activations x bf16 pairs (vdpbf16ps): exact products, fp32 sums, y rounded to bf16
    once. Odd k (the last pair's second weight is 0), a partial panel, one channel, k = 4096 (one
    2048-pair slice, y written in bf16; rows 8 KiB apart, copied to a longer stride past 4 rows)
    and k = 9001 (three slices, partial sums in fp32; 130 rows: two 2 MiB chunks of x)."""
    x, w, b, ref, magnitude = _pairs_case(rows, n, k, bias=n != 64)
    out = torch.ops.ember_cpu.packed_linear(x, torch.ops.ember_cpu.pack_bf16_pairs(w), None, b, n)
    assert out.shape == (rows, n)
    _assert_rounded_once(out, ref, magnitude)


@needs_pairs
def test_bf16_pairs_layout_and_contract():
    panel = kernels.panel_width()
    w = torch.arange(50 * 5, dtype=torch.float32).view(50, 5).bfloat16()
    pairs = torch.ops.ember_cpu.pack_bf16_pairs(w)
    assert pairs.shape == (-(-50 // panel), 3, 2 * panel)
    for n in (0, 17, 49):
        for k in range(5):
            assert pairs[n // panel, k // 2, 2 * (n % panel) + k % 2] == w[n, k]
    assert not pairs[:, 2, 1::2].any() and not pairs[-1, :, 2 * (50 % panel) :].any()
    x, w, b, ref, magnitude = _pairs_case(6, 45, 67)
    packed = torch.ops.ember_cpu.pack_bf16_pairs(w)
    out = torch.ops.ember_cpu.packed_linear(x.view(2, 3, 67), packed, None, b, 45)
    assert out.shape == (2, 3, 45)
    _assert_rounded_once(out.view(6, 45), ref, magnitude)
    for rows in (0, 1, 13):
        args = (torch.randn(rows, 67).bfloat16(), packed, None, b, 45)
        torch.library.opcheck(torch.ops.ember_cpu.packed_linear.default, args)
    torch.library.opcheck(torch.ops.ember_cpu.pack_bf16_pairs.default, (w,))
    with pytest.raises(RuntimeError, match="bf16 x and no scales"):
        torch.ops.ember_cpu.packed_linear(x.float(), packed, None, b, 45)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.ember_cpu.packed_linear(x[:, :60], packed, None, b, 45)


# ---- group-quantized weights (GGUF Q8_0 / Q6_K / Q4_0 / Q4_1, int4) ----

GROUP_KINDS = [(8, True), (6, True), (5, True), (4, True), (4, False)]
GROUP_IDS = ["q8_0", "q6_k", "q5_0", "q4_0", "q4_1"]


def _group_case(rows: int, n: int, k: int, bits: int, symmetric: bool, bias: bool = True):
    """Random codes and fp16 scales/offsets, and the float64 product of the quantized x with
    their values written out: w = d q (8-bit), d (q - 32) with a scale per 16 (6-bit),
    d (q - 16) (5-bit), d (q - 8) (4-bit symmetric), d q + m (4-bit asymmetric)."""
    g = torch.Generator().manual_seed(rows * 7919 + n * 31 + k + bits)
    x = torch.randn(rows, k, generator=g)
    low, high = {8: (-127, 128), 6: (0, 64), 5: (0, 32), 4: (0, 16)}[bits]
    codes = torch.randint(low, high, (n, k), generator=g).to(
        torch.int8 if bits == 8 else torch.uint8
    )
    per_scale = 16 if bits == 6 else 32
    scales = (torch.rand(n, k // per_scale, generator=g) * 0.1 + 0.001).half()
    mins = None if symmetric else (torch.randn(n, k // 32, generator=g) * 0.3).half()
    b = torch.randn(n, generator=g) if bias else None
    q = codes.double().view(n, -1, per_scale)
    if bits == 4 and symmetric:
        q = q - 8
    if bits in (5, 6):
        q = q - (16 if bits == 5 else 32)
    w = q * scales.double()[..., None]
    if mins is not None:
        w = w + mins.double()[..., None]
    ref = group_quantized_x(x).double() @ w.view(n, k).t() + (b.double() if b is not None else 0)
    return x, codes, scales, mins, b, ref, w.view(n, k)


@pytest.mark.parametrize(("bits", "symmetric"), GROUP_KINDS, ids=GROUP_IDS)
@pytest.mark.parametrize("rows", PACKED_ROWS)
@pytest.mark.parametrize(("n", "k"), [(45, 64), (1, 32), (257, 1056), (64, 2080)])
def test_group_linear_matches_float64(bits, symmetric, rows, n, k):
    """Every row-block size (a single row has its own chains), partial panels, a single
    channel, k past one 1024-deep slice; exact int32 sums, so only fp32 scaling differs."""
    from ember.model.layers.group import GroupLinear

    x, codes, scales, mins, b, ref, w = _group_case(rows, n, k, bits, symmetric, bias=n != 64)
    linear = GroupLinear(codes, scales, mins, bits, b)
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), ref, atol=1e-3 * (k / 64) ** 0.5, rtol=1e-5)
    # The layout round-trips: the rows the embedding gathers are the weight's values (exact
    # products; one fp32 rounding of d q + m).
    torch.testing.assert_close(linear.rows(torch.arange(n)).double(), w, rtol=1e-7, atol=1e-7)
    # Against unquantized x: within the activation quantization's error (half a step of 1/127
    # of each group's max, against the sum of the products' magnitudes).
    full = x.double() @ w.t() + (b.double() if b is not None else 0)
    scale = (x.double().abs() @ w.abs().t()).norm()
    assert ((out.double() - full).norm() / scale).item() < 0.01


@pytest.mark.parametrize(("bits", "symmetric"), GROUP_KINDS, ids=GROUP_IDS)
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_group_linear_sums_at_the_code_and_activation_extremes(bits, symmetric, rows):
    """Every code at the top (or bottom) of its range against every x at +-127 after
    quantization: the largest integer sums a group can make, exact (the kernels without VNNI
    add byte products in int16 lanes before widening; an overflow would wrap)."""
    from ember.model.layers.group import GroupLinear

    n, k = 40, 96
    high = {8: 127, 6: 63, 5: 31, 4: 15}[bits]
    low = -127 if bits == 8 else 0
    offset = {8: 0, 6: 32, 5: 16, 4: 8 if symmetric else 0}[bits]  # what the stored codes carry
    for code, sign in ((high, 1.0), (high, -1.0), (low, 1.0), (low, -1.0)):
        codes = torch.full((n, k), code, dtype=torch.int8 if bits == 8 else torch.uint8)
        scales = torch.full((n, k // (16 if bits == 6 else 32)), 0.5).half()
        mins = None if symmetric else torch.full((n, k // 32), -0.25).half()
        x = torch.full((rows, k), sign)
        value = (code - offset) * 0.5 + (0 if symmetric else -0.25)  # d q (+ m)
        w = torch.full((n, k), value, dtype=torch.float64)
        ref = group_quantized_x(x).double() @ w.t()
        out = GroupLinear(codes, scales, mins, bits, None)(x)
        torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize(("bits", "symmetric"), GROUP_KINDS, ids=GROUP_IDS)
def test_group_linear_from_row_chunks_equals_one_pass(bits, symmetric, monkeypatch):
    """Packing rows chunk by chunk (whole panels, then a partial last one) gives the same
    buffers as packing the weight at once, and the kernels' packer (`group_pack_codes`) the
    same bytes as the PyTorch re-layout it replaces (used while a first build compiles);
    chunks that do not start a panel, or too few rows, are refused."""
    from ember.model.layers.group import GroupLinear

    n, k = 5 * kernels.panel_width() + 3, 96
    _, codes, scales, mins, b, _, _ = _group_case(1, n, k, bits, symmetric)
    assert kernels.ready()
    whole = GroupLinear(codes, scales, mins, bits, b)
    step = 2 * kernels.panel_width()
    parts = [
        (codes[r : r + step], scales[r : r + step], None if mins is None else mins[r : r + step])
        for r in range(0, n, step)
    ]
    chunked = GroupLinear.from_row_chunks(n, bits, parts, b)
    with monkeypatch.context() as m:
        m.setattr(kernels, "ready", lambda: False)
        reference = GroupLinear(codes, scales, mins, bits, b)
        reference_chunked = GroupLinear.from_row_chunks(n, bits, parts, b)
    assert (chunked.out_features, chunked.in_features, chunked.bits) == (n, k, bits)
    for name, buf in reference.named_buffers():
        for other in (whole, chunked, reference_chunked):
            theirs = getattr(other, name)
            assert theirs.dtype == buf.dtype and torch.equal(theirs, buf), name
    # Rows 2 panels in, through the op itself (opcheck runs it on copies).
    rows = parts[1]
    panel_mins = None if whole.mins is None else whole.mins.clone()
    args = (whole.codes.clone(), whole.scales.clone(), panel_mins, step, *rows, bits)
    torch.library.opcheck(torch.ops.ember_cpu.group_pack_codes.default, args)
    with pytest.raises(RuntimeError, match="do not start a panel"):
        torch.ops.ember_cpu.group_pack_codes(*args[:3], 3, *args[4:])
    with pytest.raises(ValueError, match="do not start a panel"):
        short = (codes[:3], scales[:3], None if mins is None else mins[:3])
        GroupLinear.from_row_chunks(n, bits, [short, parts[1]])
    with pytest.raises(ValueError, match="chunks hold"):
        GroupLinear.from_row_chunks(n, bits, parts[:1], b)


def test_group_linear_contract():
    from ember.model.layers.group import GroupLinear, quantize_groups

    x, codes, scales, mins, b, _, _ = _group_case(5, 45, 64, 4, False)
    linear = GroupLinear(codes, scales, mins, 4, b)
    panel = kernels.panel_width()
    # plain groups: each group's fp16 d and m (4 bytes a channel), then its codes (16): 10 lanes
    assert (
        linear.codes.shape == (-(-45 // panel), 10, panel, 4) and linear.codes.dtype == torch.uint8
    )
    assert linear.scales.shape == linear.mins.shape == (-(-45 // panel), 0, panel)  # in the codes
    q8 = GroupLinear(codes.to(torch.int8) - 8, scales, None, 8)
    assert q8.codes.shape == (-(-45 // panel), 17, panel, 4)  # (2 + 32) bytes a group
    q4 = GroupLinear(codes, scales, None, 4)
    assert q4.codes.shape == (-(-45 // panel), 9, panel, 4)  # (2 + 16) bytes a group
    w = torch.randn(3, 96)  # three Q4_0 groups: 54 bytes a channel, padded to 14 lanes
    assert GroupLinear(*quantize_groups(w, 4, True), 4).codes.shape == (1, 14, panel, 4)
    out = linear(x.view(1, 5, 64).bfloat16())
    assert out.shape == (1, 5, 45) and out.dtype == torch.bfloat16  # y in x's dtype
    for rows in (0, 1, 13):
        args = (torch.randn(rows, 64), linear.codes, linear.scales, linear.mins, b, 45, 4)
        torch.library.opcheck(torch.ops.ember_cpu.group_linear.default, args)
    with pytest.raises(RuntimeError, match="bits must be 4, 5, 6 or 8"):
        torch.ops.ember_cpu.group_linear(x, linear.codes, linear.scales, None, b, 45, 7)
    with pytest.raises(RuntimeError, match="offsets are for 4-bit"):
        torch.ops.ember_cpu.group_linear(x, linear.codes, linear.scales, linear.scales, b, 45, 8)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.ember_cpu.group_linear(
            x[:, :32], linear.codes, linear.scales, linear.mins, b, 45, 4
        )
    with pytest.raises(RuntimeError, match="10 lanes a channel are not groups"):  # Q4_1 as Q4_0
        torch.ops.ember_cpu.group_linear(x, linear.codes, linear.scales, None, b, 45, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        GroupLinear(codes[:, :40], scales, None, 4)
    six = GroupLinear(codes.to(torch.uint8) * 4, scales.repeat_interleave(2, dim=1), None, 6, b)
    assert six.codes.shape == (-(-45 // panel), 14, panel, 4)  # 2 scales and 24 bytes a group
    assert six.scales.shape == (-(-45 // panel), 0, panel)
    for rows in (0, 1, 13):
        args = (torch.randn(rows, 64), six.codes, six.scales, None, b, 45, 6)
        torch.library.opcheck(torch.ops.ember_cpu.group_linear.default, args)
    wrong = torch.zeros(six.codes.shape[0], 4, panel, dtype=torch.half)  # plain: scales inline
    with pytest.raises(RuntimeError, match="scales and mins must be"):
        torch.ops.ember_cpu.group_linear(x, six.codes, wrong, None, b, 45, 6)
    with pytest.raises(RuntimeError, match="lanes a channel are not groups"):
        torch.ops.ember_cpu.group_linear(x, six.codes[:, :13].clone(), six.scales, None, b, 45, 6)
    with pytest.raises(ValueError, match=r"scales \[45, 4\]"):
        GroupLinear(codes, scales, None, 6)
    five = GroupLinear(codes.to(torch.uint8) * 2, scales, None, 5, b)
    assert five.codes.shape == (-(-45 // panel), 11, panel, 4)  # (2 + 20) bytes a group (Q5_0)
    assert five.scales.shape == (-(-45 // panel), 0, panel)
    # quantize_groups: llama.cpp's rules, each weight within half a step of its group's scale
    # (Q4_0 clips the far end of its range, +8 steps: up to one step there).
    w = torch.randn(7, 96)
    for bits, symmetric in [(8, True), (4, True), (4, False)]:  # no 6-bit quantizer
        c, d, m = quantize_groups(w, bits, symmetric)
        back = GroupLinear(c, d, m, bits).rows(torch.arange(7))
        step = d.float().repeat_interleave(32, dim=1).abs()
        bound = 1.0 if (bits, symmetric) == (4, True) else 0.5
        assert ((back - w).abs() <= step * bound + 1e-3).all(), (bits, symmetric)


# ---- super-blocks of 256 (GGUF Q4_K / Q6_K kept as the file holds them) ----

SUPER_KINDS = [4, 6]
SUPER_IDS = ["q4_k", "q6_k"]


def _super_case(rows: int, n: int, k: int, bits: int, bias: bool = True):
    """Random super-block rows (`SuperRows`) and the float64 product of the quantized x with
    their values written out: w = d sc q + dm m (Q4_K: 6-bit sc and m per 32, fp16 d and dm
    per 256) or d sc (q - 32) (Q6_K: int8 sc per 16, fp16 d per 256)."""
    from ember.model.layers.group import SuperRows

    g = torch.Generator().manual_seed(rows * 7919 + n * 31 + k + bits + 1)
    x = torch.randn(rows, k, generator=g)
    supers = k // 256
    codes = torch.randint(0, 16 if bits == 4 else 64, (n, k), generator=g).to(torch.uint8)
    d = (torch.rand(n, supers, generator=g) * 0.002 + 1e-4).half()
    d64 = d.double()[..., None]
    if bits == 4:
        sub = torch.randint(0, 64, (n, k // 32), generator=g).to(torch.uint8)
        sub_mins = torch.randint(0, 64, (n, k // 32), generator=g).to(torch.uint8)
        dm = (-torch.rand(n, supers, generator=g) * 0.002).half()
        scale = d64 * sub.double().view(n, supers, 8)
        offset = dm.double()[..., None] * sub_mins.double().view(n, supers, 8)
        w = codes.double().view(n, supers, 8, 32) * scale[..., None] + offset[..., None]
    else:
        sub = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
        sub_mins = dm = None
        scale = d64 * sub.double().view(n, supers, 16)
        w = (codes.double().view(n, supers, 16, 16) - 32) * scale[..., None]
    w = w.reshape(n, k)
    b = torch.randn(n, generator=g) if bias else None
    ref = group_quantized_x(x).double() @ w.t() + (b.double() if b is not None else 0)
    return x, SuperRows(codes, sub, sub_mins, d, dm), b, ref, w


@pytest.mark.parametrize("bits", SUPER_KINDS, ids=SUPER_IDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64])
@pytest.mark.parametrize(("n", "k"), [(45, 256), (1, 512), (257, 1280), (64, 2304)])
def test_super_block_linear_matches_float64(bits, rows, n, k):
    """Every row-block size, partial panels, a single channel, super-blocks across 1024-deep
    slices: exact int32 sums, so only fp32 scaling differs; the rows the embedding gathers
    are the weight's values."""
    from ember.model.layers.group import GroupLinear

    x, chunk, b, ref, w = _super_case(rows, n, k, bits, bias=n != 64)
    linear = GroupLinear.from_row_chunks(n, bits, [chunk], b)
    assert linear.super_blocks and linear.scales.shape[1] == k // 256
    assert linear.codes[0].numel() * 8 == linear.codes.shape[2] * k * (4.5 if bits == 4 else 6.5)
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), ref, atol=3e-3 * (k / 64) ** 0.5, rtol=1e-5)
    torch.testing.assert_close(linear.rows(torch.arange(n)).double(), w, rtol=1e-7, atol=1e-7)
    full = x.double() @ w.t() + (b.double() if b is not None else 0)
    scale = (x.double().abs() @ w.abs().t()).norm()
    assert ((out.double() - full).norm() / scale).item() < 0.01


@pytest.mark.parametrize("bits", SUPER_KINDS, ids=SUPER_IDS)
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_super_block_sums_at_the_code_and_activation_extremes(bits, rows):
    """Every code and sub-block scale at the top (or bottom) of its range against every x at
    +-127 after quantization: the largest sums, exact."""
    from ember.model.layers.group import GroupLinear, SuperRows

    n, k = 40, 512
    for code, sc, sign in ((15 if bits == 4 else 63, 63 if bits == 4 else 127, 1.0),
                           (0, 63 if bits == 4 else -128, -1.0)):  # fmt: skip
        codes = torch.full((n, k), code, dtype=torch.uint8)
        d = torch.full((n, k // 256), 0.5).half()
        if bits == 4:
            sub = torch.full((n, k // 32), sc, dtype=torch.uint8)
            chunk = SuperRows(codes, sub, sub.clone(), d, -d)
            value = 0.5 * sc * code - 0.5 * sc
        else:
            chunk = SuperRows(codes, torch.full((n, k // 16), sc, dtype=torch.int8), None, d, None)
            value = 0.5 * sc * (code - 32)
        x = torch.full((rows, k), sign)
        ref = group_quantized_x(x).double() @ torch.full((n, k), value, dtype=torch.float64).t()
        out = GroupLinear.from_row_chunks(n, bits, [chunk])(x)
        torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("bits", SUPER_KINDS, ids=SUPER_IDS)
def test_super_block_rows_in_chunks_and_the_contract(bits):
    """Chunks of rows pack as one pass does; the op tells super-block panels by their
    shapes (opcheck at 0, 1 and 13 rows); mismatched rows and bad shapes are refused."""
    from ember.model.layers.group import GroupLinear, SuperRows

    panel = kernels.panel_width()
    n, k = 5 * panel + 3, 512
    x, chunk, b, ref, _ = _super_case(3, n, k, bits)
    whole = GroupLinear.from_row_chunks(n, bits, [chunk], b)
    step = 2 * panel
    parts = [
        SuperRows(*(None if t is None else t[r : r + step] for t in chunk))
        for r in range(0, n, step)
    ]
    chunked = GroupLinear.from_row_chunks(n, bits, parts, b)
    for name, buf in whole.named_buffers():
        assert torch.equal(getattr(chunked, name), buf), name
    assert "super-block" in repr(whole)
    for rows in (0, 1, 13):
        args = (torch.randn(rows, k), whole.codes, whole.scales, whole.mins, b, n, bits)
        torch.library.opcheck(torch.ops.ember_cpu.group_linear.default, args)
    with pytest.raises(ValueError, match="super-block panels take"):
        whole._pack(0, (chunk.codes, chunk.d, None))
    with pytest.raises(ValueError, match="do not fit"):
        GroupLinear.from_row_chunks(n, bits, [chunk, SuperRows(chunk.codes[:, :256], *chunk[1:])])
    with pytest.raises(ValueError, match="multiple of 256"):
        GroupLinear.from_row_chunks(n, bits, [SuperRows(chunk.codes[:, :160], *chunk[1:])])
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.ember_cpu.group_linear(
            x[:, :256], whole.codes, whole.scales, whole.mins, b, n, bits
        )


class _Block(torch.nn.Module):
    """An attention block's projections (a ragged v_proj: the last part need not fill a
    panel) and a gated MLP's, as HF calls them."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        sizes = {"q_proj": 64, "k_proj": 32, "v_proj": 40, "gate_proj": 96, "up_proj": 96}
        for name, n in sizes.items():
            linear = torch.nn.Linear(64, n, bias=name != "v_proj")
            with torch.no_grad():
                linear.weight.copy_(torch.randn(n, 64, generator=g) * 0.1)
                if linear.bias is not None:
                    linear.bias.copy_(torch.randn(n, generator=g))
            setattr(self, name, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return torch.cat([q, k, v, self.gate_proj(x) * self.up_proj(x)], dim=-1)


def _convert(block: torch.nn.Module, kind: str) -> torch.nn.Module:
    from ember.model.layers import group as quant_group
    from ember.model.layers import packed as quant
    from ember.model.layers import rewrite

    make = {
        "nn.Linear": None,
        "GemvLinear": quant.GemvLinear,
        "PackedLinear": quant.PackedLinear,
        "Int8Linear": quant.Int8Linear,
        "int4": lambda lin: quant_group.GroupLinear(
            *quant_group.quantize_groups(lin.weight, 4, False), 4, lin.bias
        ),
        "q8_0": lambda lin: quant_group.GroupLinear(
            *quant_group.quantize_groups(lin.weight, 8, True), 8, lin.bias
        ),
    }[kind]
    if make is not None:
        rewrite._replace_linears(block, make)
    return block


@pytest.mark.parametrize(
    "kind", ["nn.Linear", "GemvLinear", "PackedLinear", "Int8Linear", "int4", "q8_0"]
)
def test_fused_projections_give_each_projection_its_own_rows(kind):
    """q/k/v and gate/up fused into one linear each give the same outputs as the separate
    linears, eager (one fused call per group, nothing kept after the group) and compiled (the
    post-grad dedupe leaves one call per group)."""
    from torch._inductor.utils import run_and_get_code

    from ember.compile.inductor import compile_settings
    from ember.model.layers.rewrite import FusedSlice, fuse_projections_

    block = _convert(_Block(), kind)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = block(x)
        assert fuse_projections_(block) == 2
        assert isinstance(block.k_proj, FusedSlice) and block.k_proj.out_features == 32
        calls = []
        fused = block.q_proj.fused
        fused.register_forward_hook(lambda *_: calls.append(1))
        assert torch.equal(block(x), want)
        assert len(calls) == 1 and not block.q_proj.memo  # one call; memo dropped after v_proj
        torch._dynamo.reset()
        with compile_settings(freezing=False):
            got, code = run_and_get_code(torch.compile(block, fullgraph=True), x)
        torch.testing.assert_close(got, want)
    if kind != "nn.Linear":  # ember's ops: one call per fused group in the generated code
        op = {"GemvLinear": "fp32_linear", "int4": "group_linear", "q8_0": "group_linear"}.get(
            kind, "packed_linear"
        )
        calls = (f"torch.ops.ember_cpu.{op}.default(", f"extern_kernels.ember_cpu_{op}(")
        assert sum(code[0].count(c) for c in calls) == 2  # op calls, or fast calls if installed


@pytest.mark.parametrize(
    ("bits", "symmetric"), [*GROUP_KINDS, ("int8", True)], ids=[*GROUP_IDS, "int8"]
)
def test_quantized_linears_are_batch_invariant(bits, symmetric):
    """A row's output does not depend on the rows beside it: the same bits alone, in every
    row-block position of a batch and at every batch size (each row's group sums are exact
    integers and its fp32 scaling runs in one order; the int8 per-channel kernel too)."""
    from ember.model.layers.group import GroupLinear
    from ember.model.layers.packed import Int8Linear

    n, k = 257, 2080  # partial panels, past one K block of 1024
    if bits == "int8":
        torch.manual_seed(0)
        linear = Int8Linear(torch.nn.Linear(k, n))
    else:
        _, codes, scales, mins, b, _, _ = _group_case(1, n, k, bits, symmetric)
        linear = GroupLinear(codes, scales, mins, bits, b)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([linear(x[r : r + 1]) for r in range(len(x))])
    for rows in (2, 3, 5, 7, 13, 64, 130):
        for start in (0, 1):
            batch = x[start : start + rows]
            assert torch.equal(linear(batch), alone[start : start + len(batch)]), (rows, start)
