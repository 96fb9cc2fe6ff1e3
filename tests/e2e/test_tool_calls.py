"""Tool calls and reasoning in `/v1/chat/completions`, driven by the official `openai` client.

One engine on a tiny checkpoint serves several apps (one per server configuration: each
tool-call parser, a reasoning parser, none) from one uvicorn in this process. The tiny model
is made to emit each format's text with a structured output (`choice` of the exact text), so
every test runs on the text that format produces; `required` and named tool choices are
enforced by the JSON schema built from the functions, and sampled answers always parse.
The `ember serve` flags are checked in a subprocess."""

from __future__ import annotations

import json
import os

import fastapi
import jsonschema
import openai
import pytest
import xgrammar  # noqa: F401  (structured outputs' backend, a dev dependency)
from transformers import AutoTokenizer

from ember.runtime.config import EngineArgs
from ember.runtime.engine import LLMEngine
from tests.e2e.servers import serve_in_thread, start_serve, stop_serve, with_chat_template

# A Qwen2.5-style template: tools in the system turn, assistant tool calls as hermes blocks,
# tool results as user turns in <tool_response>, and an enable_thinking switch.
TEMPLATE = """\
{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>
{%- for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}
{% elif m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response>
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not \
enable_thinking %}<think></think>{% endif %}{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
            "required": ["city", "metric"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]

# Each parser's text for: a sentence, then get_weather(city=Paris, metric=true) and
# get_time(zone=UTC) (llama3_json and pythonic outputs are calls only).
CALLS = [("get_weather", {"city": "Paris", "metric": True}), ("get_time", {"zone": "UTC"})]
FORMATS = {
    "hermes": (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "metric": true}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        "Let me check.",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "metric": true}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        None,
    ),
    "mistral": (
        'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        '"metric": true}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]',
        "Let me check.",
    ),
    "pythonic": ('[get_weather(city="Paris", metric=True), get_time(zone="UTC")]', None),
}


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tools") / "m")
    return with_chat_template(checkpoint_dir("tiny-llama"), d, TEMPLATE)


ENGINE = dict(compile=False, dtype="float32", kv_cache_gib=0.05, max_model_len=512)
APPS = {
    **{name: dict(enable_auto_tool_choice=True, tool_call_parser=name) for name in FORMATS},
    "plain": {},
    "qwen3": dict(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    ),  # fmt: skip
    "deepseek_r1": dict(reasoning_parser="deepseek_r1"),
}


@pytest.fixture(scope="module")
def server(model_dir):
    """One engine, one uvicorn; each configuration of `APPS` at /<name>/v1."""

    from ember.serve.async_engine import AsyncLLMEngine
    from ember.serve.chat_outputs import ChatTools
    from ember.serve.server import build_app

    config = EngineArgs(model=model_dir, **ENGINE).create_engine_config()
    engine = AsyncLLMEngine(LLMEngine.from_config(config, show_progress=False))
    root = fastapi.FastAPI()
    for name, options in APPS.items():
        tools = ChatTools(engine.engine.tokenizer, **options)
        root.mount(f"/{name}", build_app(engine, "tiny", chat_tools=tools))
    with serve_in_thread(root) as url:
        yield url, engine
    engine.shutdown()


def _client(server, name: str):
    return openai.OpenAI(base_url=f"{server[0]}/{name}/v1", api_key="none", max_retries=0)


def _forced(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}}


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _stream(client, **kw):
    """(content, reasoning, [(name, arguments string)], finish reason) reassembled from the
    stream's deltas the way an OpenAI client does."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or "" if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            reason = choice.finish_reason or reason
    assert all(c["id"] for c in calls.values())
    return (
        content,
        reasoning,
        [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
        reason,
    )


@pytest.mark.parametrize("parser", list(FORMATS))
def test_each_parser_returns_tool_calls_streamed_or_not(server, parser):
    text, content = FORMATS[parser]
    client = _client(server, parser)
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body=_forced(text))  # fmt: skip
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert _calls(message) == CALLS
    assert message.content == content
    assert all(c.type == "function" and c.id for c in message.tool_calls)
    if parser == "mistral":  # Mistral's tool-call ids: 9 letters and digits
        assert all(len(c.id) == 9 and c.id.isalnum() for c in message.tool_calls)
    s_content, _, s_calls, s_reason = _stream(client, **kw)
    assert s_reason == "tool_calls"
    assert s_content == (content or "")
    assert s_calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_auto_falls_back_to_content_when_nothing_parses(server):
    client = _client(server, "hermes")
    text = 'No call here. <tool_call>{"name": broken</tool_call>'
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body=_forced(text))  # fmt: skip
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls in (None, [])
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    assert _stream(client, **kw)[0] == text
    # tool_choice none: the text is the answer, even when it holds a call.
    r = client.chat.completions.create(**{**kw, "tool_choice": "none",
                                          "extra_body": _forced(FORMATS["hermes"][0])})  # fmt: skip
    assert r.choices[0].message.content == FORMATS["hermes"][0]
    assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_calls_always_parse(server, parallel):
    """Sampled at temperature 1 with no parser at all: the schema built from the functions
    makes every answer a valid call. With parallel_tool_calls the array may go on (the tiny
    random model rarely closes it): those cut by max_tokens are not calls, and every answer
    that ends is."""
    client = _client(server, "plain")
    ended = 0
    for seed in range(4):
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, temperature=1.0,
                  seed=seed, parallel_tool_calls=parallel)  # fmt: skip
        r = client.chat.completions.create(**kw, tool_choice="required")
        calls = _calls(r.choices[0].message)
        if r.choices[0].finish_reason == "length" and parallel:
            assert not calls and r.choices[0].message.content.startswith('[{"name": "')
        else:
            ended += 1
            assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0].message
            assert r.choices[0].message.content is None
        assert parallel or len(calls) == 1
        for name, args in calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == name)
            jsonschema.validate(args, tool["function"]["parameters"])
        named = {"type": "function", "function": {"name": "get_time"}}
        r = client.chat.completions.create(**kw, tool_choice=named)
        ((name, args),) = _calls(r.choices[0].message)
        assert name == "get_time" and r.choices[0].message.content is None
        jsonschema.validate(args, TIME["function"]["parameters"])
        _, _, s_calls, reason = _stream(client, **kw, tool_choice=named)
        assert reason == "tool_calls" and [n for n, _ in s_calls] == ["get_time"]
        jsonschema.validate(json.loads(s_calls[0][1]), TIME["function"]["parameters"])
    assert ended >= 1


