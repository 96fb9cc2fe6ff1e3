"""`ember serve MODEL`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the async engine.

Endpoints: `/health` (no auth), `/metrics` (Prometheus, `ember.serve.metrics`), `/v1/models`,
`/v1/completions` and `/v1/chat/completions` (streaming as server-sent events, `usage`
counts), `/v1/embeddings`, OpenAI's Responses API (`/v1/responses`, `ember.serve.responses`)
and Anthropic's Messages API (`/v1/messages`, `ember.serve.anthropic`); LoRA adapters are
served as models of their own names. Request fields are OpenAI's plus vLLM's sampling extras
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...). Bad requests
get JSON errors in each API's shape (OpenAI's, Anthropic's under `/v1/messages`): 400 for
values the engine rejects, 422 for a body that fails validation (400 on the Responses and
Messages routes, as those APIs answer), 404 for an unknown model, 401 without the API key
(`--api-key` or `EMBER_API_KEY`, as `Authorization: Bearer <key>` or `x-api-key: <key>`);
none of them disturbs other requests. A client that disconnects mid-stream has its request
aborted (its KV blocks freed).

This module owns the app: its routes (one function per group) and how a request's engine
streams become an answer. The wire format is `ember.serve.protocol`'s; the choices in an
answer, whole or streamed, are built by `ember.serve.choices.ChoiceBuilder`.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ember.errors import EngineOverloadedError
from ember.lora.adapter import LoRARequest
from ember.runtime.admission import HostMemoryBudget
from ember.runtime.engine import LLMEngine
from ember.runtime.llm import render_chat
from ember.runtime.outputs import RequestOutput
from ember.runtime.request import SamplingParams
from ember.runtime.structured import StructuredOutputsParams
from ember.serve import anthropic, responses, scoring
from ember.serve.async_engine import AsyncLLMEngine
from ember.serve.chat_outputs import ChatStream, ChatTools
from ember.serve.choices import ChoiceBuilder, Chunk, usage
from ember.serve.limits import ServeLimits
from ember.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

_Streams = list[tuple[AsyncIterator[RequestOutput], RequestOutput | None]]


@dataclasses.dataclass
class _Server:
    """What the routes share: the engine, the names it is served under and the server-wide
    chat settings, all fixed when the app is built."""

    engine: AsyncLLMEngine
    model_name: str
    loras: dict[str, LoRARequest]
    chat_template: str | None  # `--chat-template`, over the tokenizer's
    tools: ChatTools
    defaults: dict[str, Any]  # the engine's default sampling (the generation config's)
    created: int  # when the app was built: the models' and answers' `created`
    limits: ServeLimits
    stored: responses.ResponseStore  # the Responses API's stored answers
    draining: bool = False  # shutting down: new requests get 503

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    def check_model(
        self, name: str | None, api: str = "openai"
    ) -> JSONResponse | LoRARequest | None:
        """None for the base model, the adapter of a LoRA name, or a 404 response."""
        if name is None or name == self.model_name:
            return None
        if name in self.loras:
            return self.loras[name]
        names = [self.model_name, *self.loras]
        return _error(404, f"model {name!r} does not exist (this server has {names})",
                      "NotFoundError", api)  # fmt: skip

    def render(self, body: ChatRequest | TokenizeRequest, messages: list[dict[str, Any]]) -> Any:
        """`messages` through the chat template (the request's, else the server's)."""
        return render_chat(
            self.tokenizer, messages, body.chat_template or self.chat_template, "auto",
            body.add_generation_prompt, body.continue_final_message, body.tools,
            body.chat_template_kwargs, self.engine.engine.image_token(),
        )  # fmt: skip


def build_app(
    engine: AsyncLLMEngine,
    model_name: str,
    api_key: str | None = None,
    loras: dict[str, LoRARequest] | None = None,
    chat_template: str | None = None,
    chat_tools: ChatTools | None = None,
    limits: ServeLimits | None = None,
) -> FastAPI:
    """The server's app over a running async engine, serving the model as `model_name` and
    each LoRA adapter of `loras` as a model of its own name (as vLLM's `--lora-modules`).
    `chat_template`: the server's template (`--chat-template`), over the tokenizer's;
    a request's own `chat_template` wins over both. `chat_tools`: the tool-call and reasoning
    parsers (`ChatTools`; default: none, so `auto` tool choice is refused). `limits`: what one
    request may ask for (default: `ServeLimits` with `n` up to the engine's max_num_seqs).
    `app.state.server.draining = True` makes every later request a 503 (a shutdown)."""
    tokenizer = engine.engine.tokenizer
    if limits is None:
        limits = ServeLimits(max_n=engine.engine.config.max_num_seqs)
    server = _Server(
        engine, model_name, dict(loras or {}), chat_template,
        chat_tools if chat_tools is not None else ChatTools(tokenizer),
        engine.engine.default_sampling, int(time.time()), limits,
        responses.ResponseStore(limits.max_stored_responses, limits.max_stored_response_bytes,
                                limits.stored_response_ttl_s),
    )  # fmt: skip
    app = FastAPI(title="ember", docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(_BodyCheck, max_bytes=limits.max_request_bytes)
    # The order routes are added in is the order of /openapi.json.
    _add_checks(app, api_key, server)
    _add_info_routes(app, server)
    _add_embedding_route(app, server)
    _add_scoring_routes(app, server)
    _add_token_routes(app, server)
    _add_completion_routes(app, server)
    _add_responses_routes(app, server)
    _add_messages_routes(app, server)
    return app


# OpenAI's error types by HTTP status.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}
# Seconds a client is told to wait before retrying a request refused for load or shutdown.
RETRY_AFTER_S = 1


def _error(status: int, message: str, kind: str | None = None, api: str = "openai") -> JSONResponse:
    """An error response in `api`'s shape: OpenAI's, or "anthropic"'s."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    if api == "anthropic":
        return JSONResponse(anthropic.error_body(status, message), status_code=status,
                            headers=headers)  # fmt: skip
    kind = kind or _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "Error")
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _api_of(path: str) -> str:
    """Whose error shape a path answers in (an app mounted under a prefix included)."""
    return "anthropic" if "/v1/messages" in path else "openai"


def _strict_400(path: str) -> bool:
    """Routes whose API answers a body that fails validation with 400, not 422."""
    return "/v1/messages" in path or "/v1/responses" in path


def _add_checks(app: FastAPI, api_key: str | None, server: _Server) -> None:
    """Before a route runs: shutting down (503) and the API key (401) (the body's size and type
    are `_BodyCheck`'s). After: every error in OpenAI's shape (a body that fails validation: 422; an
    engine at its memory budget or shutting down: 503 with Retry-After; anything unforeseen:
    500)."""

    @app.middleware("http")
    async def check_request(request: Request, call_next: Any) -> Any:
        api = _api_of(request.url.path)
        if server.draining:
            return _error(503, "the server is shutting down", api=api)
        if api_key is not None and request.url.path not in ("/", "/health"):
            bearer = request.headers.get("authorization") == f"Bearer {api_key}"
            if not bearer and request.headers.get("x-api-key") != api_key:
                return _error(401, "invalid or missing API key", "AuthenticationError", api)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        path = request.url.path
        if _strict_400(path):
            return _error(400, f"invalid request body: {errors}", api=_api_of(path))
        return _error(422, f"invalid request body: {errors}", "UnprocessableEntityError")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), api=_api_of(request.url.path))

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return _error(503, str(exc), api=_api_of(request.url.path))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}: {exc}"
        return _error(500, message, api=_api_of(request.url.path))


