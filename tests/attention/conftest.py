"""Keep the default run fast: Triton's CPU interpreter runs about a second per case, so most of
its full oracle grid is marked `slow`; block size 4 (several blocks per key tile) stays in."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        spec = getattr(item, "callspec", None)
        if (
            spec is not None
            and spec.params.get("backend") == "triton"
            and item.originalname == "test_paged_attention_matches_reference"
            and spec.params.get("block_size") != 4
        ):
            item.add_marker(pytest.mark.slow)
