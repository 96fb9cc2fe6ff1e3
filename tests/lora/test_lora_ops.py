"""ember::lora_shrink / lora_expand against the naive per-token oracle, and opcheck."""

from __future__ import annotations

import pytest
import torch

from ember.lora import ops  # noqa: F401
from tests.lora.reference import ref_lora_delta


@pytest.mark.parametrize(
    "slots",
    [[-1] * 7, [0] * 7, [1, 1, -1, 0, 2, 2, 1], [2, -1, 2, -1, 2, -1, 2]],
    ids=["base-only", "one-adapter", "mixed", "sparse"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shrink_expand_match_per_token_reference(slots, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 24, generator=g).to(dtype)
    a = torch.randn(3, 8, 24, generator=g).to(dtype)
    b = torch.randn(3, 40, 8, generator=g).to(dtype)
    s = torch.tensor(slots)
    h = torch.ops.ember.lora_shrink(x, a, s)
    delta = torch.ops.ember.lora_expand(h, b, s)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(delta, ref_lora_delta(x, a, b, s), atol=tol, rtol=tol)
    assert delta.dtype == torch.float32


def test_lora_ops_opcheck():
    x, a, b = torch.randn(5, 16), torch.randn(2, 4, 16), torch.randn(2, 12, 4)
    s = torch.tensor([0, -1, 1, 1, 0])
    torch.library.opcheck(torch.ops.ember.lora_shrink.default, (x, a, s))
    torch.library.opcheck(torch.ops.ember.lora_expand.default, (torch.randn(5, 4), b, s))
