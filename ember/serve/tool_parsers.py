"""Tool-call parsers for model output text: vLLM's `--enable-auto-tool-choice --tool-call-parser
NAME` (`hermes`, `llama3_json`, `mistral`, `pythonic`), for whole outputs and for streams.

A parser turns output text into content plus `ToolCall`s, each call's `arguments` a JSON object
string (`json.dumps(arguments, ensure_ascii=False)`). `ToolParser.extract` parses a whole output;
`ToolParser.stream` gives a per-request `ToolStream` that is fed the output piece by piece. Both
run the same scanner, so for any split of a text the streamed content pieces concatenate to
`extract`'s content and the streamed calls equal `extract`'s calls (names, arguments, order).

Content rules, the same for every parser:
- A call whose JSON (or Python literal) does not parse, or that lacks a string name or an object
  of arguments, is no call: its text stays content (vLLM falls back to content too).
- Content is the text outside the calls. Whitespace next to a call is dropped, and the pieces
  of text on either side of a call are joined by one newline. An output without calls is its
  own content, unchanged; empty content is None.

Streaming: text that cannot start a call is released at once, except trailing whitespace (it is
dropped if a call follows) and a suffix that may begin a marker (`<tool_` for `<tool_call>`). A
call is emitted, as one `ToolCallDelta` with its id, name and whole arguments string, as soon as
it is complete (at `</tool_call>`, at the JSON's closing brace, ...); `finish` settles whatever
is held (an unclosed, unparseable call is released as content).

Adding a parser is one class: set `name`, implement `step` (see `ToolParser`), decorate it with
`register_tool_parser`. `held_prefix` and `json_end` are the helpers the parsers here use.
"""

from __future__ import annotations

