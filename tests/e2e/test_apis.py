"""OpenAI's Responses API and Anthropic's Messages API, driven by the official `openai` and
`anthropic` clients against one engine served in this process (as `test_tool_calls` does).

Greedy answers are checked against `LLM.chat` on the same conversation; streamed answers
(the clients' own stream accumulators) against whole ones; tool calls, reasoning and stop
reasons with answers forced to a format's exact text by a structured output (`choice`)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import anthropic
import fastapi
import openai
import pytest

from ember.runtime.config import EngineArgs
from ember.runtime.engine import LLMEngine
from ember.runtime.llm import LLM
from ember.runtime.request import SamplingParams
from ember.serve.responses import ResponseStore
from tests.e2e.servers import serve_in_thread, with_chat_template
from tests.e2e.test_tool_calls import ASK, CALLS, FORMATS, TEMPLATE, TIME, TOOLS

ENGINE = dict(compile=False, dtype="float32", kv_cache_gib=0.05, max_model_len=512)
APPS = {
    "qwen3": dict(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    ),  # fmt: skip
    "plain": {},
}
KEY = "sekret"
# Anthropic's tools: the same functions as TOOLS.
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
            "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' tools


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("apis") / "m")
    return with_chat_template(checkpoint_dir("tiny-llama"), d, TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir):
    """One engine, one uvicorn; each configuration of `APPS` at /<name>, plus /keyed (the
    plain one behind an API key) and /small (at most 2 stored responses)."""

    from ember.serve.async_engine import AsyncLLMEngine
    from ember.serve.chat_outputs import ChatTools
    from ember.serve.limits import ServeLimits
    from ember.serve.server import build_app

    config = EngineArgs(model=model_dir, **ENGINE).create_engine_config()
    engine = AsyncLLMEngine(LLMEngine.from_config(config, show_progress=False))
    root = fastapi.FastAPI()
    for name, options in APPS.items():
        tools = ChatTools(engine.engine.tokenizer, **options)
        root.mount(f"/{name}", build_app(engine, "tiny", chat_tools=tools))
    root.mount("/keyed", build_app(engine, "tiny", api_key=KEY))
    small = ServeLimits(max_n=4, max_stored_responses=2)
    root.mount("/small", build_app(engine, "tiny", limits=small))
    with serve_in_thread(root) as url:
        yield url
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, use_tqdm=False, **ENGINE)


def _oai(server, name: str = "plain"):
    return openai.OpenAI(base_url=f"{server}/{name}/v1", api_key="none", max_retries=0)


def _claude(server, name: str = "plain", key: str = "none"):
    return anthropic.Anthropic(base_url=f"{server}/{name}", api_key=key, max_retries=0)


GREEDY = {"temperature": 0}  # Anthropic's client sends sampling fields as extra_body


def _forced(text: str, thinking: bool = False) -> dict:
    """A structured output that makes the answer `text`; closing the template's reasoning
    (enable_thinking false) so that it holds from the first token on a reasoning server."""
    body: dict = {"structured_outputs": {"choice": [text]}, **GREEDY}
    if thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def _post(url: str, body: dict) -> tuple[int, bytes]:
    """(HTTP status, body) of a raw JSON POST."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _greedy(llm, messages, max_tokens, **kw) -> tuple[str, int]:
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens),
                      use_tqdm=False, **kw)  # fmt: skip
    return out.outputs[0].text, len(out.prompt_token_ids)


# ---- Responses ---------------------------------------------------------------------------


def _stream_response(client, **kw):
    """The stream's final response and its event types, through the client's stream helper
    (its accumulator checks the events' order; an incomplete response, cut by
    max_output_tokens, ends with response.incomplete as OpenAI's do, which the helper's
    `get_final_response` does not take)."""
    types, final = [], None
    with client.responses.stream(**kw) as stream:
        for event in stream:
            types.append(event.type)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    return final, types


