"""User-facing outputs and incremental detokenization with stop strings (vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token (the first is None).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `PoolingRequestOutput` for the embed task: `.outputs.embedding`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """vLLM's: the class probabilities (the activated logits) and their count."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's `ClassificationRequestOutput`: `.outputs.probs`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's `ScoringRequestOutput`: `.outputs.score` of one text pair."""

    request_id: str
    prompt_token_ids: list[int]  # the pair's tokens (a cross-encoder's), or both texts'
    outputs: ScoringOutput
    finished: bool = True


def _decode_stream(
    tokenizer: PreTrainedTokenizerBase | None, skip_special_tokens: bool, context: list[int]
) -> tuple[Any, Any] | None:
    """A `tokenizers` DecodeStream primed with `context`, and the Rust tokenizer it steps
    with, where it decodes exactly as `tokenizer.decode` does: a fast tokenizer without
    clean-up of tokenization spaces (which only the Python side applies). None otherwise, or
    when `context` ends inside a character (the stream would emit its rest as output)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        out = ""
        for token_id in context:
            out = stream.step(backend, token_id)
        # Held back: fine after a special token, not after part of a character anywhere.
        if out is None and context:
            if "\ufffd" in backend.decode(context, skip_special_tokens=skip_special_tokens):
                return None
    except Exception:  # noqa: BLE001  (an old tokenizers, or one this stream cannot decode)
        return None
    return stream, backend


@dataclass
class IncrementalDetokenizer:
    """Decodes new tokens without re-decoding the whole output each step.

    Keeps a window [prefix_offset, read_offset) of already-emitted tokens so that multi-token
    characters and leading spaces decode correctly; text ending in U+FFFD (an incomplete byte
    sequence) is held back until the next token completes it.

    With a fast tokenizer the same window is kept by `tokenizers`' DecodeStream in Rust: one
    call per token instead of two `tokenizer.decode` calls through transformers' Python, which
    run cache-cold after each step (llama-160m, batch 1: 64-71 us a token). If the stream ever
    fails, this request continues on the Python window from the same offsets.
    """

    tokenizer: PreTrainedTokenizerBase | None
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        # Seed the window with a few prompt tokens so the first output token decodes in context.
        tail = self.prompt_token_ids[-6:]
        self.token_ids = list(tail)
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self._num_context = len(tail)
        self._stream = _decode_stream(self.tokenizer, self.skip_special_tokens, tail)

    def _decode(self, ids: list[int]) -> str:
        assert self.tokenizer is not None
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def _emit(self, new: str) -> int:
        self.text += new
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return len(new)

    def append(self, token_id: int) -> int:
        """Add one token; returns how many characters were appended to `text`."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:
            return 0
        if self._stream is not None:
            stream, backend = self._stream
            try:
                new = stream.step(backend, token_id)
            except Exception:  # noqa: BLE001  (e.g. "invalid prefix": the window below copes)
                self._stream = None
            else:
                return 0 if new is None else self._emit(new)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return 0
        return self._emit(full[len(prefix) :])

    def flush(self) -> None:
        """At the end, emit whatever was held back (an incomplete character stays as U+FFFD)."""
        if self.tokenizer is None or self._read_offset == len(self.token_ids):
            return
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
        self._read_offset = len(self.token_ids)


def find_stop_string(
    text: str, num_new_chars: int, stops: list[str], include_stop: bool
) -> tuple[str, str] | None:
    """If a stop string appears in the last `num_new_chars` (plus overlap), return
    (truncated text, the stop string). The text ends before the stop string unless
    `include_stop`."""
    if not num_new_chars:
        return None
    for stop in stops:
        index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if index != -1:
            end = index + len(stop) if include_stop else index
            return text[:end], stop
    return None
