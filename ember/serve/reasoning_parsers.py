"""Reasoning parsers: vLLM's `--reasoning-parser NAME` (`deepseek_r1`, `qwen3`), which split a
model's `<think>...</think>` reasoning from its answer into `reasoning_content` and `content`.

`ReasoningParser.extract` splits a whole output; `ReasoningParser.stream` gives a per-request
`ReasoningStream` that is fed the output piece by piece and returns (reasoning, content) pieces.
Both run the same state machine, so for any split of a text the pieces concatenate exactly to
`extract`'s results. A stream releases text at once except a suffix that may begin a tag
(`</th` at the end of the reasoning, `<thi` at the start of the output).

The rules, as vLLM's (neither strips the newlines around the tags: Qwen3's
`<think>\\nA\\n</think>\\n\\nB` gives reasoning `\\nA\\n` and content `\\n\\nB`):
- A `<think>` opening the output (after whitespace, dropped with it) starts the reasoning.
- The reasoning ends at the first `</think>`; everything after it is content, tags included.
- An output that ends inside the reasoning is all reasoning (content None).
- An output that does not open with `<think>`: `deepseek_r1` starts it inside the reasoning
  (its chat templates put `<think>` in the prompt), `qwen3` makes it all content (thinking off,
  `enable_thinking=false`).
Empty parts are None.

Adding a parser is one class: set `name` (and `start`/`end` for other tags, `implicit_start`
for outputs that begin inside the reasoning), decorate it with `register_reasoning_parser`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ember.serve.registry import Registry
from ember.serve.tool_parsers import held_prefix


class ReasoningParser:
    """Base class of the reasoning parsers, keyed by `name` in `REASONING_PARSERS`: reasoning
    between `start` and `end`; `implicit_start` says whether an output that does not open with
    `start` begins inside the reasoning (True) or is all content (False)."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    implicit_start: ClassVar[bool] = True

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output, each None when empty."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        last_reasoning, last_content = stream.finish()
        return (reasoning + last_reasoning) or None, (content + last_content) or None

    def stream(self) -> ReasoningStream:
        """Fresh per-request streaming state."""
        return ReasoningStream(self)


class ReasoningStream:
    """The streaming state of one output: `feed` each new piece of text, then `finish` once;
    each returns the (reasoning, content) text it releases."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._mode = "start"  # "start" (undecided), "reasoning" or "content"
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the output is still inside the reasoning part (or, undecided, would be)."""
        return self._mode == "reasoning" or (self._mode == "start" and self._parser.implicit_start)

    def feed(self, delta_text: str) -> tuple[str, str]:
        """The (reasoning, content) pieces that `delta_text` completes."""
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Everything still held, at the end of the output."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        start, end = self._parser.start, self._parser.end
        reasoning = ""
        if self._mode == "start":
            opened = self._buf.lstrip()
            if opened.startswith(start):
                self._buf = opened[len(start) :]
                self._mode = "reasoning"
            elif start.startswith(opened) and not final:
                return "", ""
            else:
                self._mode = "reasoning" if self._parser.implicit_start else "content"
        if self._mode == "reasoning":
            close = self._buf.find(end)
            if close >= 0:
                reasoning = self._buf[:close]
                self._buf = self._buf[close + len(end) :]
                self._mode = "content"
            else:
                ready = len(self._buf) - (0 if final else held_prefix(self._buf, end))
                reasoning = self._buf[:ready]
                self._buf = self._buf[ready:]
                return reasoning, ""
        content, self._buf = self._buf, ""
        return reasoning, content


_REGISTRY: Registry[type[ReasoningParser]] = Registry("reasoning parser", "reasoning_parser")
REASONING_PARSERS = _REGISTRY.classes
register_reasoning_parser = _REGISTRY.register  # class decorator: adds a class under its `name`
get_reasoning_parser = _REGISTRY.get  # the class of a `--reasoning-parser` name


@register_reasoning_parser
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek R1 and its distills (and QwQ, Qwen3 *-Thinking-2507, whose templates also open
    `<think>` in the prompt): the output begins inside the reasoning, a leading `<think>` is
    dropped, the reasoning ends at `</think>`; no `</think>` means all reasoning."""

    name = "deepseek_r1"


@register_reasoning_parser
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the output opens with `<think>` (the model writes it); then it
    ends at `</think>`, or at the end of an output cut short. Without `<think>` (thinking
    disabled) the output is all content."""

    name = "qwen3"
    implicit_start = False