def test_responses_text_equals_llm_chat_whole_and_streamed(server, llm):
    client = _oai(server)
    system = "Answer briefly."
    r = client.responses.create(model="tiny", input=ASK[0]["content"], instructions=system,
                                max_output_tokens=12, temperature=0)  # fmt: skip
    text, prompt_tokens = _greedy(llm, [{"role": "system", "content": system}, *ASK], 12)
    assert r.output_text == text and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt_tokens, 12)
    assert [item.type for item in r.output] == ["message"]
    final, types = _stream_response(client, model="tiny", input=ASK[0]["content"],
                                    instructions=system, max_output_tokens=12, temperature=0)  # fmt: skip
    assert final.output_text == text and final.status == "incomplete"
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert types.count("response.output_text.delta") >= 2
    assert "response.output_text.done" in types and "response.output_item.done" in types
    # Raw events: numbered in order, each named in its SSE `event:` line.
    status, raw = _post(f"{server}/plain/v1/responses", dict(
        model="tiny", input="hi", max_output_tokens=3, temperature=0, stream=True))  # fmt: skip
    assert status == 200
    lines = [line for line in raw.decode().splitlines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert names == [d["type"] for d in data]


def test_responses_tool_calls_and_reasoning_streamed_or_not(server):
    client = _oai(server, "qwen3")
    text = "<think>plan</think>" + FORMATS["hermes"][0]
    kw = dict(model="tiny", input=ASK, tools=R_TOOLS, max_output_tokens=200, temperature=0,
              extra_body=_forced(text, thinking=True))  # fmt: skip
    r = client.responses.create(**kw)
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call",
                                          "function_call"]  # fmt: skip
    assert r.output[0].content[0].text == "plan"
    assert r.output_text == "Let me check."
    calls = [(i.name, json.loads(i.arguments)) for i in r.output if i.type == "function_call"]
    assert calls == CALLS and all(i.call_id for i in r.output[2:])
    assert r.status == "completed"
    final, types = _stream_response(client, **kw)
    assert [i.type for i in final.output] == [i.type for i in r.output]
    assert final.output[0].content[0].text == "plan" and final.output_text == "Let me check."
    s_calls = [(i.name, json.loads(i.arguments)) for i in final.output[2:]]
    assert s_calls == CALLS
    assert "response.reasoning_text.delta" in types
    assert types.count("response.function_call_arguments.done") == 2
    assert types[-1] == "response.completed"
    # A named function through the structured output, no parser needed.
    r = _oai(server).responses.create(model="tiny", input=ASK, tools=R_TOOLS, temperature=0,
                                      tool_choice={"type": "function", "name": "get_time"},
                                      max_output_tokens=60)  # fmt: skip
    ((item,),) = [[i for i in r.output if i.type == "function_call"]]
    assert item.name == "get_time" and json.loads(item.arguments)["zone"] in ("UTC", "CET")
    # text.format: the answer follows the schema (an enum: the greedy tiny model fills any
    # room a schema leaves with spaces).
    fmt = {"type": "json_schema", "name": "zone", "schema": {"enum": ["UTC", "CET"]}}
    r = _oai(server).responses.create(model="tiny", input=ASK, text={"format": fmt},
                                      max_output_tokens=20, temperature=0)  # fmt: skip
    assert r.status == "completed" and json.loads(r.output_text) in ("UTC", "CET")


