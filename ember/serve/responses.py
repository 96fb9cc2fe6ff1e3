"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) as a wire
format over ember's chat path.

`ResponsesRequest.chat_request` turns a request into the `ChatRequest` that
`/v1/chat/completions` would run: `instructions` as the system turn, `input` (text, or items:
messages with text and image parts, `function_call` and `function_call_output` items, reasoning
items) as chat messages after the conversation of `previous_response_id`, function `tools` and
`tool_choice`, and `text.format` as the structured output. `response_object` writes a whole
answer (reasoning, message and `function_call` output items) and `ResponseEvents` its stream
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`). `ResponseStore` keeps
stored responses and their conversations, bounded in count, bytes and age.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ember.serve.blocks import Block, BlockStream, Event, message_blocks
from ember.serve.protocol import ChatRequest

# ember's and vLLM's extra sampling fields a Responses request may also carry (`extra_body`).
PASSED_THROUGH = (
    "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "min_tokens", "ignore_eos", "stop", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "structured_outputs", "chat_template",
    "chat_template_kwargs", "logit_bias",
)  # fmt: skip


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (without the instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return _chat_messages(self.input)

    def chat_request(self, conversation: list[dict[str, Any]]) -> ChatRequest:
        """The chat completion this request asks for: `conversation` (the stored conversation
        of `previous_response_id`, then `input_messages()`) after the instructions;
        ValueError naming a bad field."""
        if self.background:
            raise ValueError("background: true is not supported (answers are streamed or "
                             "returned whole)")  # fmt: skip
        if self.truncation not in (None, "disabled"):
            raise ValueError(f"truncation must be disabled, got {self.truncation!r}: a prompt "
                             "longer than the context is refused, never cut")  # fmt: skip
        messages = list(conversation)
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise ValueError("input must hold at least one message")
        extras = self.model_extra or {}
        passed = {k: extras[k] for k in PASSED_THROUGH if k in extras}
        return ChatRequest(
            messages=messages,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=_chat_tools(self.tools),
            tool_choice=_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=_response_format(self.text),
            **passed,
        )


def _text_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: its text, or text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ValueError(f"{where}.content[{j}].image_url must be a URL or data URL "
                                 "(file ids are not served)")  # fmt: skip
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise ValueError(f"{where}.content[{j}].type {kind!r} is not supported (input_text, "
                             "output_text, input_image)")  # fmt: skip
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join the assistant turn
    before them, a reasoning item the assistant turn after it."""
    out: list[dict[str, Any]] = []
    reasoning = ""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role must be user, system, developer or assistant, "
                                 f"got {role!r}")  # fmt: skip
            content = _text_parts(item.get("content"), where)
            message: dict[str, Any] = {
                "role": "system" if role == "developer" else role,
                "content": content,
            }
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise ValueError(f"{where} (function_call) needs string name and arguments")
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": name, "arguments": arguments}}  # fmt: skip
            last = out[-1] if out else None
            if (
                last is not None
                and last["role"] == "assistant"
                and isinstance(last.get("content"), str)
            ):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            result = item.get("output", "")
            text = result if isinstance(result, str) else _text_parts(result, where)
            text = text if isinstance(text, str) else json.dumps(text)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": text})  # fmt: skip
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        else:
            raise ValueError(f"{where}.type {kind!r} is not supported (message, function_call, "
                             "function_call_output, reasoning)")  # fmt: skip
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ValueError(f"tools[{i}]: only function tools are served, not {kind!r}")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ValueError(f"tool_choice.type must be function, got {choice.get('type')!r}")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise ValueError(f"text.format.type must be text, json_object or json_schema, got {kind!r}")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_item(block: Block, item_id: str, done: bool = True) -> dict[str, Any]:
    """A block as an output item (`done`: completed, else just added and empty)."""
    status = "completed" if done else "in_progress"
    if block.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": block.text}] if done else []
        return {"id": item_id, "type": "reasoning", "summary": [], "content": content,
                "status": status}  # fmt: skip
    if block.kind == "text":
        content = [_text_part(block.text)] if done else []
        return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": content}  # fmt: skip
    return {"id": item_id, "type": "function_call", "call_id": block.call_id,
            "name": block.name, "arguments": block.text if done else "",
            "status": status}  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _prefix(kind: str) -> str:
    return {"reasoning": "rs", "text": "msg", "call": "fc"}[kind]


def history_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a next turn continues from."""
    return _chat_messages(output)


@dataclass
class ResponseHead:
    """What a response object says besides its output: the request's settings."""

    rid: str
    created_at: int
    model: str
    body: ResponsesRequest

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at,
            "status": status, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": b.reasoning or {"effort": None, "summary": None},
            "store": b.store, "temperature": b.temperature,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [], "top_p": b.top_p, "truncation": "disabled",
            "usage": usage, "user": b.user, "metadata": b.metadata or {},
        }  # fmt: skip


def usage(input_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}  # fmt: skip


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(the response's status, why it is incomplete)."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def whole_response(
    head: ResponseHead, message: dict[str, Any], finish_reason: str | None,
    counts: tuple[int, int, int],
) -> dict[str, Any]:  # fmt: skip
    """A whole answer (`ChatTools.answer`'s message) as a response object."""
    output = [output_item(b, _item_id(_prefix(b.kind))) for b in message_blocks(message)]
    status, why = status_of(finish_reason)
    return head.response(status, output, usage(*counts), why)


class ResponseEvents:
    """One streamed answer as the Responses API's events, numbered in order (the interface of
    `anthropic.MessageEvents`); `done` is given the whole response it ends with."""

    def __init__(self, head: ResponseHead, done: Callable[[dict[str, Any]], None]) -> None:
        self.head, self.done = head, done
        self.blocks = BlockStream()
        self.ids: list[str] = []  # each block's item id
        self.seq = 0

    def _sse(self, kind: str, data: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self, input_tokens: int, cached: int) -> list[str]:
        pending = self.head.response("in_progress", [], None)
        return [self._sse("response.created", {"response": pending}),
                self._sse("response.in_progress", {"response": pending})]  # fmt: skip

    def feed(self, deltas: list[dict[str, Any]]) -> list[str]:
        return [e for event in self.blocks.feed(deltas) for e in self._events(event)]

    def finish(self, called: bool, finish_reason: str | None, stop: Any,
               counts: tuple[int, int, int]) -> list[str]:  # fmt: skip
        """The closing events; the whole response they end with goes to `done`."""
        out = [e for event in self.blocks.close() for e in self._events(event)]
        output = [output_item(b, i) for b, i in zip(self.blocks.blocks, self.ids, strict=True)]
        status, why = status_of(finish_reason)
        response = self.head.response(status, output, usage(*counts), why)
        self.done(response)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._sse(kind, {"response": response})]

    def failed(self, message: str) -> list[str]:
        response = self.head.response("failed", [], None)
        response["error"] = {"code": "server_error", "message": message}
        return [self._sse("response.failed", {"response": response})]

    def _events(self, event: Event) -> list[str]:
        what, index, block, piece = event
        if what == "start":
            self.ids.append(_item_id(_prefix(block.kind)))
        item_id = self.ids[index]
        at = {"item_id": item_id, "output_index": index}
        part = {"reasoning": "reasoning_text", "text": "output_text"}.get(block.kind)
        if what == "start":
            added = {"output_index": index, "item": output_item(block, item_id, done=False)}
            out = [self._sse("response.output_item.added", added)]
            if part is not None:
                empty = {"type": part, "text": ""} if part == "reasoning_text" else _text_part("")
                out.append(self._sse("response.content_part.added",
                                     {**at, "content_index": 0, "part": empty}))  # fmt: skip
            return out
        if what == "delta":
            if block.kind == "call":
                return [self._sse("response.function_call_arguments.delta",
                                  {**at, "delta": piece})]  # fmt: skip
            extra = {"logprobs": []} if block.kind == "text" else {}
            return [self._sse(f"response.{part}.delta",
                              {**at, "content_index": 0, "delta": piece, **extra})]  # fmt: skip
        done = output_item(block, item_id)
        if block.kind == "call":
            out = [self._sse("response.function_call_arguments.done",
                             {**at, "name": block.name, "arguments": block.text})]  # fmt: skip
        else:
            extra = {"logprobs": []} if block.kind == "text" else {}
            out = [self._sse(f"response.{part}.done",
                             {**at, "content_index": 0, "text": block.text, **extra}),
                   self._sse("response.content_part.done",
                             {**at, "content_index": 0, "part": done["content"][0]})]  # fmt: skip
        return out + [self._sse("response.output_item.done", {"output_index": index,
                                                              "item": done})]  # fmt: skip


class ResponseStore:
    """Stored responses (`store`, the default) with the conversation each ends: the messages
    a `previous_response_id` continues from. At most `max_entries` responses and
    `max_bytes` of them (as JSON), each kept `ttl_s` seconds; the least recently used go
    first. Shared by the server's requests (a lock: routes run on one event loop, but the
    store is also read from tests and other threads)."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._entries: OrderedDict[str, tuple[float, int, dict[str, Any], list[Any]]] = (
            OrderedDict()
        )
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation, default=str))
        with self._lock:
            self._drop(response["id"])
            if size > self.max_bytes:
                return  # larger than the whole store: not kept
            self._entries[response["id"]] = (time.monotonic(), size, response, conversation)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response, the conversation it ends), or None: never stored, deleted,
        evicted or expired."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                return None
            if time.monotonic() - entry[0] > self.ttl_s:
                self._drop(rid)
                return None
            self._entries.move_to_end(rid)
            return entry[2], entry[3]

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._bytes -= entry[1]
        return entry is not None