def test_a_tool_round_trip_goes_through_the_template(server, model_dir):
    """call -> tool result -> answer: the assistant's tool_calls and the tool message reach
    the chat template as HF's apply_chat_template renders them (arguments as a dict)."""
    client = _client(server, "hermes")
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=200,
        temperature=0,
        extra_body=_forced(FORMATS["hermes"][0]),
    )
    message = r.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'}
                 for c in message.tool_calls)]  # fmt: skip
    final = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0, tool_choice="none"
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf_history = [*ASK, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS]},
        *({"role": "tool", "content": '{"temp": 21}'} for _ in CALLS)]  # fmt: skip
    text = tok.apply_chat_template(hf_history, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)  # fmt: skip
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' in text
    assert final.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    assert final.choices[0].message.content


def _forced_closed(text: str) -> dict:
    """`_forced`, with the reasoning closed in the prompt (enable_thinking false: the template
    writes <think></think>), so that the structure holds from the first token; otherwise a
    reasoning server applies it only after the model's own </think>."""
    return {**_forced(text), "chat_template_kwargs": {"enable_thinking": False}}


def test_reasoning_is_split_streamed_or_not(server):
    client = _client(server, "qwen3")
    text = "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny."
    kw = dict(model="tiny", messages=ASK, max_tokens=200, temperature=0,
              extra_body=_forced_closed(text))  # fmt: skip
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert "The user wants Paris." in reasoning and "<think>" not in reasoning
    assert message.content.strip() == "It is sunny." and "</think>" not in message.content
    content, s_reasoning, calls, _ = _stream(client, **kw)
    assert (content, s_reasoning, calls) == (message.content, reasoning, [])
    # Tool calls are read from the answer after the reasoning.
    hermes = FORMATS["hermes"][0]
    r = client.chat.completions.create(
        **{**kw, "tools": TOOLS, "extra_body": _forced_closed("<think>plan</think>" + hermes)}
    )
    assert _calls(r.choices[0].message) == CALLS
    assert r.choices[0].message.model_extra["reasoning_content"] == "plan"
    # With the reasoning open, the structure waits for the model's </think> (which this tiny
    # model does not write): the answer is free text, not the choice.
    r = client.chat.completions.create(**{**kw, "max_tokens": 6, "extra_body": _forced("yes")})
    assert r.choices[0].message.content != "yes"
    # deepseek_r1: an answer that starts inside the reasoning (as after R1's template).
    r1 = _client(server, "deepseek_r1")
    r = r1.chat.completions.create(
        **{**kw, "extra_body": _forced_closed("Thinking it over.</think>It is sunny.")}
    )
    assert r.choices[0].message.model_extra["reasoning_content"] == "Thinking it over."
    assert r.choices[0].message.content == "It is sunny."


