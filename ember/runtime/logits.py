"""Per-request logits controls: the `SamplingParams` fields that act on a request's logits before
penalties and sampling (vLLM's meaning), resolved once when the request is added (checked
against the model's vocabulary and tokenizer) and applied to the rows of a step's logits that
have any. They run on the host, outside the compiled graph, so no request recompiles it.

Order per row: the request's own `logits_processors`, `allowed_token_ids`, `bad_words`,
`logit_bias`, then `min_tokens` (EOS and stop tokens masked until enough tokens are out).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ember.runtime.request import SamplingParams


@dataclass(frozen=True)
class LogitsControls:
    """One request's resolved controls (see `resolve`)."""

    processors: tuple[tuple[Callable[..., Any], bool], ...] = ()  # (fn, takes prompt ids)
    allowed: torch.Tensor | None = None  # [k] token ids; every other token is masked
    bad_words: tuple[tuple[int, ...], ...] = ()
    bias_ids: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    min_tokens: int = 0
    stop_ids: torch.Tensor | None = None  # masked while fewer than min_tokens are out


def _check_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} token ids must be in [0, {vocab_size}); got {bad[:5]}")


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Each word's tokens, as it would appear at the start of the text and after a space (the
    second only where it tokenizes differently with the same length), as vLLM does."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def _takes_prompt(fn: Callable[..., Any]) -> bool:
    """vLLM's two processor signatures: (output_ids, logits) or (prompt_ids, output_ids,
    logits), told apart by the number of parameters."""
    try:
        return len(inspect.signature(fn).parameters) == 3
    except (TypeError, ValueError):  # no signature to read: the two-argument form
        return False


def resolve(
    params: SamplingParams,
    vocab_size: int,
    tokenizer: Any,
    stop_ids: Sequence[int],
) -> LogitsControls | None:
    """The request's controls, or None when it has none. `stop_ids`: every token that ends it
    (EOS ids and `stop_token_ids`), masked while `min_tokens` are not out. Raises ValueError
    naming the field for ids outside the vocabulary, or bad words without a tokenizer."""
    controls: dict[str, Any] = {}
    if params.logits_processors:
        controls["processors"] = tuple((f, _takes_prompt(f)) for f in params.logits_processors)
    if params.allowed_token_ids is not None:
        _check_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
        controls["allowed"] = torch.tensor(sorted(set(params.allowed_token_ids)))
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this model has none")
        words = bad_words_token_ids(params.bad_words, tokenizer)
        _check_ids("bad_words", [t for w in words for t in w], vocab_size)
        controls["bad_words"] = tuple(tuple(w) for w in words)
    if params.logit_bias:
        ids = list(params.logit_bias)
        _check_ids("logit_bias", ids, vocab_size)
        controls["bias_ids"] = torch.tensor(ids)
        controls["bias"] = torch.tensor([params.logit_bias[t] for t in ids])
    stops = sorted({t for t in stop_ids if 0 <= t < vocab_size})
    if params.min_tokens > 0 and stops:
        controls["min_tokens"] = params.min_tokens
        controls["stop_ids"] = torch.tensor(stops)
    return LogitsControls(**controls) if controls else None


def _apply(
    row: torch.Tensor, c: LogitsControls, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    for fn, takes_prompt in c.processors:
        args = (list(prompt_ids), list(output_ids)) if takes_prompt else (list(output_ids),)
        out = fn(*args, row)
        if not isinstance(out, torch.Tensor) or out.shape != row.shape:
            raise ValueError(
                f"a logits processor must return a tensor of shape {tuple(row.shape)}, got "
                f"{type(out).__name__} {getattr(out, 'shape', '')}"
            )
        row = out.to(torch.float32)
    if c.allowed is not None:
        keep = row.index_select(0, c.allowed)
        row = torch.full_like(row, float("-inf")).index_copy_(0, c.allowed, keep)
    if c.bad_words:
        banned = [
            w[-1]
            for w in c.bad_words
            if len(w) == 1
            or (len(output_ids) >= len(w) - 1 and tuple(output_ids[-(len(w) - 1) :]) == w[:-1])
        ]
        if banned:
            row = row.index_fill(0, torch.tensor(banned), float("-inf"))
    if c.bias_ids is not None and c.bias is not None:
        row = row.index_add(0, c.bias_ids, c.bias)
    if c.stop_ids is not None and len(output_ids) < c.min_tokens:
        row = row.index_fill(0, c.stop_ids, float("-inf"))
    return row


def apply_controls(
    logits: torch.Tensor,
    controls: Sequence[LogitsControls | None],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> dict[int, str]:
    """Apply each row's controls to `logits [num_seqs, vocab]` (float32) in place; rows
    without any are not touched. Returns {row: error} for rows whose processor raised (that
    row is left as it was, the others go on)."""
    errors: dict[int, str] = {}
    for i, c in enumerate(controls):
        if c is None:
            continue
        try:
            logits[i] = _apply(logits[i], c, prompt_ids[i], output_ids[i])
        except Exception as e:  # noqa: BLE001  (a user's processor: fails its own request)
            errors[i] = f"logits controls failed: {type(e).__name__}: {e}"
    return errors