class _BodyCheck:
    """ASGI middleware: a POST body that says it is not JSON gets a 415, one over
    `max_bytes` a 413 (read here, at most `max_bytes` of it, then handed to the app)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        kind = headers.get(b"content-type", b"").decode("latin-1")
        length = headers.get(b"content-length", b"").decode("latin-1")
        api = _api_of(scope.get("path", ""))
        refused = None
        if kind and "json" not in kind.lower():
            refused = _error(415, f"Content-Type must be application/json, got {kind[:80]!r}",
                             api=api)  # fmt: skip
        elif length.isdigit() and int(length) > self.max_bytes:
            refused = _error(413, f"the request body is {length} bytes; at most "
                                  f"{self.max_bytes} are taken", api=api)  # fmt: skip
        if refused is not None:
            await refused(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                too_large = _error(413, f"the request body is over {self.max_bytes} bytes",
                                   api=api)  # fmt: skip
                await too_large(scope, receive, send)
                return
        body, replayed = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


# NOTE: the route functions have no docstrings and keep their names: both are in /openapi.json
# (its descriptions and operation ids).
def _add_info_routes(app: FastAPI, server: _Server) -> None:
    """`/health`, the chat page at `/`, `/metrics` and `/v1/models`."""
    page = resources.files("ember.serve").joinpath("static/chat.html").read_text("utf-8")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:  # the page needs no key; its API calls carry one
        return Response(page, media_type="text/html")

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = server.engine.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = server.model_name
        cards = [ModelCard(id=base, created=server.created)] + [
            ModelCard(id=name, created=server.created, parent=base) for name in server.loras
        ]
        return ModelList(data=cards).model_dump()


def _add_embedding_route(app: FastAPI, server: _Server) -> None:
    """`/v1/embeddings`: one engine request per input, as floats or base64."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Any:
        if isinstance(bad := server.check_model(body.model), JSONResponse):
            return bad
        if bad is not None:
            return _error(400, "embeddings with a LoRA adapter are not supported")
        if server.engine.engine.config.task == "classify":
            return _error(400, "this model is a classifier: use /classify, /score or /rerank")
        if body.encoding_format not in ("float", "base64"):
            return _error(
                400, f"encoding_format must be float or base64, got {body.encoding_format!r}"
            )
        rid = f"embd-{uuid.uuid4().hex}"
        try:
            prompts = _prompts(body.input)
            if len(prompts) > server.limits.max_prompts:
                raise ValueError(f"input must be at most {server.limits.max_prompts} inputs "
                                 f"(prompts per request), got {len(prompts)}")  # fmt: skip
            outs = await asyncio.gather(*(
                server.engine.embed(f"{rid}-{i}", p) for i, p in enumerate(prompts)
            ))  # fmt: skip
        except ValueError as e:
            return _error(400, str(e))
        data = []
        for i, out in enumerate(outs):
            vector: Any = out.outputs.embedding
            if body.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append(Embedding(index=i, embedding=vector))
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        used = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingList(data=data, model=body.model or server.model_name,
                             usage=used).model_dump()  # fmt: skip


