"""The server's bounds on what one request may ask for: each field that multiplies work or
memory (sequences, prompts, stop strings, tools and schemas, the body's size) has a limit, and a
request over one gets a 400 naming the field and the limit before anything is queued. The
engine checks the rest (the prompt's length against the context, `max_tokens`, logprobs
against `max_logprobs`, images per prompt), and the host memory budget
(`ember.runtime.admission`) what a request may hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.serve.protocol import ChatRequest, CompletionRequest

# The defaults of `ember serve`'s flags (`--max-request-bytes`, ...).
MAX_REQUEST_BYTES = 32 << 20  # a few images as base64 data URLs, or a long conversation
MAX_PROMPTS = 1024  # prompts in one /v1/completions or /v1/embeddings request
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024
MAX_TOKEN_ID_LIST = 4096  # stop_token_ids
MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 256 << 10  # tools, response_format, structured outputs: as JSON
# Stored Responses API answers (`store`, for `previous_response_id`): how many, their bytes as
# JSON (with the conversation each ends) and how long each is kept.
MAX_STORED_RESPONSES = 1024
MAX_STORED_RESPONSE_BYTES = 256 << 20
STORED_RESPONSE_TTL_S = 3600


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for; `max_n` is the engine's `max_num_seqs` unless the server
    says otherwise (no default here: it is the engine's)."""

    max_n: int
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_prompts: int = MAX_PROMPTS
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS
    max_token_id_list: int = MAX_TOKEN_ID_LIST
    max_tools: int = MAX_TOOLS
    max_schema_bytes: int = MAX_SCHEMA_BYTES
    max_stored_responses: int = MAX_STORED_RESPONSES
    max_stored_response_bytes: int = MAX_STORED_RESPONSE_BYTES
    stored_response_ttl_s: int = STORED_RESPONSE_TTL_S

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def check(self, body: CompletionRequest | ChatRequest, num_prompts: int = 1) -> None:
        """ValueError naming the first field of `body` over its limit."""
        _at_most("n", body.n, self.max_n, "the server's max_num_seqs")
        if body.best_of is not None and body.best_of != body.n:
            raise ValueError(
                f"best_of must equal n={body.n} (ember returns every sequence it samples), "
                f"got {body.best_of}"
            )
        _at_most("prompt", num_prompts, self.max_prompts, "prompts per request")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        _at_most("stop", len(stops), self.max_stop_strings, "stop strings")
        for i, stop in enumerate(stops):
            _at_most(f"stop[{i}]", len(stop), self.max_stop_string_chars, "characters")
        ids = body.stop_token_ids or []
        _at_most("stop_token_ids", len(ids), self.max_token_id_list, "token ids")
        schemas: dict[str, Any] = {
            "structured_outputs": body.structured_outputs,
            "guided_json": body.guided_json,
            "guided_regex": body.guided_regex,
            "guided_choice": body.guided_choice,
            "guided_grammar": body.guided_grammar,
            "response_format": body.response_format,
        }
        if isinstance(body, ChatRequest):
            _at_most("tools", len(body.tools or []), self.max_tools, "tools")
            schemas["tools"] = body.tools
            schemas["tool_choice"] = body.tool_choice
        for name, value in schemas.items():
            if value is not None:
                size = len(json.dumps(value, default=str))
                _at_most(name, size, self.max_schema_bytes, "bytes as JSON")


def _at_most(field: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise ValueError(f"{field} must be at most {limit} ({what}), got {value}")