import abc
import ast
import json
import math
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ember.serve.registry import Registry


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON object string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ToolCallDelta:
    """One streaming piece of one tool call (OpenAI's `delta.tool_calls[i]`): `id` and `name`
    are set on a call's first delta only; `arguments` is a piece of the arguments string."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one `ToolStream.feed` or `finish` yields: content text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


Step = tuple[list[str | ToolCall], int, str]


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (the text a
    stream must hold back because the next piece may complete the marker)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def json_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array opening at `text[start]` (`{` or `[`), found
    by matching brackets outside strings; None when `text` ends first. The span is not
    validated: `json.loads` decides whether it is JSON."""
    depth = 0
    in_string = False
    i = start
    while i < len(text):
        char = text[i]
        if in_string:
            if char == "\\":
                i += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(text: str) -> Any:
    """`text` parsed as strict JSON (no NaN or Infinity), or None when it is not JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _content_until(buf: str, marker: str, mode: str, final: bool) -> Step | None:
    """The step for text before a marker: everything up to the marker's first occurrence, or
    (no marker) all of `buf` but a suffix that may begin the marker; None if nothing is ready."""
    start = buf.find(marker)
    if start < 0:
        start = len(buf) - (0 if final else held_prefix(buf, marker))
    return ([buf[:start]], start, mode) if start else None


class ToolParser(abc.ABC):
    """Base class of the tool-call parsers, keyed by `name` in `TOOL_PARSERS`.

    `needs_special_tokens` is True when the parser's markers are special tokens that the
    detokenizer must keep (the server then decodes with `skip_special_tokens=False`).

    A subclass implements `step(buf, mode, final)`, one decision about the start of `buf` (the
    output text not yet consumed; `mode` is the parser's own state, `initial_mode` at first):
    it returns `(items, consumed, next_mode)`, where `items` are content strings and
    `ToolCall`s (from `make_call`) covering `buf[:consumed]`, `consumed > 0`; or None when the
    decision needs more text. With `final` (the output has ended) it must decide. A decision
    must not depend on text after `buf[:consumed]`, so that every split of an output gives the
    same items.
    """

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False
    initial_mode: ClassVar[str] = "start"

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def step(self, buf: str, mode: str, final: bool) -> Step | None:
        """One decision about the start of `buf` (see the class docstring)."""

    def new_id(self) -> str:
        """A fresh tool-call id (OpenAI's `call_` form)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def make_call(self, name: Any, arguments: Any) -> ToolCall | None:
        """The call of a parsed name and arguments, or None unless the name is a non-empty
        string and the arguments a dict (a JSON object)."""
        if not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict):
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False), id=self.new_id())

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output. No parseable call: (text, []). Content is the text
        outside the calls, whitespace next to a call dropped, None when empty."""
        stream = self.stream()
        content = stream.feed(text).content + stream.finish().content
        return content or None, stream.calls

    def stream(self) -> ToolStream:
        """Fresh per-request streaming state."""
        return ToolStream(self)


class ToolStream:
    """The streaming state of one output: `feed` each new piece of text, then `finish` once.
    `calls` lists the calls emitted so far."""

    def __init__(self, parser: ToolParser) -> None:
        self.calls: list[ToolCall] = []
        self._parser = parser
        self._mode = parser.initial_mode
        self._buf = ""
        self._space = ""  # trailing whitespace of the content, held until text or a call follows
        self._after_call = False  # a call was the last item: drop the whitespace that follows
        self._emitted = False  # some content has been emitted
        self._separate = False  # the next content follows a call that followed content

    def feed(self, delta_text: str) -> StreamDelta:
        """The content and calls that `delta_text` completes."""
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> StreamDelta:
        """Everything still held, at the end of the output."""
        out = self._drain(final=True)
        out.content += self._space
        self._space = ""
        return out

    def _drain(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        while self._buf:
            step = self._parser.step(self._buf, self._mode, final)
            if step is None:
                break
            items, consumed, self._mode = step
            self._buf = self._buf[consumed:]
            for item in items:
                if isinstance(item, ToolCall):
                    self._add_call(item, out)
                else:
                    self._add_content(item, out)
        return out

    def _add_call(self, call: ToolCall, out: StreamDelta) -> None:
        self._space = ""
        self._after_call = True
        self._separate = self._emitted
        out.tool_calls.append(ToolCallDelta(len(self.calls), call.id, call.name, call.arguments))
        self.calls.append(call)

    def _add_content(self, text: str, out: StreamDelta) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            out.content += ("\n" if self._separate else "") + body
            self._separate = False
            self._emitted = True


_REGISTRY: Registry[type[ToolParser]] = Registry("tool parser", "tool_call_parser")
TOOL_PARSERS = _REGISTRY.classes
register_tool_parser = _REGISTRY.register  # class decorator: adds a class under its `name`
get_tool_parser = _REGISTRY.get  # the class of a `--tool-call-parser` name


@register_tool_parser
class HermesToolParser(ToolParser):
    """Hermes 2/3, Qwen2.5 and Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
    </tool_call>` blocks, any number, anywhere in the output. A last block left unclosed (the
    output stopped before `</tool_call>`) is still a call when its JSON parses, as in vLLM."""

    name = "hermes"
    OPEN: ClassVar[str] = "<tool_call>"
    CLOSE: ClassVar[str] = "</tool_call>"

    def step(self, buf: str, mode: str, final: bool) -> Step | None:
        if not buf.startswith(self.OPEN):
            return _content_until(buf, self.OPEN, mode, final)
        end = buf.find(self.CLOSE, len(self.OPEN))
        if end < 0:
            if not final:
                return None
            call = self._call(buf[len(self.OPEN) :])
            return [call or buf], len(buf), mode
        consumed = end + len(self.CLOSE)
        return [self._call(buf[len(self.OPEN) : end]) or buf[:consumed]], consumed, mode

    def _call(self, body: str) -> ToolCall | None:
        obj = _json(body)
        if not isinstance(obj, dict):
            return None
        return self.make_call(obj.get("name"), obj.get("arguments"))


@register_tool_parser
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calling: the output is `{"name": ..., "parameters": {...}}`
    (`"arguments"` is accepted too and wins when both are there), optionally after
    `<|python_tag|>`, several calls separated by `;`. An output that does not start (after
    whitespace and the tag) with a call is content, whole; text after the calls is content."""

    name = "llama3_json"
    needs_special_tokens = True
    TAG: ClassVar[str] = "<|python_tag|>"
    _SEPARATOR: ClassVar[re.Pattern[str]] = re.compile(r"\s*(;\s*)?")

    def step(self, buf: str, mode: str, final: bool) -> Step | None:
        if mode == "text":
            return [buf], len(buf), mode
        if mode == "start":
            i = _skip_space(buf, 0)
            if buf.startswith(self.TAG, i):
                i = _skip_space(buf, i + len(self.TAG))
            elif self.TAG.startswith(buf[i:]):
                return ([buf], len(buf), "text") if final else None
            if i == len(buf):
                return ([buf], len(buf), "text") if final else None
        else:  # "calls": after a call, only `; {...}` continues the calls
            match = self._SEPARATOR.match(buf)
            i = match.end()
            if i == len(buf):
                return ([], len(buf), mode) if final else None
            if match.group(1) is None:
                return [buf], len(buf), "text"
        if buf[i] != "{":
            return [buf], len(buf), "text"
        end = json_end(buf, i)
        if end is None:
            return ([buf], len(buf), "text") if final else None
        call = self._call(buf[i:end])
        return ([call], end, "calls") if call else ([buf[:end]], end, "text")

    def _call(self, body: str) -> ToolCall | None:
        obj = _json(body)
        if not isinstance(obj, dict):
            return None
        arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters")
        return self.make_call(obj.get("name"), arguments)


_ALPHANUMERIC = string.ascii_letters + string.digits


@register_tool_parser
class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` then a JSON array `[{"name": ..., "arguments": {...}}, ...]`
    (Mistral 7B v0.3, Nemo), or `[TOOL_CALLS]name[ARGS]{...}` / `[TOOL_CALLS]name{...}` (newer
    tokenizers), repeatable. Call ids are 9 alphanumeric characters, as Mistral requires."""

    name = "mistral"
    needs_special_tokens = True
    BOT: ClassVar[str] = "[TOOL_CALLS]"
    ARGS: ClassVar[str] = "[ARGS]"
    _NAME: ClassVar[re.Pattern[str]] = re.compile(r"[\w.\-]*")

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def step(self, buf: str, mode: str, final: bool) -> Step | None:
        if not buf.startswith(self.BOT):
            return _content_until(buf, self.BOT, mode, final)
        i = _skip_space(buf, len(self.BOT))
        if i < len(buf) and buf[i] == "[":
            end = json_end(buf, i)
            if end is None:
                return ([buf], len(buf), mode) if final else None
            calls = self._array_calls(buf[i:end])
            return (calls or [buf[:end]]), end, mode
        i = self._NAME.match(buf, i).end()
        name = buf[len(self.BOT) : i].strip()
        if buf.startswith(self.ARGS, i):
            i += len(self.ARGS)
        elif i < len(buf) and self.ARGS.startswith(buf[i:]) and not final:
            return None
        i = _skip_space(buf, i)
        if i == len(buf):
            return ([buf], len(buf), mode) if final else None
        if not name or buf[i] != "{":
            return [self.BOT], len(self.BOT), mode
        end = json_end(buf, i)
        if end is None:
            return ([buf], len(buf), mode) if final else None
        return [self.make_call(name, _json(buf[i:end])) or buf[:end]], end, mode

    def _array_calls(self, body: str) -> list[str | ToolCall]:
        items = _json(body)
        if not isinstance(items, list):
            return []
        calls = [
            self.make_call(item.get("name"), item.get("arguments"))
            if isinstance(item, dict)
            else None
            for item in items
        ]
        return [] if None in calls else calls


class _NotLiteral(Exception):
    """A pythonic call argument that is not a JSON-able literal."""


def _literal(node: ast.expr) -> Any:
    """The JSON value of a Python literal: str, int, float (finite), bool, None, and lists and
    dicts (string keys) of them; `_NotLiteral` for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotLiteral
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
    elif isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise _NotLiteral
        return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    raise _NotLiteral


