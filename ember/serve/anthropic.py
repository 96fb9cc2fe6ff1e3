"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a wire
format over ember's chat path.

`MessagesRequest.chat_request` turns a request into the `ChatRequest` that
`/v1/chat/completions` would run (the system prompt, content blocks, `tool_use` and
`tool_result` as OpenAI's messages and tool calls, `tools` and `tool_choice`, `stop_sequences`,
`thinking` as the template's `enable_thinking`, `output_config.format` as a JSON schema), so
the same template, engine, tool-call parser and reasoning parser answer it. `whole_message`
writes a whole answer as a `message` (thinking, text and `tool_use` blocks), and
`MessageEvents` writes a stream as Anthropic's server-sent events (`message_start`,
`content_block_start`, `content_block_delta`, `content_block_stop`, `message_delta`,
`message_stop`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ember.serve.blocks import Block, BlockStream, Event, message_blocks
from ember.serve.protocol import ChatRequest

# ember's and vLLM's extra sampling fields a Messages request may also carry (as
# `extra_body` in Anthropic's client); the rest of ChatRequest's fields have Anthropic names.
PASSED_THROUGH = (
    "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "structured_outputs", "chat_template",
    "chat_template_kwargs", "logit_bias",
)  # fmt: skip

# Anthropic's error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """The system prompt and messages as OpenAI chat messages."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text_of(self.system, "system")})
        for i, message in enumerate(self.messages):
            out += _openai_messages(message, f"messages[{i}]")
        return out

    def chat_request(self) -> ChatRequest:
        """The chat completion this request asks for; ValueError naming a bad field."""
        extras = self.model_extra or {}
        passed = {k: extras[k] for k in PASSED_THROUGH if k in extras}
        kwargs = dict(passed.pop("chat_template_kwargs", None) or {})
        if self.thinking is not None:
            kind = self.thinking.get("type")
            if kind not in ("enabled", "disabled", "adaptive"):
                raise ValueError(f"thinking.type must be enabled, disabled or adaptive, got "
                                 f"{kind!r}")  # fmt: skip
            kwargs.setdefault("enable_thinking", kind != "disabled")
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
                raise ValueError("output_config.format.type must be json_schema")
            passed["response_format"] = {"type": "json_schema",
                                         "json_schema": {"schema": fmt.get("schema")}}  # fmt: skip
        messages = self.conversation()
        # A conversation that ends on the assistant's turn is continued from there.
        prefilled = self.messages[-1].get("role") == "assistant"
        return ChatRequest(
            messages=messages,
            add_generation_prompt=not prefilled,
            continue_final_message=prefilled,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            tools=_openai_tools(self.tools),
            **_tool_choice(self.tool_choice, bool(self.tools)),
            chat_template_kwargs=kwargs or None,
            **passed,
        )


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # count_tokens takes no max_tokens


def _text_of(content: Any, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise ValueError(f"{where}[{j}] must be a text block")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = source.get("url", "")
    else:
        raise ValueError(f"{where}.source.type must be base64 or url")
    return {"type": "image_url", "image_url": {"url": url}}


def _openai_messages(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages: a user turn's `tool_result` blocks
    become `tool` messages (before the rest of the turn), an assistant turn's `tool_use`
    blocks its `tool_calls` and its `thinking` its `reasoning_content`."""
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise ValueError(f"{where}.role must be user or assistant, got {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of content blocks")
    parts: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking = ""
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image" and role == "user":
            parts.append(_image_part(block, at))
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_of(result, f"{at}.content")
            tools.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                          "content": text})  # fmt: skip
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise ValueError(f"{at} (tool_use) needs a string name and an object input")
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})  # fmt: skip
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            thinking += str(block.get("thinking", ""))
        else:
            raise ValueError(f"{at}: a {role} turn cannot hold a block of type {kind!r}")
    out = list(tools)
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant",
                                "content": "".join(p["text"] for p in parts)}  # fmt: skip
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning_content"] = thinking
        out.append(turn)
    elif parts:
        only_text = all(p["type"] == "text" for p in parts)
        text = "".join(p["text"] for p in parts) if only_text else parts
        out.append({"role": "user", "content": text})
    return out


def _openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools (name, description, input_schema) as OpenAI functions; a
    server tool (web search, code execution, ...) is a ValueError."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ValueError(f"tools[{i}]: only client tools (name, description, input_schema) "
                             f"are served, not {kind!r}")  # fmt: skip
        schema = tool.get("input_schema", {"type": "object", "properties": {}})
        fn = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None, has_tools: bool) -> dict[str, Any]:
    """ChatRequest's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    if choice is None:
        return {"tool_choice": "auto" if has_tools else None}
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return {"tool_choice": "auto", "parallel_tool_calls": parallel}
    if kind == "any":
        return {"tool_choice": "required", "parallel_tool_calls": parallel}
    if kind == "none":
        return {"tool_choice": "none"}
    if kind == "tool":
        named = {"type": "function", "function": {"name": choice.get("name")}}
        return {"tool_choice": named, "parallel_tool_calls": False}
    raise ValueError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}")


def stop_reason(called: bool, finish_reason: str | None, stop: Any) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended the answer)."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _content_block(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": block.arguments()}  # fmt: skip


