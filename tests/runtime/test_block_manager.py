"""Block pool: allocation, ref counts, prefix hashes, LRU eviction. Pure Python."""

from __future__ import annotations

import pytest

from ember.runtime.block_manager import NULL_BLOCK, BlockManager


def test_block_manager_allocate_and_free_returns_pool_to_full():
    bm = BlockManager(num_blocks=9, block_size=4)
    assert bm.num_free_blocks == 8
    new = bm.allocate("a", list(range(10)), 10)
    assert new is not None and len(new) == 3 and NULL_BLOCK not in new
    assert bm.allocate("a", list(range(13)), 13) == [bm.block_ids("a")[-1]]
    bm.assert_invariants()
    bm.free("a")
    bm.assert_invariants()
    assert bm.num_free_blocks == 8


def test_block_manager_refuses_without_side_effects_when_short():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", list(range(8)), 8) is not None
    assert bm.allocate("b", list(range(100, 108)), 8) is None
    assert bm.block_ids("b") == []
    bm.assert_invariants()
    assert bm.num_free_blocks == 1


def test_block_manager_prefix_hit_shares_full_blocks_and_keeps_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 13))  # exactly 3 full blocks
    bm.allocate("a", prompt, len(prompt))
    hits = bm.match_prefix("b", prompt)
    assert hits == bm.block_ids("a")[:2], "the last block is recomputed so logits exist"
    bm.allocate("b", prompt, len(prompt), hits)
    assert bm.block_ids("b")[:2] == bm.block_ids("a")[:2]
    assert bm.block_ids("b")[2] != bm.block_ids("a")[2]
    bm.assert_invariants()
    bm.free("a")
    bm.free("b")
    bm.assert_invariants()
    assert bm.num_free_blocks == 15


def test_block_manager_hash_chains_on_prefix():
    bm = BlockManager(num_blocks=16, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5], 5)
    assert len(bm.match_prefix("b", [9, 9, 3, 4, 5])) == 0, "same block, different prefix"
    assert len(bm.match_prefix("c", [1, 2, 3, 4, 7])) == 2


def test_block_manager_cached_free_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=5, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5], 5)
    bm.free("a")
    assert bm.match_prefix("b", [1, 2, 3, 4, 5]) != []
    # Needing all 4 free blocks evicts the cached ones.
    assert bm.allocate("c", list(range(10, 18)), 8) is not None
    assert bm.match_prefix("d", [1, 2, 3, 4, 5]) == []
    bm.assert_invariants()


def test_block_manager_hit_on_free_cached_block_counts_it_as_unavailable():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3], 3)
    bm.free("a")
    hits = bm.match_prefix("b", [1, 2, 3, 4, 5, 6, 7])
    assert len(hits) == 1
    # b needs 4 blocks: 1 hit + 3 new, but only 3 free blocks exist in total (hit included).
    assert bm.allocate("b", [1, 2, 3, 4, 5, 6, 7], 7, hits) is None
    bm.assert_invariants()
    assert bm.allocate("b", [1, 2, 3, 4, 5], 5, hits) is not None
    bm.assert_invariants()


def test_block_manager_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(num_blocks=1, block_size=4)


def test_block_manager_reset_prefix_cache_reuses_the_blocks_it_uncaches_first():
    """Blocks whose cache entries a reset drops are reused before never-used ones, as freed
    uncached blocks are (a never-used block's pages are faulted in on the step's path)."""
    bm = BlockManager(num_blocks=9, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5], 5)  # two full (cached) blocks and a partial one
    used = set(bm.block_ids("a"))
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.match_prefix("b", [1, 2, 3, 4, 5]) == []
    assert set(bm.allocate("b", list(range(40, 46)), 6)) == used
    bm.assert_invariants()


def test_block_manager_reuses_uncached_blocks_first_and_evicts_cached_ones_last():
    bm = BlockManager(num_blocks=9, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5], 5)  # two full (cached) blocks and a partial one
    cached, partial = bm.block_ids("a")[:2], bm.block_ids("a")[2]
    bm.allocate("e", list(range(20, 26)), 6, cache=False)  # an embedding: nothing cached
    embedding = bm.block_ids("e")
    assert bm.match_prefix("x", list(range(20, 27))) == [], "cache=False registers no hash"
    bm.free("a")
    bm.free("e")
    # Blocks that hold no cache entry come back first (their pages are warm), before the
    # never-used blocks 7 and 8 and before any cached block is evicted.
    reused = bm.allocate("b", list(range(40, 48)), 8)
    assert set(reused) == {partial, *embedding}
    assert bm.match_prefix("c", [1, 2, 3, 4, 5]) == cached
    bm.allocate("d", list(range(60, 64)), 4)  # the two never-used blocks
    assert bm.match_prefix("c", [1, 2, 3, 4, 5]) == cached
    bm.assert_invariants()
