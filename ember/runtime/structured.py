"""Structured outputs: `SamplingParams(structured_outputs=StructuredOutputsParams(...))` (or vLLM's
older `guided_decoding=GuidedDecodingParams(...)`) constrains a request's tokens to a JSON
schema, a regex, a choice of strings or an EBNF grammar, with xgrammar (vLLM's default backend).

Chosen by measurement on Qwen2's tokenizer (151,936 ids), a JSON schema, 87 tokens, AMD EPYC:
filling the next-token bitmask took 2-3 us per token with xgrammar 0.2.9 against 8-26 us with
llguidance 1.9.1; applying it to the logits took 250 us with xgrammar's CPU function, so the
mask is applied by ember's own kernel (`ember_cpu::apply_token_bitmask`, ~45 us a row).

Each request gets its own matcher (one per sequence of `n`), compiled grammars are cached by
the compiler. Per step, the rows of requests with a grammar get their bitmask filled and
applied in the sampler's host code (the compiled graph never changes); the sampled token is
accepted by the matcher when the scheduler appends it, and a grammar that has terminated
finishes its request with "stop". A request cut by `max_tokens` may hold an incomplete
document; one that stops never emits text outside the grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ember import kernels

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, dict or string), `regex`, `choice` (a list of
    strings), `grammar` (EBNF / GBNF), `json_object=True` (any JSON object).
    `disable_any_whitespace`: no free whitespace between JSON tokens (vLLM's option).
    `start_after` (ember's): the grammar applies only once the output holds this text's tokens
    (a reasoning model's `</think>`: `ember serve --reasoning-parser` sets it, so that, as in
    vLLM, the structure constrains the answer after the reasoning)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    start_after: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be non-empty strings, got {self.choice!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (dict or string)")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's earlier name


class GrammarCompiler:
    """One per engine: xgrammar's compiler over the model's tokenizer and vocabulary (ids past
    the tokenizer's are never allowed); `stop_ids` end a finished document."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        try:
            import xgrammar as xgr  # noqa: PLC0415
        except ImportError as e:
            raise ValueError(
                "structured outputs need xgrammar: pip install 'ember[structured]'"
            ) from e
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar, or ValueError naming the field and xgrammar's complaint."""
        kind = params.kind
        ws = not params.disable_any_whitespace
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return self._compiler.compile_json_schema(schema, any_whitespace=ws)
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                rule = " | ".join(json.dumps(c) for c in params.choice or ())
                return self._compiler.compile_grammar(f"root ::= {rule}")
            return self._compiler.compile_grammar(params.grammar)
        except Exception as e:  # noqa: BLE001  (xgrammar raises RuntimeError/ValueError/its own)
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {e}") from e

    def matcher(self, compiled: Any, wait_for: list[int] | None = None) -> GrammarState:
        """A sequence's matcher of `compiled`; with `wait_for` (token ids), dormant until the
        output ends with them."""
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.vocab_size, wait_for)


def fill_bitmasks(states: list[GrammarState]) -> torch.Tensor:
    """The next-token bitmasks of `states` ([len, words] int32), filled by xgrammar's batch
    matcher on all of torch's threads (one grammar's fill is ~1 ms for a character-class
    grammar over a 262k-id vocabulary: 32 of them would serialise 32 ms per step)."""
    import xgrammar as xgr  # noqa: PLC0415  (present: the states were made by it)

    global _batch_matcher
    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher(max_threads=max(torch.get_num_threads(), 1))
    words = states[0].words
    bitmask = torch.empty(len(states), words, dtype=torch.int32)
    if len(states) == 1:
        states[0].matcher.fill_next_token_bitmask(bitmask, 0)
    else:
        _batch_matcher.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
    return bitmask


_batch_matcher: Any = None


class GrammarState:
    """One sequence's grammar matcher (`fill_bitmasks` fills the next-token masks of many)."""

    def __init__(self, matcher: Any, vocab_size: int, wait_for: list[int] | None = None) -> None:
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32
        self.wait_for = list(wait_for or [])
        self.active = not self.wait_for  # dormant (no mask, every token taken) until then
        self._tail: list[int] = []

    def accept(self, token: int) -> bool:
        if not self.active:
            self._tail = (self._tail + [token])[-len(self.wait_for) :]
            self.active = self._tail == self.wait_for
            return True
        return bool(self.matcher.accept_token(token))

    def masks_along(self, tokens: tuple[int, ...]) -> list[torch.Tensor | None]:
        """Speculative decoding: the next-token bitmask ([1, words]) after each prefix of
        `tokens` (the empty one first), None where the grammar is dormant there; the list stops
        after the first token the grammar refuses (its mask refuses it). The state is left as
        it was."""
        active, tail = self.active, self._tail
        masks: list[torch.Tensor | None] = []
        advanced = 0  # tokens the matcher took, to roll back
        try:
            for j in range(len(tokens) + 1):
                if self.active:
                    mask = torch.empty(1, self.words, dtype=torch.int32)
                    self.matcher.fill_next_token_bitmask(mask, 0)
                    masks.append(mask)
                else:
                    masks.append(None)
                if j == len(tokens):
                    break
                was_active = self.active
                if not self.accept(tokens[j]):
                    break
                advanced += was_active
        finally:
            if advanced:
                self.matcher.rollback(advanced)
            self.active, self._tail = active, tail
        return masks

    @property
    def terminated(self) -> bool:
        return self.active and bool(self.matcher.is_terminated())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [rows, vocab] float32 (in place) = -inf where the bit of `bitmask [rows, words]`
    is 0."""
    if kernels.loaded_isa() is not None:
        torch.ops.ember_cpu.apply_token_bitmask(logits, bitmask)
        return
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    if allowed.shape[1] < logits.shape[1]:
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
    logits.masked_fill_(~allowed, float("-inf"))
