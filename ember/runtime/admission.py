"""Admission by host memory: what a request will hold in this process (its sequences, their
token ids, text, logprobs and outputs) estimated before it is queued, and a budget that refuses
requests which would take the process past it, instead of growing until the kernel's OOM
killer ends the process and every request in it.

The estimate is an upper bound from the request's own fields (n, max_tokens clipped to the
context, logprobs, prompt logprobs, the prompt's size), not from the model: the model's weights
and KV cache are allocated once at start and are part of the resident size the budget starts
from. A request is admitted while the resident size now, plus what the admitted requests may
still grow to, plus its own estimate stays within the budget.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

from ember.errors import EngineOverloadedError
from ember.runtime.request import SamplingParams

# Per sequence: the Request, its torch.Generator (~5 KB of state), detokenizer, block lists and
# output objects; per output token: its id, text and the objects of one output (measured:
# ~0.1 KB; kept at 2.5x); per logprob entry of a token: a Logprob, its decoded text and dict
# slot (~0.3 KB, kept at 0.5).
SEQUENCE_BYTES = 64 << 10
TOKEN_BYTES = 256
LOGPROB_BYTES = 512


def request_bytes(
    params: SamplingParams, prompt_bytes: int, prompt_tokens: int, max_model_len: int
) -> int:
    """An upper bound of the host memory one request will hold: `params.n` sequences of up
    to `max_tokens` (clipped to the context) tokens each, with their logprobs, and the
    prompt (`prompt_bytes` as given, `prompt_tokens` at most) with its prompt logprobs."""
    tokens = min(params.max_tokens or max_model_len, max_model_len)
    per_token = TOKEN_BYTES
    if params.logprobs is not None:
        per_token += (params.logprobs + 1) * LOGPROB_BYTES
    prompt = prompt_bytes + prompt_tokens * TOKEN_BYTES
    if params.prompt_logprobs is not None:
        prompt += prompt_tokens * (params.prompt_logprobs + 1) * LOGPROB_BYTES
    return params.n * (SEQUENCE_BYTES + tokens * per_token) + prompt


def resident_bytes() -> int:
    """This process's resident set size (Linux: /proc/self/statm; elsewhere 0)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def host_memory_bytes() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


@dataclass
class HostMemoryBudget:
    """Admits requests while the process stays within `budget_bytes` (thread-safe). Each
    admitted request holds its estimate until `release`."""

    budget_bytes: int

    def __post_init__(self) -> None:
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def fraction(cls, fraction: float) -> HostMemoryBudget:
        """A budget of `fraction` (0, 1] of the memory this process may use."""
        if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"host memory fraction must be in (0, 1], got {fraction!r}")
        return cls(int(fraction * host_memory_bytes()))

    def admit(self, request_id: str, estimate: int) -> None:
        """Reserve `estimate` bytes for `request_id`, or raise EngineOverloadedError."""
        with self._lock:
            reserved = sum(self._reserved.values())
            now = resident_bytes()
            if now + reserved + estimate > self.budget_bytes:
                raise EngineOverloadedError(
                    f"the server is at its host memory budget ({self.budget_bytes >> 20} MiB: "
                    f"{now >> 20} MiB resident, {reserved >> 20} MiB held for requests in "
                    f"flight, {estimate >> 20} MiB for this one); retry later or ask for "
                    "fewer sequences, tokens or logprobs"
                )
            self._reserved[request_id] = estimate

    def release(self, request_id: str) -> None:
        with self._lock:
            self._reserved.pop(request_id, None)

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(self._reserved.values())
