"""Requests and sampling parameters: host state only, no tensors."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from ember.runtime.outputs import IncrementalDetokenizer, Logprob
from ember.runtime.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from ember.runtime.logits import LogitsControls
    from ember.runtime.multimodal import ImageInputs
    from ember.runtime.speculative import SpecState
    from ember.runtime.structured import GrammarState


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
    """Per-request sampling knobs with vLLM's meaning. Invalid values raise `ValueError` here
    (and, for what needs the model's vocabulary or tokenizer, when the request is added).

    temperature 0 means greedy; top_k 0 or -1 disables top-k; logprobs is the number of top
    logprobs returned per generated token (None returns none), prompt_logprobs the same for
    each prompt token (the first gets None).

    Logits controls, applied in this order to the model's logits before penalties and
    sampling (logprobs stay those of the model's own distribution): `logits_processors`
    (callables `f(output_ids, logits_row)` or `f(prompt_ids, output_ids, logits_row)` returning
    the row), `allowed_token_ids` (every other token is masked), `bad_words` (a word's last
    token is masked wherever the output ends with its other tokens; each word with and
    without a leading space), `logit_bias` (token id -> bias added, clamped to [-100, 100]),
    and `min_tokens` (EOS and stop tokens are masked, and stop strings are not matched, until
    that many tokens are out). `truncate_prompt_tokens` keeps only the last k prompt tokens
    (-1: the last max_model_len - 1). `structured_outputs` (or `guided_decoding`) constrains
    the output to a JSON schema, regex, choice or grammar (`ember.runtime.structured`).
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
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: list[Callable[..., Any]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's earlier name

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
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        pl = self.prompt_logprobs
        if pl is not None and (not _is_int(pl) or pl < 0):
            raise ValueError(f"prompt_logprobs must be None or an integer >= 0, got {pl!r}")
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            allowed = list(self.allowed_token_ids)
            if not allowed or not all(_is_int(t) and t >= 0 for t in allowed):
                raise ValueError(
                    "allowed_token_ids must be a non-empty list of non-negative integers, got "
                    f"{self.allowed_token_ids!r}"
                )
            self.allowed_token_ids = allowed
        words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
        if words is not None:
            if not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be non-empty strings, got {words!r}")
            self.bad_words = list(dict.fromkeys(words))
        tp = self.truncate_prompt_tokens
        if tp is not None and (not _is_int(tp) or (tp < 1 and tp != -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or >= 1, got {tp!r}")
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("set structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        so = self.structured_outputs
        if isinstance(so, dict):
            self.structured_outputs = so = StructuredOutputsParams(**so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}"
            )
        if self.logits_processors is not None:
            procs = list(self.logits_processors)
            if not all(callable(f) for f in procs):
                raise ValueError("logits_processors must be a list of callables")
            self.logits_processors = procs

    @staticmethod
    def _normalise_logit_bias(bias: dict[Any, float] | None) -> dict[int, float] | None:
        """Token ids as ints (vLLM accepts their strings too, as JSON keys are), biases clamped
        to [-100, 100]."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if token < 0 or isinstance(key, (bool, float)):
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"logit_bias[{key!r}] must be a number, got {value!r}")
            out[token] = min(100.0, max(-100.0, float(value)))
        return out

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

    `eos_token_id` is the model's EOS (finish_reason "stop", no stop_reason);
    `other_eos_ids` the other EOS ids of its generation config, which stop it as stop tokens
    do (stop_reason = the id), as in vLLM; neither stops it with `ignore_eos`.
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
    # Vision-language models: the request's images (run through the vision tower once per
    # admission; their K/V live in the request's cross blocks too).
    images: ImageInputs | None = None
    lora_id: int | None = None
    lora_digest: bytes = b""  # LoRAManager.digest of the adapter: part of the cache salt
    pool: bool = False
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    embedding: list[float] | None = None
    error: str | None = None
    other_eos_ids: frozenset[int] = frozenset()
    controls: LogitsControls | None = None  # the params' logits controls, resolved
    grammar: GrammarState | None = None  # structured outputs: this sequence's matcher
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    spec: SpecState | None = None  # speculative decoding: this request's proposal schedule
    all_token_ids: list[int] = field(init=False)
    cache_salt: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.cache_salt = b""
        if self.encoder_token_ids is not None:
            ids = ",".join(map(str, self.encoder_token_ids)).encode()
            self.cache_salt = hashlib.sha256(b"encoder:" + ids).digest()
        if self.images is not None:  # every token's K/V depends on the images
            self.cache_salt = hashlib.sha256(b"images:" + self.images.digest).digest()
        if self.lora_id is not None:  # two adapters never share KV (the same one may)
            self.cache_salt = hashlib.sha256(self.cache_salt + b"lora:" + self.lora_digest).digest()

    @property
    def num_encoder_tokens(self) -> int:
        """Rows of the request's cross-attention K/V (encoder input or image tokens), or 0."""
        if self.encoder_token_ids is not None:
            return len(self.encoder_token_ids)
        return self.images.num_tokens if self.images is not None else 0

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