def _add_scoring_routes(app: FastAPI, server: _Server) -> None:
    """vLLM's `/score`, `/rerank` (Jina's and Cohere's shape, also at `/v1/rerank` and
    `/v2/rerank`) and `/classify`: cross-encoders, embedding models and classifiers."""

    def check(body: Any, count: int) -> JSONResponse | None:
        if isinstance(bad := server.check_model(body.model), JSONResponse):
            return bad
        if bad is not None:
            return _error(400, "scores and classes with a LoRA adapter are not supported")
        if count > server.limits.max_prompts:
            return _error(400, f"at most {server.limits.max_prompts} texts (prompts per "
                               f"request) are taken, got {count}")  # fmt: skip
        return None

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: scoring.ScoreRequest) -> Any:
        rid = f"score-{uuid.uuid4().hex}"
        try:
            pairs = scoring.pairs_of(body)
            if (bad := check(body, len(pairs))) is not None:
                return bad
            values, tokens = await scoring.scores(server.engine, rid, pairs)
        except ValueError as e:
            return _error(400, str(e))
        model = body.model or server.model_name
        return scoring.score_response(rid, server.created, model, values, tokens)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: scoring.RerankRequest) -> Any:
        rid = f"rerank-{uuid.uuid4().hex}"
        try:
            texts = body.texts()
            if (bad := check(body, len(texts))) is not None:
                return bad
            if body.top_n is not None and body.top_n < 0:
                raise ValueError(f"top_n must be >= 0, got {body.top_n}")
            pairs = [(body.query, t) for t in texts]
            values, tokens = await scoring.scores(server.engine, rid, pairs) if pairs else ([], 0)
        except ValueError as e:
            return _error(400, str(e))
        model = body.model or server.model_name
        return scoring.rerank_response(rid, model, body, texts, values, tokens)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: scoring.ClassifyRequest) -> Any:
        rid = f"classify-{uuid.uuid4().hex}"
        config = server.engine.engine.config
        try:
            if config.task != "classify":
                raise ValueError(f"/classify needs a sequence classifier; this model's task is "
                                 f"{config.task}")  # fmt: skip
            prompts = _prompts(body.input)
            if (bad := check(body, len(prompts))) is not None:
                return bad
            outs = await asyncio.gather(*(
                server.engine.embed(f"{rid}-{i}", p) for i, p in enumerate(prompts)
            ))  # fmt: skip
        except ValueError as e:
            return _error(400, str(e))
        logits = [o.outputs.embedding for o in outs]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        model = body.model or server.model_name
        return scoring.classify_response(rid, server.created, model,
                                         config.model_spec.hf_config, logits, tokens)  # fmt: skip


