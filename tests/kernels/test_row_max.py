"""ember's `row_max` kernel (the sampler's greedy tokens and non-finite check) against
`torch.max(dim=-1)`: ties, NaN, +-inf, odd row lengths, and opcheck."""

from __future__ import annotations

import pytest
import torch

from ember import kernels
from tests.kernels import needs_compiler

pytestmark = [
    needs_compiler,  # skipped where there is no C++ compiler at all, never on a failed build
    pytest.mark.host_isa,  # the x86-64-v3 build too: tests/host_isa.py
]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    kernels.load()  # a failed build fails every test of the module, with the compiler's output


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 33, 1000, 32000, 151936])
@pytest.mark.parametrize("rows", [1, 5])
def test_row_max_matches_torch_max(rows, vocab):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    x = torch.randn(rows, vocab, generator=g)
    x[0, vocab // 2] = x[0].max() + 1  # the row's max in the middle
    if vocab > 2:  # a tie: the first index wins, as in torch.max
        x[-1, vocab - 1] = x[-1, 1] = x[-1].max() + 2
    values, indices = torch.ops.ember_cpu.row_max(x)
    expected = x.max(dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(indices, expected.indices)


def test_row_max_flags_nan_and_keeps_infinities():
    inf, nan = float("inf"), float("nan")
    x = torch.randn(6, 37)
    x[1, 20] = nan
    x[2, 36] = inf
    x[3] = -inf
    x[4, 3:] = -inf
    x[5, 0] = nan  # NaN in the first vector, then finite values
    values, indices = torch.ops.ember_cpu.row_max(x)
    assert values[1].isnan() and values[5].isnan()
    assert (values[2], indices[2]) == (inf, 36)
    assert (values[3], indices[3]) == (-inf, 0)  # no finite value: torch.max's index too
    assert torch.equal(indices[4], x[4].argmax())
    assert torch.equal(values[[0, 2, 3, 4]], x[[0, 2, 3, 4]].max(dim=-1).values)


def test_row_max_contract():
    for rows in (0, 1, 3):
        torch.library.opcheck(torch.ops.ember_cpu.row_max.default, (torch.randn(rows, 40),))
    strided = torch.randn(40, 3).t()
    assert torch.equal(torch.ops.ember_cpu.row_max(strided)[1], strided.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.ember_cpu.row_max(torch.randn(2, 4).bfloat16())
    with pytest.raises(RuntimeError, match="non-empty"):
        torch.ops.ember_cpu.row_max(torch.randn(2, 0))
