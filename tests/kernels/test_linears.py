"""ember's fp32/bf16 linear kernels (int8: tests/e2e/test_int8.py) against fp32 references at odd sizes, every path (GEMV, tiles, whole
widening), and opcheck. The AVX2 build (`cpu_isa="avx2"`) runs the same checks in a process of
its own (one kernel build per process)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

from ember import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler")

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


def test_avx2_build_passes_the_same_checks():
    """The AVX2 paths (no AVX-512) on whatever machine runs the tests: these linear checks and
    the paged-attention kernel's."""
    attention = str(pathlib.Path(__file__).parents[1] / "attention" / "test_paged_attention.py")
    code = (
        "import sys, pytest; from ember import kernels; kernels.load('avx2'); "
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-k', 'not avx2 and not triton and not ipex', "
        f"{__file__!r}, {attention!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert kernels.loaded_isa() != "avx2"  # this process kept its own build