def _add_token_routes(app: FastAPI, server: _Server) -> None:
    """vLLM's `/tokenize` and `/detokenize`."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        if isinstance(bad := server.check_model(body.model), JSONResponse):
            return bad
        try:
            ids = _token_ids(server, body)
        except ValueError as e:
            return _error(400, str(e))
        strs = server.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        max_model_len = server.engine.engine.config.max_model_len
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                                token_strs=strs).model_dump()  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        if isinstance(bad := server.check_model(body.model), JSONResponse):
            return bad
        if server.tokenizer is None:
            return _error(400, "this model has no tokenizer")
        vocab = server.engine.engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            return _error(400, f"tokens must be ids in [0, {vocab})")
        return DetokenizeResponse(prompt=server.tokenizer.decode(body.tokens)).model_dump()


def _token_ids(server: _Server, body: TokenizeRequest) -> list[int]:
    """The ids of a `/tokenize` request's prompt or messages; ValueError for a bad one."""
    if server.tokenizer is None:
        raise ValueError("this model has no tokenizer")
    if (body.prompt is None) == (body.messages is None):
        raise ValueError("/tokenize takes one of prompt or messages")
    if body.messages is not None:
        return server.render(body, body.messages)["prompt_token_ids"]
    ids = server.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)
    return list(ids["input_ids"])


def _add_completion_routes(app: FastAPI, server: _Server) -> None:
    """`/v1/completions` and `/v1/chat/completions`, whole or streamed."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        if isinstance(lora := server.check_model(body.model), JSONResponse):
            return lora
        try:
            prompts = _prompts(body.prompt)
            server.limits.check(body, len(prompts))
            params = body.sampling_params(server.defaults, body.max_tokens)
        except ValueError as e:
            return _error(400, str(e))
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await _respond(server, rid, prompts, params, body, lora, chat=None)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Any:
        if isinstance(lora := server.check_model(body.model), JSONResponse):
            return lora
        try:
            prompt, params, mode = _chat_request(server, body)
        except ValueError as e:
            return _error(400, str(e))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await _respond(server, rid, [prompt], params, body, lora, (server.tools, mode))


def _prompts(prompt: Any) -> list[Any]:
    """An OpenAI `prompt`: a string, a list of strings, a token list or a list of them."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def _chat_request(server: _Server, body: ChatRequest) -> tuple[Any, SamplingParams, Any]:
    """A chat request's rendered prompt, sampling params and tool mode; ValueError for a bad
    request (a tool choice the server cannot honour, a template that fails, bad sampling)."""
    server.limits.check(body)
    tools = server.tools
    mode = tools.mode(body.tools, body.tool_choice)
    prompt = server.render(body, body.messages)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = body.sampling_params(server.defaults, max_tokens if max_tokens else None)
    forced = tools.structured_output(mode, body.parallel_tool_calls)
    if forced is not None:
        if params.structured_outputs is not None:
            raise ValueError(
                f"tool_choice {body.tool_choice!r} makes the answer a call: it cannot be "
                "combined with another structured output"
            )
        params.structured_outputs = forced
    if tools.reasoning is not None and params.structured_outputs is not None:
        params.structured_outputs = _after_reasoning(
            tools, prompt["prompt"], params.structured_outputs
        )
    if mode.kind == "auto" and tools.needs_special_tokens:
        params.skip_special_tokens = False  # the parser's markers are special tokens
    return prompt, params, mode


def _after_reasoning(
    tools: ChatTools, prompt: str, structured: StructuredOutputsParams
) -> StructuredOutputsParams:
    """As vLLM: the structure holds for the answer after the reasoning, unless the prompt
    already closed it (e.g. Qwen3's enable_thinking=false)."""
    assert tools.reasoning is not None
    start, end = tools.reasoning.start, tools.reasoning.end
    opened, closed = prompt.rfind(start), prompt.rfind(end)
    if closed > opened >= 0:
        return structured
    return dataclasses.replace(structured, start_after=end)