def test_previous_response_id_continues_the_stored_conversation(server, llm):
    client = _oai(server, "qwen3")
    first = client.responses.create(
        model="tiny", input=ASK, tools=R_TOOLS, max_output_tokens=200, temperature=0,
        extra_body=_forced(FORMATS["hermes"][0], thinking=True),
    )  # fmt: skip
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 2
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"ok": 1}'}
               for c in calls]  # fmt: skip
    second = client.responses.create(model="tiny", previous_response_id=first.id,
                                     input=results, tools=R_TOOLS, tool_choice="none",
                                     max_output_tokens=8, temperature=0)  # fmt: skip
    # The same conversation written out as chat messages.
    conversation = [*ASK, {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": c.call_id, "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        *({"role": "tool", "tool_call_id": c.call_id, "content": '{"ok": 1}'} for c in calls)]  # fmt: skip
    text, prompt_tokens = _greedy(llm, conversation, 8, tools=TOOLS)
    assert second.usage.input_tokens == prompt_tokens
    assert second.output_text == text and second.previous_response_id == first.id
    # Stored: retrieved, then deleted; a deleted or unstored id is a 404.
    assert client.responses.retrieve(second.id).output_text == text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="tiny", previous_response_id=second.id, input="go on",
                                max_output_tokens=2)  # fmt: skip
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # Streamed answers are stored too.
    final, _ = _stream_response(client, model="tiny", input="x", max_output_tokens=3,
                                temperature=0)  # fmt: skip
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_the_store_is_bounded(server):
    client = _oai(server, "small")  # at most 2 stored responses
    ids = [client.responses.create(model="tiny", input=f"q{i}", max_output_tokens=1).id
           for i in range(3)]  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the least recently used went first
    assert client.responses.retrieve(ids[2]).id == ids[2]
    store = ResponseStore(max_entries=10, max_bytes=400, ttl_s=0.2)
    store.put({"id": "a", "x": "y" * 150}, [])
    store.put({"id": "b", "x": "y" * 150}, [])
    store.put({"id": "c", "x": "y" * 150}, [])  # over 400 bytes with a and b: a goes
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    store.put({"id": "huge", "x": "y" * 500}, [])  # larger than the store: not kept
    assert store.get("huge") is None and len(store) == 2
    time.sleep(0.3)
    assert store.get("b") is None  # expired


# ---- Anthropic Messages ------------------------------------------------------------------


def test_messages_text_equals_llm_chat_whole_and_streamed(server, llm):
    client = _claude(server)
    system = "Answer briefly."
    kw = dict(model="tiny", max_tokens=10, extra_body=GREEDY, system=system, messages=ASK)
    m = client.messages.create(**kw)
    text, prompt_tokens = _greedy(llm, [{"role": "system", "content": system}, *ASK], 10)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.stop_reason == "max_tokens" and m.role == "assistant" and m.id.startswith("msg_")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (prompt_tokens, 10)
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    # A stop sequence ends it with stop_reason stop_sequence and names the sequence.
    stop = text[3:6]
    m = client.messages.create(**{**kw, "stop_sequences": [stop]})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]
    # The conversation's last assistant turn is continued, not answered.
    prefill = [*ASK, {"role": "assistant", "content": "Sure"}]
    m = client.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, messages=prefill)
    cont, _ = _greedy(llm, prefill, 6, add_generation_prompt=False, continue_final_message=True)
    assert m.content[0].text == cont
    count = client.messages.count_tokens(model="tiny", system=system, messages=ASK)
    assert count.input_tokens == prompt_tokens


