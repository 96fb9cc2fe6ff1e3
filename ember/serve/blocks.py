"""An answer as a list of blocks (reasoning, text, tool calls), whole or streamed: the shape
that the Anthropic Messages API (content blocks) and the OpenAI Responses API (output items)
both write, each in its own wire format.

Both APIs run a chat through the same path as `/v1/chat/completions`: the chat template, the
engine, then `ChatTools.answer` (a whole answer's OpenAI message) or `ChatStream.feed` (its
deltas, step by step). `message_blocks` turns the message into blocks; `BlockStream` turns the
deltas into block events (a block starts, grows by a piece, stops), so a streamed answer's
blocks join to exactly the whole answer's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Block:
    """One part of an answer: `kind` is "reasoning", "text" or "call"; `text` is the
    reasoning, the text or the call's arguments (a JSON object, as a string)."""

    kind: str
    text: str = ""
    call_id: str | None = None  # a call's id and function name
    name: str | None = None

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object ({} where the model wrote none)."""
        if not self.text.strip():
            return {}
        value = json.loads(self.text)
        if not isinstance(value, dict):
            raise ValueError(f"tool call arguments are not a JSON object: {self.text[:80]!r}")
        return value


def message_blocks(message: dict[str, Any]) -> list[Block]:
    """The blocks of `ChatTools.answer`'s message: its reasoning, its content, then each
    tool call, leaving out empty ones."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append(Block("reasoning", message["reasoning_content"]))
    if message.get("content"):
        blocks.append(Block("text", message["content"]))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append(Block("call", fn["arguments"], call["id"], fn["name"]))
    return blocks


# A block event: ("start", index, block, ""), ("delta", index, block, piece) or
# ("stop", index, block, ""); `block.text` holds what has come so far.
Event = tuple[str, int, Block, str]


class BlockStream:
    """`ChatStream.feed`'s deltas in, block events out. A block is open until one of another
    kind (or another call) starts, or `close` ends the answer; empty pieces start nothing."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: int | None = None  # the index of the open block
        self._calls: dict[int, int] = {}  # a delta's tool call index -> block index

    def feed(self, deltas: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._piece("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._piece("text", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
        return events

    def close(self) -> list[Event]:
        """The answer ended: the open block stops."""
        if self._open is None:
            return []
        i, self._open = self._open, None
        return [("stop", i, self.blocks[i], "")]

    def _start(self, block: Block) -> list[Event]:
        events = self.close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return events + [("start", self._open, block, "")]

    def _piece(self, kind: str, piece: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.blocks[self._open].kind != kind:
            events += self._start(Block(kind))
        assert self._open is not None
        block = self.blocks[self._open]
        block.text += piece
        return events + [("delta", self._open, block, piece)]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        fn = call.get("function") or {}
        events: list[Event] = []
        index = call.get("index", len(self._calls))
        if index not in self._calls:  # a call's first piece carries its id and name
            events += self._start(Block("call", "", call.get("id"), fn.get("name")))
            assert self._open is not None
            self._calls[index] = self._open
        i = self._calls[index]
        block = self.blocks[i]
        piece = fn.get("arguments") or ""
        if piece:
            if i != self._open:  # parsers stream calls one after another
                raise AssertionError("a tool call's arguments arrived after the next block began")
            block.text += piece
            events.append(("delta", i, block, piece))
        return events
