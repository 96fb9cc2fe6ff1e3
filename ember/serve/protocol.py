"""The server's wire format: the typed request bodies it accepts and the typed responses it
returns (OpenAI's completions, chat completions, embeddings and models, vLLM's tokenize and
detokenize, and the error body).

Responses are written with `model_dump()`: fields in declaration order (OpenAI's), None as null,
except the fields a model names in `omit_if_none`, which are left out when None (as OpenAI
leaves out `usage` in a stream chunk and `logprobs` in a chat choice that did not ask for them).
The chat message and delta dicts stay free-form: `ChatTools.answer` and `ChatStream.feed` own
their shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from ember.runtime.request import SamplingParams
from ember.runtime.structured import StructuredOutputsParams

# ---- requests ----------------------------------------------------------------------------


class _Sampling(BaseModel):
    """The sampling fields both endpoints take (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None  # vLLM's; only best_of == n (every sequence is returned)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs: vLLM's `structured_outputs` object, its earlier `guided_*` fields,
    # and OpenAI's `response_format` (json_schema / json_object).
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's structured output, from whichever field gives it (at most one)."""
        given: list[StructuredOutputsParams] = []
        if self.structured_outputs is not None:
            fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            unknown = sorted(set(self.structured_outputs) - fields)
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown fields {unknown[:5]!r:.200} (it takes "
                    f"{', '.join(sorted(fields))})"
                )
            given.append(StructuredOutputsParams(**self.structured_outputs))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given.append(StructuredOutputsParams(**{kind: value}))
        fmt = self.response_format or {}
        if fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema")
            given.append(StructuredOutputsParams(json=schema))
        elif fmt.get("type") == "json_object":
            given.append(StructuredOutputsParams(json_object=True))
        elif fmt.get("type") not in (None, "text"):
            raise ValueError(
                "response_format.type must be text, json_object or json_schema, got "
                f"{fmt.get('type')!r}"
            )
        if len(given) > 1:
            raise ValueError("give one structured output (structured_outputs, guided_*, or "
                             "response_format), not several")  # fmt: skip
        return given[0] if given else None

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None) -> SamplingParams:
        values = dict(defaults)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):  # fmt: skip
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        values.update(
            n=self.n,
            # None: the generation config's max_new_tokens, else up to the context's end.
            max_tokens=max_tokens if max_tokens is not None else values.get("max_tokens"),
            stop=self.stop,
            seed=self.seed,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured(),
            logprobs=self.logprob_count(),
        )
        return SamplingParams(**values)

    def logprob_count(self) -> int | None:
        """How many top logprobs each generated token gets (None: no logprobs)."""
        return None


# The request models below have no docstrings of their own: a docstring would become a
# description in the app's /openapi.json.
class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None) -> SamplingParams:
        params = super().sampling_params(defaults, max_tokens)
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs too
            params.prompt_logprobs = self.logprobs
        return params


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    user: str | None = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None  # as vLLM: no limit but the context's (completions: 16)
    max_completion_tokens: int | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` through the template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------


class _Body(BaseModel):
    """A response or a part of one; `model_dump()` gives its JSON-ready dict."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()  # fields left out when None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.omit_if_none:
            if name in data and data[name] is None:
                del data[name]
        return data


class ErrorInfo(_Body):
    message: str
    type: str
    param: str | None = None
    code: int  # the HTTP status


class ErrorResponse(_Body):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class PromptTokensDetails(_Body):
    cached_tokens: int = 0  # prompt tokens the prefix cache held (memory or disk)


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Body):
    """OpenAI's legacy logprobs, one list entry per token; an echoed prompt's first token has
    None for its logprob and its alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # token text -> logprob
    text_offset: list[int]  # where each token's text starts in the choice's text


class CompletionChoice(_Body):
    """A text completion's choice, in a whole response (all its text) or a stream chunk (the
    step's new text)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class ChatTopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]  # the token text's UTF-8 bytes


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]  # by rank


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob]


class ChatChoice(_Body):
    """A whole chat answer's choice; `message` is `ChatTools.answer`'s."""

    omit_if_none = frozenset({"logprobs"})

    index: int
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatChunkChoice(_Body):
    """A chat stream chunk's choice; `delta` is one of `ChatStream.feed`'s dicts ({} with
    the finish reason, the role first)."""

    omit_if_none = frozenset({"logprobs"})

    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(_Body):
    """A text completion's stream event; `usage` only in the last (`include_usage`)."""

    omit_if_none = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionChunk(_Body):
    """A chat completion's stream event; `usage` only in the last (`include_usage`)."""

    omit_if_none = frozenset({"usage"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Embedding(_Body):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Body):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(_Body):
    """A served model; a LoRA adapter names its base model as `parent`."""

    omit_if_none = frozenset({"parent"})

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ember"
    parent: str | None = None


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None  # with return_token_strs


class DetokenizeResponse(_Body):
    prompt: str