async def _respond(
    server: _Server,
    rid: str,
    prompts: list[Any],
    params: SamplingParams,
    body: CompletionRequest | ChatRequest,
    lora: LoRARequest | None,
    chat: tuple[ChatTools, Any] | None,
) -> Any:
    """Start one engine request per prompt (all validated before any runs), then answer as a
    whole or as an event stream. `chat`: the server's tools and the request's tool mode, for a
    chat completion (None: a text completion)."""
    try:
        streams = await _start(server.engine, rid, prompts, params, lora)
    except ValueError as e:
        return _error(400, str(e))
    build = ChoiceBuilder(rid, body.model or server.model_name, server.created, params.n,
                          params.logprobs, chat, server.tokenizer)  # fmt: skip
    echo = bool(getattr(body, "echo", False))
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        events = _events(streams, build, include_usage, echo)
        return StreamingResponse(events, media_type="text/event-stream")
    outputs = []
    for stream, first in streams:
        outs = [out async for out in _prepend(first, stream)]
        failed = next((out for out in outs if out.error), None)
        if failed is not None:
            return _error(500, f"request failed: {failed.error}", "InternalServerError")
        outputs.append(outs)
    return build.whole(outputs, echo).model_dump()


async def _start(
    engine: AsyncLLMEngine,
    rid: str,
    prompts: list[Any],
    params: SamplingParams,
    lora: LoRARequest | None,
) -> _Streams:
    """Each prompt's engine stream with its first output (the engine has checked the prompt
    by then). The first bad prompt's ValueError (or EngineOverloadedError, a request refused
    for load) closes the streams started before it and goes on up."""
    streams: _Streams = []
    try:
        for i, prompt in enumerate(prompts):
            stream = engine.generate(f"{rid}-{i}", prompt, params, lora)
            first = await anext(stream, None)  # raises ValueError for bad input
            streams.append((stream, first))
    except BaseException as e:
        for stream, _ in streams:
            await stream.aclose()  # type: ignore[attr-defined]
        raise e
    return streams


