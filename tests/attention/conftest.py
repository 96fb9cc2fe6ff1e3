"""Keep the default run fast: Triton's CPU interpreter runs about a second per case, so most of
its full oracle grid is marked `slow`; block size 4 (several blocks per key tile) in fp32 stays in. The
Triton and IPEX cases run on this CPU only (no `[avx2-host]` run: tests/host_isa.py)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and spec.params.get("backend", spec.params.get("name")) in (
            "triton",
            "ipex",
        ):
            # Triton's interpreter and IPEX's stand-in run no code of ember's ISA-built kernels.
            item.add_marker(pytest.mark.one_host("not ember's kernels"))
        if (
            spec is not None
            and spec.params.get("backend") == "triton"
            and item.originalname == "test_paged_attention_matches_reference"
            and (spec.params.get("block_size") != 4 or spec.params.get("dtype") != torch.float32)
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def _fake_ipex_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.attention import fake_ipex

    return fake_ipex.install(str(tmp_path_factory.mktemp("fake_ipex")))


@pytest.fixture
def fake_ipex(_fake_ipex_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test, IPEX's stand-in (`tests/attention/fake_ipex.py`) is importable and passes
    the backend's availability check, unless a real, usable IPEX is installed."""
    from ember.attention import get_backend

    if get_backend("ipex").unavailable() is not None:
        monkeypatch.syspath_prepend(_fake_ipex_root)
