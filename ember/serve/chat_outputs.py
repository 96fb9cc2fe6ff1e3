"""Tools and reasoning in `/v1/chat/completions`, as vLLM serves them.

`ChatTools.prepare` checks a request's `tools` and `tool_choice` and, for `required` or a
named function, gives the structured output that makes the answer a call (a JSON schema built
from the functions' parameters, so the call always parses). `ChatTools.answer` turns a whole
answer into OpenAI's message (`reasoning_content`, `content`, `tool_calls`) and
`ChatTools.stream` does the same to a stream of text deltas, piece by piece. `auto` runs the
server's tool-call parser (`--tool-call-parser`) and falls back to content when nothing parses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.runtime.structured import StructuredOutputsParams
from ember.serve.reasoning_parsers import ReasoningParser, get_reasoning_parser
from ember.serve.tool_parsers import StreamDelta, ToolCall, ToolParser, get_tool_parser


def _tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The request's functions by name; a ValueError naming the first malformed tool."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function needs a non-empty string 'name'")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn["name"] in functions:
            raise ValueError(f"tools[{i}].function.name {fn['name']!r} is given twice")
        functions[fn["name"]] = params
    return functions


@dataclass
class _Mode:
    kind: str  # "none", "auto", "required" or "named"
    functions: dict[str, dict[str, Any]]  # the request's tools: name -> parameters schema
    function: str | None = None


class ChatTools:
    """A server's tool and reasoning settings (`--enable-auto-tool-choice`,
    `--tool-call-parser`, `--reasoning-parser`), applied per request."""

    def __init__(
        self,
        tokenizer: Any,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        self.tool_parser: type[ToolParser] | None = (
            get_tool_parser(tool_call_parser) if tool_call_parser else None
        )
        self.reasoning: type[ReasoningParser] | None = (
            get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        )
        self.auto = enable_auto_tool_choice
        self.tokenizer = tokenizer

    @property
    def needs_special_tokens(self) -> bool:
        return self.tool_parser is not None and self.tool_parser.needs_special_tokens

    def mode(self, tools: list[dict[str, Any]] | None, tool_choice: Any) -> _Mode:
        """The request's tool mode; ValueError for a choice this server cannot honour."""
        functions = check_tools(tools)
        if tool_choice is None:
            tool_choice = "auto" if functions else "none"
        if isinstance(tool_choice, dict):
            fn = tool_choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
                raise ValueError(
                    "tool_choice must be none, auto, required or "
                    "{'type': 'function', 'function': {'name': ...}}"
                )
            if name not in functions:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
            return _Mode("named", functions, name)
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be none, auto, required or a function, got "
                             f"{tool_choice!r}")  # fmt: skip
        if tool_choice != "none" and not functions:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        if tool_choice == "auto" and not (self.auto and self.tool_parser is not None):
            raise ValueError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser NAME"
            )
        return _Mode(tool_choice, functions)

    @staticmethod
    def structured_output(mode: _Mode, parallel_tool_calls: bool) -> StructuredOutputsParams | None:
        """The grammar that forces a call: the named function's parameters, or for
        `required` a JSON array of {"name", "parameters"} objects (one item unless
        `parallel_tool_calls`), as vLLM builds it."""
        if mode.kind not in ("required", "named"):
            return None
        functions = mode.functions
        if mode.kind == "named":
            assert mode.function is not None
            return StructuredOutputsParams(
                json=functions[mode.function], disable_any_whitespace=True
            )
        items = {"anyOf": [
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
             "required": ["name", "parameters"]}
            for name, params in functions.items()
        ]}  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    def forced_calls(self, mode: _Mode, text: str) -> list[ToolCall]:
        """The calls of an answer made under `structured_output` (it parses by construction;
        an answer cut by max_tokens may not, and then has no calls)."""
        try:
            value = json.loads(text)
            if mode.kind == "named":
                assert mode.function is not None
                if not isinstance(value, dict):
                    return []  # a function's arguments are an object
                return [ToolCall(mode.function, json.dumps(value, ensure_ascii=False))]
            return [
                ToolCall(str(item["name"]), json.dumps(item["parameters"], ensure_ascii=False))
                for item in value
            ]
        except (ValueError, TypeError, KeyError):
            return []

    def answer(self, mode: _Mode, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message of a whole answer, whether it holds tool calls)."""
        message: dict[str, Any] = {"role": "assistant"}
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning(self.tokenizer).extract(text)
            message["reasoning_content"] = reasoning
        calls: list[ToolCall] = []
        if mode.kind in ("required", "named"):
            calls = self.forced_calls(mode, content or "")
            if calls:
                content = None
        elif mode.kind == "auto" and self.tool_parser is not None and content:
            content, calls = self.tool_parser(self.tokenizer).extract(content)
        message["content"] = content
        if calls:
            message["tool_calls"] = [_tool_call_dict(c) for c in calls]
        return message, bool(calls)

    def stream(self, mode: _Mode) -> ChatStream:
        return ChatStream(self, mode)


class ChatStream:
    """One choice's streamed answer: text deltas in, OpenAI delta dicts out (reasoning,
    content and tool-call pieces), so that they join to `ChatTools.answer`'s message."""

    def __init__(self, tools: ChatTools, mode: _Mode) -> None:
        self.mode = mode
        self.reasoning = tools.reasoning(tools.tokenizer).stream() if tools.reasoning else None
        self.parser = None
        if mode.kind == "auto" and tools.tool_parser is not None:
            self.parser = tools.tool_parser(tools.tokenizer).stream()
        self.tools = tools
        self.forced: list[str] = []  # a forced call's JSON, parsed at the end
        self.called = False

    def _content(self, piece: str, final: bool) -> list[dict[str, Any]]:
        if self.mode.kind in ("required", "named"):
            self.forced.append(piece)
            if not final:
                return []
            calls = self.tools.forced_calls(self.mode, "".join(self.forced))
            if not calls:  # cut short: what there is stays content
                return [{"content": "".join(self.forced)}] if self.forced else []
            self.called = True
            return [{"tool_calls": [dict(_tool_call_dict(c), index=i)]}
                    for i, c in enumerate(calls)]  # fmt: skip
        if self.parser is None:
            return [{"content": piece}] if piece else []
        delta = self.parser.feed(piece) if piece else StreamDelta()
        if final:
            end = self.parser.finish()
            delta.content += end.content
            delta.tool_calls += end.tool_calls
        out: list[dict[str, Any]] = []
        if delta.content:
            out.append({"content": delta.content})
        for d in delta.tool_calls:
            self.called = True
            call: dict[str, Any] = {"index": d.index}
            fn: dict[str, Any] = {"arguments": d.arguments}
            if d.id is not None:
                call.update(id=d.id, type="function")
            if d.name is not None:
                fn["name"] = d.name
            call["function"] = fn
            out.append({"tool_calls": [call]})
        return out

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas for the next piece of text (`final`: it is the last one)."""
        out: list[dict[str, Any]] = []
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_r, more_c = self.reasoning.finish()
                reasoning, content = reasoning + more_r, content + more_c
            if reasoning:
                out.append({"reasoning_content": reasoning})
        return out + self._content(content, final)