def test_chat_template_kwargs_reach_the_template(server, model_dir):
    client = _client(server, "plain")
    tok = AutoTokenizer.from_pretrained(model_dir)
    for kwargs, tail in ((None, "<|assistant|>"), ({"enable_thinking": False}, "<think></think>")):
        r = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=2, temperature=0,
            extra_body={"chat_template_kwargs": kwargs} if kwargs else None,
        )  # fmt: skip
        text = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False,
                                       **(kwargs or {}))  # fmt: skip
        assert text.endswith(tail)
        assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_bad_tool_requests_are_400s_with_clear_messages(server):
    plain, hermes = _client(server, "plain"), _client(server, "hermes")
    cases = [
        (plain, dict(tools=TOOLS), "--enable-auto-tool-choice"),  # auto, no parser
        (plain, dict(tools=TOOLS, tool_choice="auto"), "--tool-call-parser"),
        (hermes, dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "name"),
        (
            hermes,
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            "parameters",
        ),  # fmt: skip
        (
            plain,
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": 5}}},
                        },
                    }
                ],
                tool_choice="required",
            ),
            "schema",
        ),  # fmt: skip
        (
            plain,
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
            "not in tools",
        ),
        (plain, dict(tool_choice="required"), "needs tools"),
        (plain, dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (
            plain,
            dict(tools=TOOLS, tool_choice="required", extra_body={"guided_regex": "a+"}),
            "structured output",
        ),  # fmt: skip
    ]
    for client, kw, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **kw)
        assert words in str(e.value), (kw, str(e.value))
    r = hermes.chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    assert r.choices[0].finish_reason == "length"  # the server is still up


def test_serve_flags(model_dir, capsys, monkeypatch):
    """`ember serve` with an unknown parser, or auto tool choice without a parser, exits
    with a clear message before building the engine; with both it serves tool calls."""
    from ember import cli
    from ember.runtime import engine

    def never(*args, **kwargs):
        raise AssertionError("the engine was built before the flags were checked")

    base = ["serve", model_dir, "--no-compile", "--kv-cache-gib", "0.05", "--max-model-len", "512"]
    with monkeypatch.context() as m:  # in this process: the same code as `ember serve`'s
        m.setattr(engine.LLMEngine, "from_config", never)
        assert cli.main(base + ["--tool-call-parser", "nope"]) == 2
        err = capsys.readouterr().err
        assert "nope" in err and "hermes" in err, err
        assert cli.main(base + ["--enable-auto-tool-choice"]) == 2
        err = capsys.readouterr().err
        assert "--tool-call-parser" in err, err
    proc, url = start_serve([model_dir, "--no-compile", "--kv-cache-gib", "0.05", "--max-model-len",
                        "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                       dict(os.environ), timeout=120)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(
            model=model_dir, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
            extra_body=_forced(FORMATS["hermes"][0]),
        )  # fmt: skip
        assert _calls(r.choices[0].message) == CALLS
    finally:
        stop_serve(proc)


def test_forced_answers_that_do_not_parse_stay_content():
    """A forced call cut short by max_tokens (or, with the grammar dormant before a reasoning
    end that never came, free text) has no calls: its text stays content, streamed or not."""
    from ember.serve.chat_outputs import ChatTools

    tools = ChatTools(None)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        mode = tools.mode(TOOLS, choice)
        for text in ('[{"name": "get_time", "parameters": {"zo', '[{"nam": 1}]', "[1, 2]", "x"):
            message, called = tools.answer(mode, text)
            assert not called and message["content"] == text and "tool_calls" not in message
            stream = tools.stream(mode)
            deltas = stream.feed(text[:5]) + stream.feed(text[5:], final=True)
            assert "".join(d.get("content", "") for d in deltas) == text and not stream.called