def test_messages_tool_use_and_thinking_streamed_or_not(server, llm):
    client = _claude(server, "qwen3")
    text = "<think>plan</think>" + FORMATS["hermes"][0]
    kw = dict(model="tiny", max_tokens=200, messages=ASK, tools=A_TOOLS,
              extra_body=_forced(text, thinking=True))  # fmt: skip
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert m.content[0].thinking == "plan" and m.content[1].text == "Let me check."
    assert [(b.name, b.input) for b in m.content[2:]] == CALLS
    assert m.stop_reason == "tool_use"
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()

    def same(blocks):  # a call's id is new in each answer
        return [b.model_dump(exclude={"id"}) for b in blocks]

    assert same(final.content) == same(m.content) and all(b.id for b in final.content[2:])
    assert final.stop_reason == "tool_use"
    # The tool results go back as a user turn of tool_result blocks.
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": b.id, "content": '{"ok": 1}'}
                   for b in m.content[2:]]}]  # fmt: skip
    answer = _claude(server, "plain").messages.create(
        model="tiny", max_tokens=8, extra_body=GREEDY, messages=history, tools=A_TOOLS,
        tool_choice={"type": "none"})  # fmt: skip
    conversation = [*ASK, {"role": "assistant", "content": "Let me check.",
                           "reasoning_content": "plan", "tool_calls": [
        {"id": b.id, "type": "function",
         "function": {"name": b.name, "arguments": json.dumps(b.input)}} for b in m.content[2:]]},
        *({"role": "tool", "tool_call_id": b.id, "content": '{"ok": 1}'} for b in m.content[2:])]  # fmt: skip
    text, prompt_tokens = _greedy(llm, conversation, 8, tools=TOOLS)
    assert answer.content[0].text == text and answer.usage.input_tokens == prompt_tokens
    # tool_choice any / tool force a call without a parser.
    forced = _claude(server, "plain").messages.create(
        model="tiny", max_tokens=60, extra_body=GREEDY, messages=ASK, tools=A_TOOLS,
        tool_choice={"type": "tool", "name": "get_time"})  # fmt: skip
    assert forced.stop_reason == "tool_use"
    ((block,),) = [[b for b in forced.content if b.type == "tool_use"]]
    assert block.name == "get_time" and set(block.input) == set(TIME["function"]["parameters"]
                                                               ["properties"])  # fmt: skip
    # output_config.format: the answer follows the schema.
    schema = {"enum": ["UTC", "CET"]}  # (the tiny model, greedy, fills any room with spaces)
    m = _claude(server, "plain").messages.create(
        model="tiny", max_tokens=60, messages=ASK, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    assert m.stop_reason == "end_turn", m.content
    assert json.loads(m.content[0].text) in ("UTC", "CET")


# ---- errors ------------------------------------------------------------------------------


def test_bad_requests_get_400s_in_each_apis_shape(server):
    claude, oai = _claude(server), _oai(server)
    url = f"{server}/plain/v1/messages"
    status, raw = _post(url, {"model": "tiny", "messages": ASK})  # no max_tokens
    assert status == 400, raw
    body = json.loads(raw)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    cases = [
        (dict(messages=ASK, tool_choice={"type": "sometimes"}), "tool_choice.type"),
        (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": [{"type": "video"}]}]), "messages[0].content[0]"),
        (dict(messages=ASK, tools=[{"type": "web_search_20250305", "name": "s"}]), "tools[0]"),
        (dict(messages=ASK, stop_sequences=["x"] * 300), "stop"),
    ]  # fmt: skip
    for kw, words in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="tiny", max_tokens=4, **kw)
        assert words in str(e.value), (kw, str(e.value))
        assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-x", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-x" in str(e.value)
    cases = [
        (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type"),
        (dict(input="x", tools=[{"type": "web_search"}]), "tools[0]"),
        (dict(input="x", background=True), "background"),
        (dict(input="x", text={"format": {"type": "yaml"}}), "text.format.type"),
        (dict(input="x", max_output_tokens=0), "max_output_tokens"),
        (dict(input="x " * 600, max_output_tokens=4), "prompt"),  # over the context
    ]
    for kw, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model="tiny", **kw)
        assert words in str(e.value), (kw, str(e.value))
    # The API key: as Anthropic's client sends it (x-api-key) or as a bearer token.
    with pytest.raises(anthropic.AuthenticationError) as e:
        _claude(server, "keyed", "wrong").messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    ok = _claude(server, "keyed", KEY).messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert ok.usage.output_tokens == 2
    keyed = openai.OpenAI(base_url=f"{server}/keyed/v1", api_key=KEY, max_retries=0)
    assert keyed.responses.create(model="tiny", input="x", max_output_tokens=2).usage
    # Nothing above harmed the engine.
    assert claude.messages.create(model="tiny", max_tokens=2, messages=ASK).usage.output_tokens == 2
