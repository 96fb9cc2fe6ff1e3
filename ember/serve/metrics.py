"""Prometheus metrics of a served engine (`/metrics`, prometheus_client), vLLM's set by name:
running and waiting requests, KV blocks in use, prefix-cache hit rate, TTFT and TPOT
histograms, prompt and generated token counters (tokens per second is their `rate()`), and
speculative decoding's draft and accepted token counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ember.runtime.engine import LLMEngine
from ember.runtime.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


_DISK_COUNTERS = {
    "hits": "KV blocks read back from the prefix cache's directory",
    "misses": "prompts whose next block the directory did not hold",
    "errors": "entries refused (another model's, truncated, corrupted)",
    "bytes_read": "bytes of KV blocks read from the directory",
    "read_seconds": "time spent reading KV blocks from the directory",
    "bytes_written": "bytes of KV blocks written to the directory",
    "blocks_written": "KV blocks written to the directory",
    "evictions": "entries deleted to keep the directory under its size cap",
    "dropped": "blocks not written because the writer was behind",
}


@dataclass
class _Timing:
    arrival: float
    first: float | None = None
    tokens: int = 0


@dataclass
class EngineMetrics:
    """Updated by the engine loop thread only; read by the scrape (prometheus_client's own
    locking makes that safe)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _timing: dict[str, _Timing] = field(default_factory=dict)

    def __post_init__(self) -> None:
        r = self.registry
        self.running = Gauge("ember_num_requests_running", "requests being computed", registry=r)
        self.waiting = Gauge("ember_num_requests_waiting", "requests waiting", registry=r)
        self.blocks_used = Gauge("ember_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_total = Gauge("ember_kv_blocks_total", "usable KV cache blocks", registry=r)
        self.prefix_queries = Counter(
            "ember_prefix_cache_queries", "prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "ember_prefix_cache_hits", "prompt tokens found in the prefix cache", registry=r
        )
        self.prompt_tokens = Counter("ember_prompt_tokens", "prompt tokens computed", registry=r)
        self.generation_tokens = Counter("ember_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "ember_time_to_first_token_seconds", "arrival to first token", registry=r,
            buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = Histogram(
            "ember_time_per_output_token_seconds", "mean time per token after the first",
            registry=r, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.finished = Counter(
            "ember_requests_finished", "finished requests", ["finish_reason"], registry=r
        )
        self.aborted = Counter(
            "ember_requests_aborted", "requests aborted unfinished (a client gone)", registry=r
        )
        # Speculative decoding, vLLM's names: steps of a request that carried drafts, draft
        # tokens proposed, draft tokens the target kept (acceptance = accepted / draft tokens).
        self.spec_drafts = Counter(
            "ember_spec_decode_num_drafts", "request steps that verified draft tokens", registry=r
        )
        self.spec_draft_tokens = Counter(
            "ember_spec_decode_num_draft_tokens", "draft tokens proposed", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "ember_spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r
        )
        self._spec_seen = (0, 0, 0)
        # The prefix cache's disk tier (`prefix_cache_dir`): `PrefixStoreStats`' counters.
        self.disk = {
            name: Counter(f"ember_prefix_cache_disk_{name}", text, registry=r)
            for name, text in _DISK_COUNTERS.items()
        }
        self._disk_seen: dict[str, float] = dict.fromkeys(_DISK_COUNTERS, 0)

    def arrived(self, request_id: str) -> None:
        self._timing[request_id] = _Timing(time.perf_counter())

    def output(self, out: RequestOutput) -> None:
        t = self._timing.get(out.request_id)
        if t is None:
            return
        now = time.perf_counter()
        new = sum(len(c.token_ids) for c in out.outputs)
        if new and t.first is None:
            t.first = now
            self.ttft.observe(now - t.arrival)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.prefix_queries.inc(len(out.prompt_token_ids))
            self.prefix_hits.inc(out.num_cached_tokens)
        t.tokens += new
        self.generation_tokens.inc(new)
        if out.finished:
            self.forget(out.request_id)
            if t.first is not None and t.tokens > 1:
                self.tpot.observe((now - t.first) / (t.tokens - 1))
            for c in out.outputs:
                self.finished.labels(c.finish_reason or "error").inc()

    def forget(self, request_id: str, aborted: bool = False) -> None:
        if self._timing.pop(request_id, None) is not None and aborted:
            self.aborted.inc()

    def step(self, engine: LLMEngine) -> None:
        """Gauges after a step (or a command) of the loop."""
        scheduler, blocks = engine.scheduler, engine.block_manager
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.blocks_total.set(blocks.num_usable_blocks)
        self.blocks_used.set(blocks.num_usable_blocks - blocks.num_free_blocks)
        totals = (
            scheduler.num_drafts,
            scheduler.num_draft_tokens,
            scheduler.num_accepted_tokens,
        )
        counters = (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens)
        for counter, now, seen in zip(counters, totals, self._spec_seen, strict=True):
            if now > seen:
                counter.inc(now - seen)
        self._spec_seen = totals
        if engine.prefix_store is not None:
            for name, now in engine.prefix_store.stats.as_dict().items():
                if now > self._disk_seen[name]:
                    self.disk[name].inc(now - self._disk_seen[name])
                    self._disk_seen[name] = now
