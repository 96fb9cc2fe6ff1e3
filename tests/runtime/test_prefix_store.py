"""The prefix cache's disk tier on its own: KV tensors of made-up layers, no model.

Round trips per KV dtype, entries that must be misses (another model's, corrupted, truncated,
half-written), the trust boundary, the size cap with LRU order, and two processes writing the
same blocks at once."""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat

import pytest
import torch

from ember.runtime.block_manager import BlockManager
from ember.runtime.prefix_store import _HEADER, DiskPrefixStore

KEY = bytes(range(32))
# (K/V heads, row width) per layer: two layers of different shapes
LAYERS = ((2, 8), (1, 16))
NUM_BLOCKS, BLOCK_SIZE = 12, 4


def make_caches(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    caches = []
    for heads, row in LAYERS:
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, heads, row)
        if dtype == torch.int8:
            caches.append(torch.randint(-128, 128, shape, generator=g, dtype=torch.int8))
        else:
            caches.append(torch.randn(shape, generator=g).to(dtype))
    return caches


def block_of(caches: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [c[:, block].clone() for c in caches]


def h(i: int) -> bytes:
    return bytes([i]) * 32


def opened(directory, caches, key=KEY, max_bytes=1 << 30) -> DiskPrefixStore:
    store = DiskPrefixStore.open(str(directory), max_bytes, key, caches)
    assert store is not None
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_prefix_store_round_trip_is_bit_exact(tmp_path, dtype):
    src = make_caches(dtype, seed=1)
    store = opened(tmp_path / "pc", src)
    store.save([3, 5], [h(1), h(2)])
    store.flush()
    assert store.stats.blocks_written == 2
    dst = make_caches(dtype, seed=2)
    other = opened(tmp_path / "pc", dst)  # another engine on the same directory
    assert other.read(7, h(2)) and other.read(0, h(1))
    for a, b in zip(block_of(src, 5), block_of(dst, 7), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(block_of(src, 3), block_of(dst, 0), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert other.stats.hits == 2 and other.stats.bytes_read == 2 * other.block_bytes
    assert not other.read(1, h(9)) and other.stats.misses == 1
    store.close()
    other.close()


def test_prefix_store_copies_on_save_so_blocks_can_be_reused_at_once(tmp_path):
    src = make_caches(torch.float32)
    want = block_of(src, 4)
    store = opened(tmp_path / "pc", src)
    store.save([4], [h(1)])
    for c in src:  # the block is reused before the writer ran
        c[:, 4] = -1.0
    store.flush()
    assert store.read(6, h(1))
    for a, b in zip(want, block_of(src, 6), strict=True):
        assert torch.equal(a, b)
    store.close()


def test_prefix_store_another_models_entry_is_a_miss(tmp_path):
    store = opened(tmp_path / "pc", make_caches(torch.float32))
    store.save([1], [h(1)])
    store.flush()
    other = opened(tmp_path / "pc", make_caches(torch.float32), key=bytes(32))
    assert not other.read(2, h(1)), "another key names another file"
    # and a file of another model put where this one's entry would be is refused by its header
    os.makedirs(os.path.dirname(other.path(h(1))), exist_ok=True)
    os.replace(store.path(h(1)), other.path(h(1)))
    assert not other.read(2, h(1)) and other.stats.errors == 1


def corrupt_payload(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(_HEADER.size + 5)
        byte = f.read(1)
        f.seek(_HEADER.size + 5)
        f.write(bytes([byte[0] ^ 0x40]))


def truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 3)


def bad_magic(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(b"NOTEMBER")


@pytest.mark.parametrize("damage", [corrupt_payload, truncate, bad_magic])
def test_prefix_store_damaged_entry_is_a_miss_with_a_log_line(tmp_path, caplog, damage):
    caches = make_caches(torch.float32)
    store = opened(tmp_path / "pc", caches)
    store.save([1], [h(1)])
    store.flush()
    damage(store.path(h(1)))
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert not store.read(2, h(1))
    assert store.stats.errors == 1 and store.stats.hits == 0
    assert "prefix cache: ignoring" in caplog.text


def test_prefix_store_a_failed_write_does_not_hold_the_queue(tmp_path, monkeypatch):
    """A write that fails (a full disk) is logged, and its copies stop counting against the
    queue's cap: later blocks are still written, not dropped."""
    from ember.runtime import prefix_store

    store = opened(tmp_path / "pc", make_caches(torch.float32))
    monkeypatch.setattr(prefix_store, "_MAX_QUEUED_BYTES", store.block_bytes)
    write = store._write

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    store._write = full_disk
    store.save([1], [h(1)])
    store.flush()
    store._write = write
    store.save([2], [h(2)])
    store.flush()
    assert store.stats.blocks_written == 1 and store.stats.dropped == 0
    assert store.read(3, h(2))


def test_prefix_store_entry_being_written_is_a_miss(tmp_path):
    """A writer's temporary file is never read; only the rename publishes an entry."""
    store = opened(tmp_path / "pc", make_caches(torch.float32))
    path = store.path(h(1))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path) + ".1.1")
    with open(tmp, "wb") as f:
        f.write(b"\0" * 100)
    assert not store.read(2, h(1)) and store.stats.misses == 1


def test_prefix_store_refuses_a_directory_others_can_write(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert DiskPrefixStore.open(str(shared), 1 << 30, KEY, make_caches(torch.float32)) is None
    assert "writable by group or others" in caplog.text
    store = opened(tmp_path / "new" / "pc", make_caches(torch.float32))
    assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700


def entry_bytes(directory) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(directory)
        for f in files
        if f.endswith(".kv")
    )


def test_prefix_store_size_cap_evicts_least_recently_used(tmp_path):
    caches = make_caches(torch.float32)
    one = (
        DiskPrefixStore.open(str(tmp_path / "pc"), 1 << 30, KEY, caches).block_bytes + _HEADER.size
    )
    store = opened(tmp_path / "pc", caches, max_bytes=5 * one)
    for i in range(1, 5):
        store.save([i], [h(i)])
        store.flush()
        os.utime(store.path(h(i)), (1000 + i, 1000 + i))  # written in order, long ago
    assert store.read(9, h(1)), "read: now the most recently used"
    for i in range(5, 7):  # the 6th entry is past the cap: down to 90% of it (4 entries)
        store.save([i], [h(i)])
        store.flush()
        assert entry_bytes(tmp_path / "pc") <= 5 * one
    assert store.stats.evictions == 2
    assert os.path.exists(store.path(h(1))), "the entry read recently stays"
    assert not os.path.exists(store.path(h(2))), "the least recently used go first"
    assert not os.path.exists(store.path(h(3)))
    assert all(os.path.exists(store.path(h(i))) for i in (4, 5, 6))


def _write_blocks(directory: str, seed: int) -> None:
    caches = make_caches(torch.float32, seed=0)  # the same K/V in both processes
    store = DiskPrefixStore(directory, 1 << 30, KEY, caches)
    for _ in range(20):
        for i in range(1, NUM_BLOCKS):
            store._write(h(i), [c[kv, i].contiguous().view(torch.uint8).numpy()
                                for c in caches for kv in (0, 1)])  # fmt: skip
            os.unlink(store.path(h(i))) if seed and i % 3 == 0 else None
    store.close()


def test_prefix_store_two_processes_writing_the_same_blocks_leave_valid_entries(tmp_path):
    directory = str(tmp_path / "pc")
    os.makedirs(directory, mode=0o700)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_blocks, args=(directory, seed)) for seed in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    dst = make_caches(torch.float32, seed=5)
    store = opened(directory, dst)
    want = make_caches(torch.float32, seed=0)
    for i in range(1, NUM_BLOCKS):
        if os.path.exists(store.path(h(i))):
            assert store.read(i, h(i))
            for a, b in zip(block_of(want, i), block_of(dst, i), strict=True):
                assert torch.equal(a, b)
    assert store.stats.errors == 0
    leftovers = [f for _, _, fs in os.walk(directory) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []


class FakeTier:
    """A PrefixTier over a dict: hash -> the block's 'contents' (an int per block)."""

    def __init__(self, entries: dict[bytes, int], contents: dict[int, int]) -> None:
        self.entries = entries
        self.contents = contents
        self.saved: list[tuple[int, bytes]] = []

    def prefetch(self, hashes) -> None:
        pass

    def read(self, block: int, block_hash: bytes) -> bool:
        if block_hash not in self.entries or self.entries[block_hash] < 0:
            return False
        self.contents[block] = self.entries[block_hash]
        return True

    def save(self, blocks, hashes) -> None:
        self.saved += list(zip(blocks, hashes, strict=True))


def test_block_manager_saves_committed_blocks_and_promotes_them_in_a_new_pool():
    tier = FakeTier({}, {})
    bm = BlockManager(num_blocks=16, block_size=4, tier=tier)
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    assert bm.match_prefix("a", prompt) == []
    bm.allocate("a", prompt, len(prompt))
    assert tier.saved == [], "nothing is saved before the step ran"
    bm.commit()
    assert [b for b, _ in tier.saved] == bm.block_ids("a")[:3]
    # a restarted engine: a new pool whose tier holds those blocks
    tier2 = FakeTier({hh: 100 + i for i, (_, hh) in enumerate(tier.saved)}, {})
    bm2 = BlockManager(num_blocks=16, block_size=4, tier=tier2)
    hits = bm2.match_prefix("b", prompt)
    assert len(hits) == 3
    assert [tier2.contents[b] for b in hits] == [100, 101, 102]
    bm2.assert_invariants()
    bm2.allocate("b", prompt, len(prompt), hits)
    bm2.commit()
    assert tier2.saved == [], "blocks read from the tier are not written back"
    bm2.assert_invariants()


def test_block_manager_promotion_stops_at_a_bad_entry_and_spares_the_prompts_hits():
    tier = FakeTier({}, {})
    bm = BlockManager(num_blocks=8, block_size=4, tier=tier)
    prompt = list(range(1, 22))  # 5 full blocks
    bm.allocate("a", prompt[:4], 4)  # block 0 of the prompt in memory
    bm.commit()
    bm.free("a")
    hashes = bm._hashes("x", prompt, b"")
    tier.entries = {hashes[1]: 1, hashes[2]: 2, hashes[3]: -1, hashes[4]: 4}  # 3 is corrupt
    hits = bm.match_prefix("b", prompt)
    assert len(hits) == 3, "block 0 from memory, 1 and 2 from the tier, stop at 3"
    assert len(set(hits)) == 3
    bm.assert_invariants()
    assert bm.allocate("b", prompt, len(prompt), hits) is not None
    bm.assert_invariants()
