"""Requests and sampling parameters: host state only, no tensors."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import cast

import torch

from ember.runtime.outputs import IncrementalDetokenizer, Logprob


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` returns for a request (vLLM's meaning): CUMULATIVE, every step, all
    tokens so far; DELTA, every step, only the new ones; FINAL_ONLY, once, when it finishes
    (what `LLM.generate` uses: no per-step output is built)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling knobs with vLLM's meaning. Invalid values raise `ValueError` here.

    temperature 0 means greedy; top_k 0 or -1 disables top-k; logprobs is the number of top
    logprobs returned per generated token (None returns none).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = field(default_factory=lambda: RequestOutputKind.CUMULATIVE)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 1e4:
            raise ValueError(f"temperature must be in [0, 10000], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not 0.0 < rp <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {rp!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        self.stop = self._normalise_stop(self.stop)
        ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {ids!r}")
        self.stop_token_ids = ids
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be non-empty strings, got {stops!r}")
        return stops

    @property
    def stop_strings(self) -> list[str]:
        """`stop`, normalised to a list in `__post_init__`."""
        return cast(list[str], self.stop)

    @property
    def stop_ids(self) -> list[int]:
        return cast(list[int], self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finish_reason(self) -> str | None:
        """vLLM's `finish_reason`: "stop", "length", "abort" or "error" (the request failed on
        its own: `RequestOutput.error` says why); None while unfinished."""
        return self.value if self.finished else None

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(eq=False)
class Request:
    """One sequence being generated (or embedded: `pool`). Only the scheduler mutates it.

    `generator` is this request's own RNG, so seeded samples do not depend on the batch.
    `detokenizer` turns output tokens into `text` as they arrive (stop strings are found there);
    `logprobs` has one entry per output token when `params.logprobs` is set; `embedding` is the
    pooled result of an embedding request.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Encoder-decoder models: the encoder input, run once per admission; its cross-attention
    # K/V live in blocks of their own. Prefix-cache keys of the decoder tokens include it.
    encoder_token_ids: list[int] | None = None
    lora_id: int | None = None
    lora_generation: int = 0  # LoRAManager.generation of the adapter: part of the cache salt
    pool: bool = False
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    embedding: list[float] | None = None
    error: str | None = None
    all_token_ids: list[int] = field(init=False)
    cache_salt: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.cache_salt = b""
        if self.encoder_token_ids is not None:
            ids = ",".join(map(str, self.encoder_token_ids)).encode()
            self.cache_salt = hashlib.sha256(b"encoder:" + ids).digest()
        if self.lora_id is not None:  # two adapters (or two loads of one id) never share KV
            self.cache_salt = hashlib.sha256(
                self.cache_salt + f"lora:{self.lora_id}:{self.lora_generation}".encode()
            ).digest()

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
