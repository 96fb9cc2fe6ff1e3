"""Shape buckets: pure functions from step sizes to padded sizes.

A compiled graph is specialised on `num_tokens` only; `num_seqs` is a dynamic dimension of the
graph (only the opaque attention op and the logits gather see it), so one graph per token bucket
serves every mix of prefills and decodes. Measured reason: bucketing both dimensions multiplies
the graphs to compile (about 60 for the default budgets) for no speed gain, since nothing that
inductor generates depends on `num_seqs` beyond the final row gather.
"""

from __future__ import annotations

import bisect

# Dynamic dims specialise on sizes 0 and 1, so every step carries at least this many sequences
# (extra ones are empty padding sequences).
MIN_PADDED_SEQS = 2


def token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of two from 1, ending exactly at `max_num_batched_tokens`."""
    ladder = []
    n = 1
    while n < max_num_batched_tokens:
        ladder.append(n)
        n *= 2
    ladder.append(max_num_batched_tokens)
    return tuple(ladder)


def bucket_for(num_tokens: int, ladder: tuple[int, ...]) -> int:
    """Smallest bucket that holds `num_tokens`."""
    i = bisect.bisect_left(ladder, num_tokens)
    if i == len(ladder):
        raise ValueError(f"num_tokens={num_tokens} exceeds the largest bucket {ladder[-1]}")
    return ladder[i]


def padded_num_seqs(num_seqs: int) -> int:
    return max(num_seqs, MIN_PADDED_SEQS)