async def _events(
    streams: _Streams, build: ChoiceBuilder, include_usage: bool, echo: bool
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step and sequence with new text, then `[DONE]`.
    Prompts stream one after another (each runs in the engine from the start)."""
    prompt_tokens = completion_tokens = cached_tokens = 0
    try:
        for chunk in build.first_chunks():
            yield _event(chunk)
        for p, (stream, first) in enumerate(streams):
            async for out in _prepend(first, stream):
                prompt_tokens += len(out.prompt_token_ids) if out.finished else 0
                cached_tokens += out.num_cached_tokens if out.finished else 0
                completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                for chunk in build.chunks(p, out, echo):
                    yield _event(chunk)
        if include_usage:
            yield _event(build.chunk([], usage(prompt_tokens, completion_tokens, cached_tokens)))
        yield "data: [DONE]\n\n"
    finally:  # a client gone mid-stream: every request still running is aborted
        for stream, _ in streams:
            await stream.aclose()  # type: ignore[attr-defined]


def _event(chunk: Chunk) -> str:
    return f"data: {json.dumps(chunk.model_dump())}\n\n"


async def _prepend(
    first: RequestOutput | None, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
        if first.finished:
            return
    async for out in rest:
        yield out


@dataclasses.dataclass
class _Chat:
    """One running chat answer of the Responses or Messages API: its engine stream (first
    output taken) and tool mode."""

    stream: AsyncIterator[RequestOutput]
    first: RequestOutput | None
    mode: Any

    @property
    def prompt_tokens(self) -> int:
        return len(self.first.prompt_token_ids) if self.first is not None else 0

    @property
    def cached_tokens(self) -> int:
        return self.first.num_cached_tokens if self.first is not None else 0


@dataclasses.dataclass
class _Ended:
    """How an answer ended: vLLM's finish and stop reasons, and its generated tokens."""

    finish_reason: str | None
    stop_reason: int | str | None
    completion_tokens: int


async def _start_chat(server: _Server, rid: str, body: ChatRequest, lora: Any) -> _Chat:
    """A chat request started as `/v1/chat/completions` starts one (n = 1); ValueError for a
    bad one."""
    prompt, params, mode = _chat_request(server, body)
    if params.n != 1:
        raise ValueError(f"n must be 1 on this API, got {params.n}")
    ((stream, first),) = await _start(server.engine, rid, [prompt], params, lora)
    return _Chat(stream, first, mode)


async def _chat_steps(
    chat: _Chat, answer: ChatStream | None
) -> AsyncIterator[str | list[dict[str, Any]] | _Ended]:
    """A running answer step by step: each step's text (`answer` None) or its chat deltas
    (through `answer`), then how it ended. RuntimeError for a request the engine failed."""
    completion = 0
    async for out in _prepend(chat.first, chat.stream):
        if out.error:
            raise RuntimeError(f"request failed: {out.error}")
        for c in out.outputs:
            completion += len(c.token_ids)
            final = c.finish_reason is not None
            if answer is None:
                yield c.text
            else:
                yield answer.feed(c.text, final)
            if final:
                yield _Ended(c.finish_reason, c.stop_reason, completion)
                return


async def _whole_chat(server: _Server, chat: _Chat) -> tuple[dict[str, Any], bool, _Ended]:
    """A whole answer: (`ChatTools.answer`'s message, whether it holds calls, its end)."""
    pieces: list[str] = []
    ended = _Ended(None, None, 0)
    try:
        async for step in _chat_steps(chat, None):
            if isinstance(step, _Ended):
                ended = step
            else:
                assert isinstance(step, str)
                pieces.append(step)
    finally:
        await chat.stream.aclose()  # type: ignore[attr-defined]
    message, called = server.tools.answer(chat.mode, "".join(pieces))
    return message, called, ended


def _add_responses_routes(app: FastAPI, server: _Server) -> None:
    """OpenAI's Responses API: `/v1/responses`, whole or streamed, and its stored answers."""
    store = server.stored

    @app.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest) -> Any:
        if isinstance(lora := server.check_model(body.model), JSONResponse):
            return lora
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            found = store.get(body.previous_response_id)
            if found is None:
                why = "is not a stored response (never stored, deleted or expired)"
                return _error(404, f"previous_response_id {body.previous_response_id!r} {why}")
            history = found[1]
        rid = f"resp_{uuid.uuid4().hex}"
        try:
            conversation = history + body.input_messages()
            chat = await _start_chat(server, rid, body.chat_request(conversation), lora)
        except ValueError as e:
            return _error(400, str(e))
        head = responses.ResponseHead(rid, int(time.time()), body.model or server.model_name,
                                      body)  # fmt: skip

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                store.put(response, conversation + responses.history_of(response["output"]))

        if body.stream:
            events = _chat_events(server, chat, responses.ResponseEvents(head, keep))
            return StreamingResponse(events, media_type="text/event-stream")
        message, _, ended = await _whole_chat(server, chat)
        counts = (chat.prompt_tokens, ended.completion_tokens, chat.cached_tokens)
        response = responses.whole_response(head, message, ended.finish_reason, counts)
        keep(response)
        return response

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Any:
        found = store.get(response_id)
        if found is None:
            return _error(404, f"response {response_id!r} is not stored")
        return found[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Any:
        if not store.delete(response_id):
            return _error(404, f"response {response_id!r} is not stored")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _chat_events(
    server: _Server, chat: _Chat, events: responses.ResponseEvents | anthropic.MessageEvents
) -> AsyncIterator[str]:
    """A running chat answer as an API's server-sent events (`events`: its writer)."""
    answer = server.tools.stream(chat.mode)
    try:
        for event in events.start(chat.prompt_tokens, chat.cached_tokens):
            yield event
        async for step in _chat_steps(chat, answer):
            if isinstance(step, _Ended):
                counts = (chat.prompt_tokens, step.completion_tokens, chat.cached_tokens)
                closing = events.finish(answer.called, step.finish_reason, step.stop_reason,
                                        counts)  # fmt: skip
            else:
                closing = events.feed(step)  # type: ignore[arg-type]
            for event in closing:
                yield event
    except RuntimeError as e:
        for event in events.failed(str(e)):
            yield event
    finally:  # a client gone mid-stream: the request is aborted
        await chat.stream.aclose()  # type: ignore[attr-defined]


def _add_messages_routes(app: FastAPI, server: _Server) -> None:
    """Anthropic's Messages API: `/v1/messages`, whole or streamed, and its token count."""

    @app.post("/v1/messages")
    async def create_message(body: anthropic.MessagesRequest) -> Any:
        if isinstance(lora := server.check_model(body.model, "anthropic"), JSONResponse):
            return lora
        mid = f"msg_{uuid.uuid4().hex}"
        try:
            chat = await _start_chat(server, mid, body.chat_request(), lora)
        except ValueError as e:
            return _error(400, str(e), api="anthropic")
        model = body.model or server.model_name
        if body.stream:
            events = _chat_events(server, chat, anthropic.MessageEvents(mid, model))
            return StreamingResponse(events, media_type="text/event-stream")
        message, called, ended = await _whole_chat(server, chat)
        counts = (chat.prompt_tokens, ended.completion_tokens, chat.cached_tokens)
        return anthropic.whole_message(mid, model, message, called, ended.finish_reason,
                                       ended.stop_reason, counts)  # fmt: skip

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: anthropic.CountTokensRequest) -> Any:
        if isinstance(bad := server.check_model(body.model, "anthropic"), JSONResponse):
            return bad
        try:
            chat = body.chat_request()
            server.limits.check(chat)
            ids = server.render(chat, chat.messages)["prompt_token_ids"]
        except ValueError as e:
            return _error(400, str(e), api="anthropic")
        return {"input_tokens": len(ids)}