def _usage(input_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}  # fmt: skip


def whole_message(
    mid: str, model: str, message: dict[str, Any], called: bool, finish_reason: str | None,
    stop: Any, usage: tuple[int, int, int],
) -> dict[str, Any]:  # fmt: skip
    """A whole answer (`ChatTools.answer`'s message) as Anthropic's message; `usage`:
    (prompt tokens, generated tokens, prompt tokens read from the prefix cache)."""
    reason, sequence = stop_reason(called, finish_reason, stop)
    return {
        "id": mid, "type": "message", "role": "assistant", "model": model,
        "content": [_content_block(b) for b in message_blocks(message)],
        "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(*usage),
    }  # fmt: skip


def sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


class MessageEvents:
    """One streamed answer as Anthropic's events: `start` opens the message, `feed` turns
    each step's chat deltas into content block events, `finish` closes it, `failed` ends it
    with an error event (the interface `responses.ResponseEvents` shares)."""

    def __init__(self, mid: str, model: str) -> None:
        self.mid, self.model = mid, model
        self.blocks = BlockStream()

    def start(self, input_tokens: int, cached: int) -> list[str]:
        message = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": _usage(input_tokens, 0, cached)}  # fmt: skip
        return [sse("message_start", {"type": "message_start", "message": message}),
                sse("ping", {"type": "ping"})]  # fmt: skip

    def feed(self, deltas: list[dict[str, Any]]) -> list[str]:
        return [self._event(e) for e in self.blocks.feed(deltas)]

    def finish(self, called: bool, finish_reason: str | None, stop: Any,
               counts: tuple[int, int, int]) -> list[str]:  # fmt: skip
        """`counts`: (prompt tokens, generated tokens, prompt tokens from the prefix cache)."""
        reason, sequence = stop_reason(called, finish_reason, stop)
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": {"output_tokens": counts[1]}}  # fmt: skip
        out = [self._event(e) for e in self.blocks.close()]
        return out + [sse("message_delta", delta), sse("message_stop", {"type": "message_stop"})]

    def failed(self, message: str) -> list[str]:
        return [sse("error", error_body(500, message))]

    @staticmethod
    def _event(event: Event) -> str:
        what, index, block, piece = event
        if what == "start":
            start = _content_block(Block(block.kind, "", block.call_id, block.name))
            if block.kind == "call":
                start["input"] = {}
            return sse("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": start})  # fmt: skip
        if what == "stop":
            return sse("content_block_stop", {"type": "content_block_stop", "index": index})
        kind = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
                "call": ("input_json_delta", "partial_json")}[block.kind]  # fmt: skip
        delta = {"type": kind[0], kind[1]: piece}
        return sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                           "delta": delta})  # fmt: skip
