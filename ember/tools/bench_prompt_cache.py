"""W-PREFIX: a long shared prefix plus a short question, the prompt cache's workload
(`ember bench --workload prefix`, `benchmarks/bench_prompt_cache.py`).

One request of `prefix_len` random tokens and a `question_len`-token question, 16 output
tokens, after a short request that pays for each new engine's first use. TTFT in four
states: cold (nothing cached: the prefix is computed, and its blocks are copied for the disk
tier's writer), warm in process (the in-memory
prefix cache), after a restart (a new engine on the same directory: the blocks are read back
from the OS page cache) and after a restart with the entries dropped from the page cache (read
from the disk itself). The disk's own sequential read rate is measured beside it, so the last
read is a known fraction of it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from ember.runtime.request import SamplingParams

_OUTPUT_LEN = 16


@dataclass
class PrefixResult:
    """Medians over repeats; times in ms, sizes in MB (10^6 bytes), rates in MB/s."""

    prefix_len: int
    cold_no_tier_ms: float
    cold_ms: float
    warm_ms: float
    restart_ms: float
    restart_disk_ms: float
    entry_mb: float
    disk_read_mb_s: float
    runs: list[dict[str, float]]
    page_read_s: float = 0.0  # the store's time in `read` (median), page cache / disk
    disk_read_s: float = 0.0

    def summary(self) -> str:
        def row(name: str, ms: float) -> str:
            return f"  {name:<34} {ms:9.1f} ms  {ms / self.cold_ms:6.3f}x cold"

        page_s, read_s = max(self.page_read_s, 1e-9), max(self.disk_read_s, 1e-9)
        return "\n".join(
            [
                f"W-PREFIX: {self.prefix_len}-token shared prefix + question, TTFT "
                f"(median of {len(self.runs)})",
                row("cold, no disk tier", self.cold_no_tier_ms),
                row("cold (computed, blocks saved)", self.cold_ms),
                row("warm, same process", self.warm_ms),
                row("after a restart (page cache)", self.restart_ms),
                row("after a restart (from the disk)", self.restart_disk_ms),
                f"  blocks read back: {self.entry_mb:.0f} MB, in "
                f"{page_s * 1e3:.0f} ms from the page cache ({self.entry_mb / page_s:.0f} MB/s)"
                f" and {read_s * 1e3:.0f} ms from the disk ({self.entry_mb / read_s:.0f} MB/s:"
                f" {self.entry_mb / read_s / self.disk_read_mb_s:.2f} of its sequential read,"
                f" {self.disk_read_mb_s:.0f} MB/s)",
            ]
        )


def ttft_ms(llm: Any, prompt: list[int], request_id: str) -> float:
    """Steps until the request's first token, timed from its arrival; drains the request."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=_OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = time.perf_counter() - start
    assert first is not None
    return first * 1e3


def drop_from_page_cache(directory: str) -> None:
    """Write back, then ask the kernel to drop every file under `directory` from the page
    cache (POSIX_FADV_DONTNEED: no root needed), so the next read comes from the disk."""
    os.sync()
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_mb_s(directory: str, num_bytes: int = 512 << 20) -> float:
    """The sequential read rate of the disk under `directory`: a file written, synced, dropped
    from the page cache and read back in 8 MiB chunks."""
    path = os.path.join(directory, "read-rate.bin")
    chunk = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(num_bytes // len(chunk)):
            f.write(chunk)
    try:
        drop_from_page_cache(directory)
        buf = bytearray(len(chunk))
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return num_bytes / 1e6 / (time.perf_counter() - start)
    finally:
        os.unlink(path)


def run_prefix(
    model_dir: str,
    engine_kwargs: dict[str, Any],
    prefix_len: int = 4000,
    question_len: int = 32,
    repeats: int = 3,
) -> PrefixResult:
    """W-PREFIX on the checkpoint `model_dir` with `engine_kwargs` (an `LLM`'s), each repeat
    on a fresh cache directory and a fresh prefix."""
    runs = []
    entry_mb = 0.0
    with tempfile.TemporaryDirectory(prefix="ember-prefix-bench-") as tmp:
        rate = disk_read_mb_s(tmp)
        for rep in range(repeats):
            kw = dict(engine_kwargs, prefix_cache_dir=os.path.join(tmp, f"cache{rep}"))
            run, entry_mb = _one_repeat(model_dir, kw, prefix_len, question_len, rep)
            runs.append(run)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return PrefixResult(
        prefix_len,
        med["cold_no_tier_ms"],
        med["cold_ms"],
        med["warm_ms"],
        med["restart_ms"],
        med["restart_disk_ms"],
        entry_mb,
        rate,
        runs,
        med["restart_read_s"],
        med["restart_disk_read_s"],
    )


def _one_repeat(
    model_dir: str, kw: dict[str, Any], prefix_len: int, question_len: int, seed: int
) -> tuple[dict[str, float], float]:
    """TTFTs of one prefix in every state, and the MB its restart read back."""
    from ember import LLM

    g = torch.Generator().manual_seed(seed)
    llm = LLM(model=model_dir, use_tqdm=False, **dict(kw, prefix_cache_dir=None))
    vocab = llm.llm_engine.vocab_size
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
    questions = [torch.randint(0, vocab, (question_len,), generator=g).tolist() for _ in range(4)]
    # Each engine's first request pays for first use (pages of the KV cache, kernel set-up),
    # whatever the cache holds: a short one runs first.
    ttft_ms(llm, questions[3], "first-use")
    run = {"cold_no_tier_ms": ttft_ms(llm, prefix + questions[0], "cold")}
    llm.close()
    llm = LLM(model=model_dir, use_tqdm=False, **kw)
    ttft_ms(llm, questions[3], "first-use")
    run["cold_ms"] = ttft_ms(llm, prefix + questions[0], "cold")
    run["warm_ms"] = ttft_ms(llm, prefix + questions[1], "warm")
    llm.close()  # writes what is queued
    entry_mb = 0.0
    for key, from_disk in (("restart_ms", False), ("restart_disk_ms", True)):
        if from_disk:
            drop_from_page_cache(kw["prefix_cache_dir"])
        llm = LLM(model=model_dir, use_tqdm=False, **kw)
        ttft_ms(llm, questions[3], "first-use")
        run[key] = ttft_ms(llm, prefix + questions[2], key)
        stats = llm.llm_engine.prefix_store.stats
        entry_mb = stats.bytes_read / 1e6
        run[key.replace("_ms", "_read_s")] = stats.read_seconds
        llm.close()
    return run, entry_mb