def _python_end(text: str, start: int) -> int | None:
    """End (exclusive) of the Python bracket expression opening at `text[start]`, matching
    brackets outside string literals ('...', "...", and triple-quoted); None when `text` ends
    first."""
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char in "'\"":
            quote = text[i : i + 3] if text.startswith(char * 3, i) else char
            i += len(quote)
            while not text.startswith(quote, i):
                if i >= len(text):
                    return None
                i += 2 if text[i] == "\\" else 1
            i += len(quote)
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


@register_tool_parser
class PythonicToolParser(ToolParser):
    """Llama 3.2 (small models) and Llama 4: the output is a Python list of calls,
    `[get_weather(city="Paris", unit="c"), f(a=1)]`, optionally wrapped in
    `<|python_start|>`/`<|python_end|>`, parsed with `ast`: keyword arguments whose values are
    literals (strings, numbers, bools, None, lists, dicts) only, else the output is content.
    An output that does not start (after whitespace and the wrapper) with the list is content,
    whole; text after the list is content."""

    name = "pythonic"
    START: ClassVar[str] = "<|python_start|>"
    END: ClassVar[str] = "<|python_end|>"
    _HEAD: ClassVar[re.Pattern[str]] = re.compile(r"\[\s*(?:[^\W\d]\w*(?:\s*(\()?)?)?")

    def step(self, buf: str, mode: str, final: bool) -> Step | None:
        if mode == "text":
            return [buf], len(buf), mode
        if mode == "after":  # after the list: drop a closing wrapper, the rest is content
            i = _skip_space(buf, 0)
            if buf.startswith(self.END, i):
                return [], i + len(self.END), "text"
            if self.END.startswith(buf[i:]) and not final:
                return None
            return [buf], len(buf), "text"
        i = _skip_space(buf, 0)
        if buf.startswith(self.START, i):
            i = _skip_space(buf, i + len(self.START))
        elif self.START.startswith(buf[i:]):
            return ([buf], len(buf), "text") if final else None
        if i == len(buf):
            return ([buf], len(buf), "text") if final else None
        head = self._HEAD.match(buf, i)
        if head is None or (head.group(1) is None and head.end() < len(buf)):
            return [buf], len(buf), "text"  # not `[name(`: no call list
        end = _python_end(buf, i)
        if end is None:
            return ([buf], len(buf), "text") if final else None
        calls = self._calls(buf[i:end])
        return (calls, end, "after") if calls else ([buf], len(buf), "text")

    def _calls(self, source: str) -> list[str | ToolCall]:
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, RecursionError):
            return []
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return []
        calls: list[str | ToolCall] = []
        for node in tree.body.elts:
            if (
                not isinstance(node, ast.Call)
                or not isinstance(node.func, ast.Name)
                or node.args
                or any(keyword.arg is None for keyword in node.keywords)
            ):
                return []
            try:
                arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
            except (_NotLiteral, RecursionError):
                return []
            calls.append(
                ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False), id=self.new_id())
            )
        return calls
