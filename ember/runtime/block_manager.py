"""KV block pool: free list, ref counts, prefix-cache hashes and LRU eviction. No tensors.

The null block (`NULL_BLOCK`, block 0), which padding tokens write to, is never handed out.
A block whose ref count drops to zero stays in the prefix cache (if it was full and hashed)
until the allocator evicts it, least recently freed first.

Safety rule: a block is registered in the prefix cache when it is scheduled to be filled, not
after the step ran, so requests admitted in one step share blocks. This is sound because
`ember::paged_attention` writes every token's K/V of a step before any sequence of that step
reads the cache, so a request that hits a block filled by another request in the same step reads
the right values. Until that step has run, such a block is *pending*: `commit` (the step ran)
makes the pending blocks ordinary cache entries, `drop_pending` (the step failed, so their K/V
were never or only partly written) removes them from the prefix cache.

A second tier (`PrefixTier`, the disk store) may sit below: a prompt's blocks past its
in-memory hits are looked up there and read into free blocks, which then enter the prefix cache
as ordinary (committed) entries; blocks are offered to it once the step that filled them ran.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from ember.attention.metadata import NULL_BLOCK

__all__ = ["NULL_BLOCK", "BlockManager", "PrefixTier", "hash_block"]


class PrefixTier(Protocol):
    """Where full blocks outlive the in-memory prefix cache (`DiskPrefixStore`). `prefetch`
    may start reading the entries of `hashes` (a prompt's next blocks, in order) so that the
    `read`s that follow wait less. Safety rule:
    `read` returns True only when the block now holds exactly the K/V `block_hash` names;
    `save` copies what it needs before returning (the blocks may be reused at once)."""

    def prefetch(self, hashes: Sequence[bytes]) -> None: ...

    def read(self, block: int, block_hash: bytes) -> bool: ...

    def save(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None: ...


def hash_block(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Chained hash of one full block: depends on every token before it and on `extra`."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


class BlockManager:
    """Owns block ids, ref counts and prefix hashes for `num_blocks` blocks of `block_size`."""

    def __init__(self, num_blocks: int, block_size: int, tier: PrefixTier | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # Free blocks in eviction order (front is evicted first); value unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self._req_num_hashed: dict[str, int] = {}
        self._pending: list[int] = []  # blocks registered since the last `commit`
        self.tier = tier

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_ids(self, request_id: str) -> list[int]:
        return self._req_blocks.get(request_id, [])

    def _hashes(self, request_id: str, token_ids: list[int], extra: bytes) -> list[bytes]:
        """Hashes of every full block of `token_ids`, extended incrementally."""
        hashes = self._req_hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    def match_prefix(self, request_id: str, token_ids: list[int], extra: bytes = b"") -> list[int]:
        """Cached blocks covering the longest prefix of `token_ids`, in order.

        At least one token is always left to compute, so the last logits can be produced.
        """
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._hashes(request_id, token_ids, extra)[:max_blocks]
        hits: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        if self.tier is not None and len(hits) < len(hashes):
            hits += self._promote(hashes[len(hits) :], set(hits))
        return hits

    def _promote(self, hashes: list[bytes], keep: set[int]) -> list[int]:
        """Read the blocks of `hashes` (in order, up to the first the tier lacks) from the tier
        into free blocks (never those in `keep`, this prompt's hits), and register them as
        committed cache entries, free and most recently used. Returns them."""
        assert self.tier is not None
        self.tier.prefetch(hashes)
        promoted: list[int] = []
        for h in hashes:
            if h in self._cached:  # an earlier miss filled by now? the chain is broken anyway
                break
            block = next((b for b in self._free if b not in keep), None)
            if block is None:
                break
            del self._free[block]
            old = self._block_hash[block]
            if old is not None:
                del self._cached[old]
                self._block_hash[block] = None
            if not self.tier.read(block, h):
                self._free[block] = None
                self._free.move_to_end(block, last=False)  # holds nothing: reused first
                break
            self._block_hash[block] = h
            self._cached[h] = block
            self._free[block] = None  # the back: evicted last
            keep.add(block)
            promoted.append(block)
        return promoted

    def allocate(
        self,
        request_id: str,
        token_ids: list[int],
        num_tokens: int,
        hit_blocks: list[int] | None = None,
        extra: bytes = b"",
        cache: bool = True,
    ) -> list[int] | None:
        """Make the request own blocks for its first `num_tokens` tokens.

        `hit_blocks` (from `match_prefix`, only for a request that owns no blocks yet) are
        shared. Returns the newly allocated block ids, or None, changing nothing, when the pool
        is short. Full blocks among the first `num_tokens` tokens enter the prefix cache
        unless `cache` is False (K/V no later prompt can hit).
        """
        hit_blocks = hit_blocks or []
        owned = self._req_blocks.setdefault(request_id, [])
        if owned and hit_blocks:
            raise ValueError("hit_blocks are only for a request that owns no blocks")
        num_needed = -(-num_tokens // self.block_size) - len(owned) - len(hit_blocks)
        num_hits_free = sum(1 for b in hit_blocks if self._ref_counts[b] == 0)
        if num_needed > len(self._free) - num_hits_free:
            if not owned:
                del self._req_blocks[request_id]
            return None
        for b in hit_blocks:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1
        owned.extend(hit_blocks)
        new_blocks = [self._pop_free() for _ in range(max(num_needed, 0))]
        owned.extend(new_blocks)
        if cache:
            self._cache_full_blocks(request_id, token_ids, num_tokens, extra)
        return new_blocks

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._block_hash[block]
        if h is not None:
            del self._cached[h]
            self._block_hash[block] = None
        self._ref_counts[block] = 1
        return block

    def _cache_full_blocks(
        self, request_id: str, token_ids: list[int], num_tokens: int, extra: bytes
    ) -> None:
        # Positions past `token_ids` (a decode's draft tokens) hold no token of the sequence
        # yet: their blocks are not hashed.
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        start = self._req_num_hashed.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request_id, token_ids[: num_full * self.block_size], extra)
        blocks = self._req_blocks[request_id]
        for i in range(start, num_full):
            block, h = blocks[i], hashes[i]
            if self._block_hash[block] is None and h not in self._cached:
                self._block_hash[block] = h
                self._cached[h] = block
                self._pending.append(block)
        self._req_num_hashed[request_id] = num_full

    def commit(self) -> None:
        """The step that fills the pending blocks has run: their K/V are valid cache entries
        (offered to the tier, if any)."""
        if self.tier is not None and self._pending:
            blocks = [b for b in self._pending if self._block_hash[b] is not None]
            self.tier.save(blocks, [self._block_hash[b] for b in blocks])  # type: ignore[misc]
        self._pending.clear()

    def drop_pending(self) -> None:
        """The step that was to fill the pending blocks failed: forget their hashes, so no later
        prompt hits K/V that were never written. (Their owners must recompute them: the
        scheduler's `rollback` frees them.)"""
        for b in self._pending:
            h = self._block_hash[b]
            if h is not None:
                del self._cached[h]
                self._block_hash[b] = None
        self._pending.clear()

    def free(self, request_id: str, keep_hashes: bool = False) -> None:
        """Release the request's blocks: cached ones to the back of the eviction order (tail
        first, so tails are evicted first), blocks that hold no cache entry to the front, to
        be reused before any cached block is evicted and before blocks never used: their
        pages are resident and likely in the CPU's caches (taking never-used blocks first
        walked the whole pool, faulting in fresh zeroed pages on the step's path).

        `keep_hashes` keeps its token hashes for a preempted request that will come back.
        """
        blocks = self._req_blocks.pop(request_id, [])
        for b in reversed(blocks):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                if self._block_hash[b] is None:
                    self._free.move_to_end(b, last=False)
        self._req_num_hashed.pop(request_id, None)
        if not keep_hashes:
            self._req_hashes.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past its first `num_tokens` tokens (those of rejected
        draft tokens, which are never hashed), to the front of the free list."""
        blocks = self._req_blocks.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        for b in reversed(blocks[keep:]):
            assert self._block_hash[b] is None, "a trimmed block holds a prefix-cache entry"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                self._free.move_to_end(b, last=False)
        del blocks[keep:]

    def reset_prefix_cache(self) -> None:
        """Forget all cached hashes of free blocks (used blocks keep theirs). Those blocks now
        hold no cache entry, so they move to the front, as `free` puts such blocks: reused
        before blocks never used (whose pages are faulted in on the step's path)."""
        uncached = []
        for b in self._free:
            h = self._block_hash[b]
            if h is not None:
                del self._cached[h]
                self._block_hash[b] = None
                uncached.append(b)
        for b in reversed(uncached):
            self._free.move_to_end(b, last=False)

    def assert_invariants(self) -> None:
        """Every block is either free (ref 0) or owned, ref counts match owners, hashes agree."""
        counts = [0] * self.num_blocks
        for blocks in self._req_blocks.values():
            assert len(set(blocks)) == len(blocks), "a request owns a block twice"
            for b in blocks:
                counts[b] += 1
        assert counts[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free, "null block handed out"
        for b in range(1, self.num_blocks):
            assert counts[b] == self._ref_counts[b], f"block {b}: ref count mismatch"
            assert (counts[b] == 0) == (b in self._free), f"block {b}: free-list mismatch"
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"block {b}: hash map mismatch"
        assert sum(h is not None for h in self._block_hash) == len(self._cached)