def parse_lora_modules(specs: list[str] | None) -> dict[str, LoRARequest]:
    """`name=path` pairs (vLLM's `--lora-modules`) as adapters with ids 1, 2, ..."""
    loras: dict[str, LoRARequest] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries must be name=path, got {spec!r}")
        if name in loras:
            raise ValueError(f"--lora-modules names {name!r} twice")
        loras[name] = LoRARequest(name, len(loras) + 1, path)
    return loras


def serve(
    engine_args: Any,
    host: str,
    port: int,
    api_key: str | None,
    model_name: str | None,
    lora_modules: list[str] | None = None,
    chat_template: str | None = None,
    tool_options: dict[str, Any] | None = None,
    limits: dict[str, int] | None = None,
    host_memory_fraction: float = 0.9,
    shutdown_timeout: float = 30.0,
) -> None:
    """Build the engine (its graphs compiled first, or in the background with
    `background_compile`), then serve until interrupted.
    `tool_options`: `ChatTools`' keyword arguments (`enable_auto_tool_choice`,
    `tool_call_parser`, `reasoning_parser`), checked before the engine is built. `limits`:
    `ServeLimits`' fields over their defaults. `host_memory_fraction`: the host memory budget
    requests are admitted within (`HostMemoryBudget`). SIGTERM or SIGINT: new requests get
    503, those in flight have `shutdown_timeout` seconds to finish (then they are aborted),
    and the process exits; a second signal exits at once."""
    loras = parse_lora_modules(lora_modules)
    if loras and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if not shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
    tools = ChatTools(None, **(tool_options or {}))  # bad parser names fail before the engine
    budget = HostMemoryBudget.fraction(host_memory_fraction)
    config = engine_args.create_engine_config()
    serve_limits = ServeLimits(**{"max_n": config.max_num_seqs, **(limits or {})})
    llm_engine = LLMEngine.from_config(config)
    for lora in loras.values():  # checked (and loaded) before the server takes requests
        assert llm_engine.lora is not None
        llm_engine.lora.add(lora)
    engine = AsyncLLMEngine(llm_engine, budget)
    tools.tokenizer = llm_engine.tokenizer
    app = build_app(engine, model_name or engine_args.model, api_key, loras, chat_template, tools,
                    serve_limits)  # fmt: skip
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                               timeout_graceful_shutdown=shutdown_timeout)  # fmt: skip
    try:
        _DrainingServer(uv_config, app.state.server).run()
    finally:
        engine.shutdown()


class _DrainingServer(uvicorn.Server):  # type: ignore[misc]
    """uvicorn's server, which on the first SIGTERM or SIGINT stops accepting connections and
    waits for those open (up to `timeout_graceful_shutdown`); here the app also answers 503 to
    requests that still arrive on them, and a second signal of either kind exits at once
    (uvicorn's own: only a second SIGINT)."""

    def __init__(self, config: uvicorn.Config, server: _Server) -> None:
        super().__init__(config)
        self.app_server = server

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.app_server.draining = True
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)
