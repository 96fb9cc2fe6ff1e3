"""`ember serve MODEL`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the async engine.

Endpoints: `/health` (no auth), `/metrics` (Prometheus, `ember.serve.metrics`), `/v1/models`,
`/v1/completions` and `/v1/chat/completions` (streaming as server-sent events, `usage`
counts), `/v1/embeddings`; LoRA adapters are served as models of their own names. Request
fields are OpenAI's plus vLLM's sampling extras (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, ...). Bad requests get OpenAI-style JSON errors: 400
for values the engine rejects, 422 for a body that fails validation, 404 for an unknown
model, 401 without the API key (`--api-key` or `EMBER_API_KEY`, as `Authorization: Bearer
<key>`); none of them disturbs other requests. A client that disconnects mid-stream has its
request aborted (its KV blocks freed).
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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from ember.lora.adapter import LoRARequest
from ember.runtime.llm import render_chat
from ember.runtime.outputs import Logprob, RequestOutput
from ember.runtime.request import SamplingParams
from ember.runtime.structured import StructuredOutputsParams
from ember.serve.async_engine import AsyncLLMEngine
from ember.serve.chat_outputs import ChatStream, ChatTools


class _Sampling(BaseModel):
    """The sampling fields both endpoints take (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
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


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def _prompts(prompt: Any) -> list[Any]:
    """An OpenAI `prompt`: a string, a list of strings, a token list or a list of them."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def build_app(
    engine: AsyncLLMEngine,
    model_name: str,
    api_key: str | None = None,
    loras: dict[str, LoRARequest] | None = None,
    chat_template: str | None = None,
    chat_tools: ChatTools | None = None,
) -> FastAPI:
    """The server's app over a running async engine, serving the model as `model_name` and
    each LoRA adapter of `loras` as a model of its own name (as vLLM's `--lora-modules`).
    `chat_template`: the server's template (`--chat-template`), over the tokenizer's;
    a request's own `chat_template` wins over both. `chat_tools`: the tool-call and reasoning
    parsers (`ChatTools`; default: none, so `auto` tool choice is refused)."""
    loras = dict(loras or {})
    app = FastAPI(title="ember", docs_url=None, redoc_url=None)
    tokenizer = engine.engine.tokenizer
    tools = chat_tools if chat_tools is not None else ChatTools(tokenizer)
    defaults = engine.engine.default_sampling
    created = int(time.time())

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Any:
        if api_key is not None and request.url.path not in ("/", "/health"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return _error(401, "invalid or missing API key", "AuthenticationError")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()
        )
        return _error(422, f"invalid request body: {errors}", "UnprocessableEntityError")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    from importlib import resources  # noqa: PLC0415

    page = resources.files("ember.serve").joinpath("static/chat.html").read_text("utf-8")

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:  # the page needs no key; its API calls carry one
        return Response(page, media_type="text/html")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "ember"}
        cards = [card] + [card | {"id": name, "parent": model_name} for name in loras]
        return {"object": "list", "data": cards}

    def check_model(name: str | None) -> JSONResponse | LoRARequest | None:
        """None for the base model, the adapter of a LoRA name, or a 404 response."""
        if name is None or name == model_name:
            return None
        if name in loras:
            return loras[name]
        names = [model_name, *loras]
        return _error(404, f"model {name!r} does not exist (this server has {names})",
                      "NotFoundError")  # fmt: skip

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Any:
        if isinstance(bad := check_model(body.model), JSONResponse):
            return bad
        if bad is not None:
            return _error(400, "embeddings with a LoRA adapter are not supported")
        if body.encoding_format not in ("float", "base64"):
            return _error(
                400, f"encoding_format must be float or base64, got {body.encoding_format!r}"
            )
        rid = f"embd-{uuid.uuid4().hex}"
        try:
            outs = await asyncio.gather(*(
                engine.embed(f"{rid}-{i}", p) for i, p in enumerate(_prompts(body.input))
            ))  # fmt: skip
        except ValueError as e:
            return _error(400, str(e))
        data = []
        for i, out in enumerate(outs):
            vector: Any = out.outputs.embedding
            if body.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"object": "list", "data": data, "model": body.model or model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        if isinstance(bad := check_model(body.model), JSONResponse):
            return bad
        try:
            if tokenizer is None:
                raise ValueError("this model has no tokenizer")
            if (body.prompt is None) == (body.messages is None):
                raise ValueError("/tokenize takes one of prompt or messages")
            if body.messages is not None:
                ids = render_chat(
                    tokenizer, body.messages, body.chat_template or chat_template, "auto",
                    body.add_generation_prompt, body.continue_final_message, body.tools,
                    body.chat_template_kwargs, engine.engine.image_token(),
                )["prompt_token_ids"]  # fmt: skip
            else:
                ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)
                ids = list(ids["input_ids"])
        except ValueError as e:
            return _error(400, str(e))
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.engine.config.max_model_len,
                "tokens": ids, "token_strs": strs}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        if isinstance(bad := check_model(body.model), JSONResponse):
            return bad
        if tokenizer is None:
            return _error(400, "this model has no tokenizer")
        vocab = engine.engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            return _error(400, f"tokens must be ids in [0, {vocab})")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        if isinstance(lora := check_model(body.model), JSONResponse):
            return lora
        try:
            params = body.sampling_params(defaults, body.max_tokens)
            prompts = _prompts(body.prompt)
        except ValueError as e:
            return _error(400, str(e))
        rid = f"cmpl-{uuid.uuid4().hex}"
        name = body.model or model_name
        return await _respond(engine, rid, prompts, params, body, name, created, lora, chat=None)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Any:
        if isinstance(lora := check_model(body.model), JSONResponse):
            return lora
        try:
            mode = tools.mode(body.tools, body.tool_choice)
            prompt = render_chat(
                tokenizer, body.messages, body.chat_template or chat_template, "auto",
                body.add_generation_prompt, body.continue_final_message, body.tools,
                body.chat_template_kwargs, engine.engine.image_token(),
            )  # fmt: skip
            max_tokens = body.max_completion_tokens or body.max_tokens
            params = body.sampling_params(defaults, max_tokens if max_tokens else None)
            forced = tools.structured_output(mode, body.parallel_tool_calls)
            if forced is not None:
                if params.structured_outputs is not None:
                    raise ValueError(
                        f"tool_choice {body.tool_choice!r} makes the answer a call: it cannot be "
                        "combined with another structured output"
                    )
                params.structured_outputs = forced
            if tools.reasoning is not None and params.structured_outputs is not None:
                # As vLLM: the structure holds for the answer after the reasoning, unless the
                # prompt already closed it (e.g. Qwen3's enable_thinking=false).
                start, end = tools.reasoning.start, tools.reasoning.end
                opened, closed = prompt["prompt"].rfind(start), prompt["prompt"].rfind(end)
                if not closed > opened >= 0:
                    params.structured_outputs = dataclasses.replace(
                        params.structured_outputs, start_after=end
                    )
            if mode.kind == "auto" and tools.needs_special_tokens:
                params.skip_special_tokens = False  # the parser's markers are special tokens
        except ValueError as e:
            return _error(400, str(e))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        name = body.model or model_name
        return await _respond(engine, rid, [prompt], params, body, name, created, lora,
                              chat=(tools, mode))  # fmt: skip

    return app


async def _respond(
    engine: AsyncLLMEngine,
    rid: str,
    prompts: list[Any],
    params: SamplingParams,
    body: _Sampling,
    model_name: str,
    created: int,
    lora: LoRARequest | None,
    chat: tuple[ChatTools, Any] | None,
) -> Any:
    """Start one engine request per prompt (all validated before any runs), then answer as a
    whole or as an event stream. `chat`: the server's tools and the request's tool mode, for a
    chat completion (None: a text completion)."""
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            stream = engine.generate(f"{rid}-{i}", prompt, params, lora)
            first = await anext(stream, None)  # raises ValueError for bad input
            streams.append((stream, first))
    except ValueError as e:
        for stream, _ in streams:
            await stream.aclose()
        return _error(400, str(e))
    kind = "chat.completion" if chat else "text_completion"
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        events = _events(streams, params.n, rid, model_name, created, chat, usage,
                         params.logprobs, bool(getattr(body, "echo", False)), engine)  # fmt: skip
        return StreamingResponse(events, media_type="text/event-stream")
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    logprobs: dict[int, list[dict[int, Logprob]]] = {}
    echoes: dict[int, tuple[str, list[int], Any]] = {}  # the prompt, echoed into each choice
    prompt_tokens = completion_tokens = 0
    for p, (stream, first) in enumerate(streams):
        outs = [out async for out in _prepend(first, stream)]
        if outs:
            prompt_tokens += len(outs[0].prompt_token_ids)
        for out in outs:
            if out.error:
                return _error(500, f"request failed: {out.error}", "InternalServerError")
            for c in out.outputs:
                idx = p * params.n + c.index
                texts.setdefault(idx, []).append(c.text)
                logprobs.setdefault(idx, []).extend(c.logprobs or [])
                completion_tokens += len(c.token_ids)
                reasons[idx] = c.finish_reason
        if getattr(body, "echo", False) and outs:  # once per prompt, from its last output
            last = outs[-1]
            echoed = (_prompt_text(engine, last), last.prompt_token_ids, last.prompt_logprobs)
            echoes.update((p * params.n + i, echoed) for i in range(params.n))
    choices = []
    for idx in sorted(texts):
        text = "".join(texts[idx])
        if chat:
            message, called = chat[0].answer(chat[1], text)
            choice = {"index": idx, "message": message,
                      "finish_reason": "tool_calls" if called else reasons[idx]}  # fmt: skip
            if params.logprobs is not None:
                choice["logprobs"] = {"content": _chat_logprobs(logprobs[idx], params.logprobs)}
            choices.append(choice)
        else:
            lps = None
            prompt, prompt_ids, prompt_lps = echoes.get(idx, ("", [], None))
            if params.logprobs is not None:
                lps = _completion_logprobs(logprobs[idx], len(prompt))
                if idx in echoes:
                    lps = _merge_logprobs(_prompt_logprobs(engine, prompt_ids, prompt_lps), lps)
            choices.append({"index": idx, "text": prompt + text, "logprobs": lps,
                            "finish_reason": reasons[idx]})  # fmt: skip
    return {
        "id": rid, "object": kind, "created": created, "model": model_name, "choices": choices,
        "usage": _usage(prompt_tokens, completion_tokens),
    }  # fmt: skip


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


async def _events(
    streams: list[tuple[AsyncIterator[RequestOutput], RequestOutput | None]],
    n: int,
    rid: str,
    model_name: str,
    created: int,
    chat: tuple[ChatTools, Any] | None,
    include_usage: bool,
    logprob_k: int | None = None,
    echo: bool = False,
    engine: AsyncLLMEngine | None = None,
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step and sequence with new text, then `[DONE]`.
    Prompts stream one after another (each runs in the engine from the start)."""
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"
    prompt_tokens = completion_tokens = 0

    def event(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        data: dict[str, Any] = {"id": rid, "object": chunk_kind, "created": created,
                                "model": model_name, "choices": choices}  # fmt: skip
        if usage is not None:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n"

    answers: dict[int, ChatStream] = {}
    offsets: dict[int, int] = {}  # text offsets of the next token, for completions' logprobs
    try:
        if chat:
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None} for i in range(n)])  # fmt: skip
        for p, (stream, first) in enumerate(streams):
            outs: AsyncIterator[RequestOutput] = _prepend(first, stream)
            async for out in outs:
                prompt_tokens += len(out.prompt_token_ids) if out.finished else 0
                choices = []
                if echo and p * n not in offsets:  # the prompt first, as vLLM streams echo
                    prompt = _prompt_text(engine, out)
                    lps = None
                    if logprob_k is not None:
                        lps = _prompt_logprobs(engine, out.prompt_token_ids, out.prompt_logprobs)
                    for i in range(n):
                        offsets[p * n + i] = len(prompt)
                        yield event([{"index": p * n + i, "text": prompt, "logprobs": lps,
                                      "finish_reason": None}])  # fmt: skip
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if (
                        not c.text
                        and c.finish_reason is None
                        and not (logprob_k is not None and c.logprobs)
                    ):
                        continue
                    idx = p * n + c.index
                    if chat:
                        answer = answers.setdefault(idx, chat[0].stream(chat[1]))
                        final = c.finish_reason is not None
                        deltas = answer.feed(c.text, final)
                        if logprob_k is not None and c.logprobs:
                            deltas = deltas or [{}]
                            content = _chat_logprobs(c.logprobs, logprob_k)
                            deltas[0] = {"delta": deltas[0], "logprobs": {"content": content}}
                        for delta in deltas:
                            piece = delta if "delta" in delta else {"delta": delta}
                            yield event([{"index": idx, **piece, "finish_reason": None}])
                        if final:
                            reason = "tool_calls" if answer.called else c.finish_reason
                            choices.append({"index": idx, "delta": {}, "finish_reason": reason})
                    else:
                        lps = None
                        if logprob_k is not None:
                            lps = _completion_logprobs(c.logprobs or [], offsets.get(idx, 0))
                            offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in lps["tokens"])
                        choices.append({"index": idx, "text": c.text, "logprobs": lps,
                                        "finish_reason": c.finish_reason})  # fmt: skip
                if choices:
                    yield event(choices)
        if include_usage:
            yield event([], _usage(prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"
    finally:  # a client gone mid-stream: every request still running is aborted
        for stream, _ in streams:
            await stream.aclose()  # type: ignore[attr-defined]


def _prompt_text(engine: AsyncLLMEngine | None, out: RequestOutput) -> str:
    """The prompt as text, for `echo` (a token-id prompt decoded)."""
    if out.prompt is not None:
        return out.prompt
    tokenizer = engine.engine.tokenizer if engine is not None else None
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def _token_text(entry: dict[int, Logprob], token: int) -> str:
    lp = entry.get(token)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else ""


def _completion_logprobs(entries: list[dict[int, Logprob]], offset: int) -> dict[str, list[Any]]:
    """OpenAI's legacy completion logprobs of generated tokens: each entry's first key is
    the sampled token (ember's order), the rest its top alternatives; `offset`: where the
    first token's text starts in the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry in entries:
        sampled = next(iter(entry))
        text = _token_text(entry, sampled)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_lps.append(entry[sampled].logprob)
        tops.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def _prompt_logprobs(
    engine: AsyncLLMEngine | None, prompt_ids: list[int], entries: Any
) -> dict[str, list[Any]]:
    """The echoed prompt's legacy logprobs: its first token has none (None), as in vLLM."""
    tokenizer = engine.engine.tokenizer if engine is not None else None
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for i, token in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        text = tokenizer.decode([token]) if tokenizer is not None else ""
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(entry[token].logprob if token in entry else None)
            tops.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def _merge_logprobs(prompt: dict[str, list[Any]], out: dict[str, list[Any]]) -> dict[str, Any]:
    return {key: prompt[key] + out[key] for key in prompt}


def _chat_logprobs(entries: list[dict[int, Logprob]], k: int) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs: per generated token its text, logprob and bytes, and the
    `k` most likely tokens (by rank) in `top_logprobs`."""

    def item(lp: Logprob) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for entry in entries:
        sampled = next(iter(entry))
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        content.append({**item(entry[sampled]), "top_logprobs": [item(lp) for lp in top]})
    return content


async def _prepend(
    first: RequestOutput | None, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
        if first.finished:
            return
    async for out in rest:
        yield out


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
) -> None:
    """Build the engine (its graphs compiled first, or in the background with
    `background_compile`), then serve until interrupted.
    `tool_options`: `ChatTools`' keyword arguments (`enable_auto_tool_choice`,
    `tool_call_parser`, `reasoning_parser`), checked before the engine is built."""
    import uvicorn  # noqa: PLC0415

    from ember.runtime.engine import LLMEngine  # noqa: PLC0415

    loras = parse_lora_modules(lora_modules)
    if loras and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    tools = ChatTools(None, **(tool_options or {}))  # bad parser names fail before the engine
    config = engine_args.create_engine_config()
    llm_engine = LLMEngine.from_config(config)
    for lora in loras.values():  # checked (and loaded) before the server takes requests
        assert llm_engine.lora is not None
        llm_engine.lora.add(lora)
    engine = AsyncLLMEngine(llm_engine)
    tools.tokenizer = llm_engine.tokenizer
    app = build_app(engine, model_name or engine_args.model, api_key, loras, chat_template, tools)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.shutdown()
