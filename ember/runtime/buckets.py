"""Shape buckets: pure functions from step sizes to padded sizes (which graph a padded size runs:
`ember.compile.capture.CompiledForward.key`).

Graphs are specialised on `num_tokens` only: `num_seqs` is always a dynamic dimension (only the
opaque attention op and the logits gather see it). Token counts up to the largest static bucket
are padded to the next bucket and run a static graph; larger steps run one graph whose
`num_tokens` is dynamic, unpadded.

Measured on llama-160m, fp32, 2 cores (forward ms; compile s per graph):
  static per bucket (unfrozen): T=1 25.1, T=32 139.8, T=256 224.3; ~20 s each, 12 buckets for
  a 2048-token budget = 262 s cold start.
  one dynamic graph:            T=2 32.9, T=8 57.2, T=32 124.8, T=256 242.5; ~30 s once.
So the default ladder (`EngineArgs.token_buckets`) is (1,) (batch-1 decode keeps its faster
static graph) plus the dynamic graph: 2 compiles instead of 12, at most ~8% slower on large
steps.
"""

from __future__ import annotations

import bisect

# Dynamic dims specialise on sizes 0 and 1, so every step carries at least this many sequences
# (extra ones are empty padding sequences) and dynamic-token steps at least 2 tokens.
MIN_DYNAMIC_SIZE = 2


def padded_num_tokens(num_tokens: int, buckets: tuple[int, ...]) -> int:
    """The smallest static bucket holding `num_tokens`, or `num_tokens` itself past the ladder."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else num_tokens


def graph_sizes(buckets: tuple[int, ...], max_num_batched_tokens: int) -> tuple[int, ...]:
    """One example size per compiled graph: each static bucket, then one dynamic-size step if
    the budget goes past the ladder."""
    sizes = tuple(b for b in buckets if b <= max_num_batched_tokens)
    if max_num_batched_tokens > buckets[-1]:
        sizes += (max(buckets[-1] + 1, MIN_DYNAMIC_SIZE),)
    return sizes


def padded_num_seqs(num_seqs: int) -> int:
    return max(num_seqs, MIN_DYNAMIC_SIZE)
