"""The async engine in-process, and `ember serve` in a subprocess on a free port driven by the
official `openai` client: outputs equal offline `LLM.generate` / `LLM.chat` (greedy), streaming
equals non-streaming, bad requests get OpenAI-style errors and leave the server healthy."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import time
import urllib.error
import urllib.request

import fastapi  # noqa: F401  (a dev dependency: missing, this file fails rather than skips)
import openai
import pytest
from transformers import AutoTokenizer

from ember import LLM, LoRARequest, SamplingParams
from ember.runtime.engine import LLMEngine
from tests.conftest import make_prompts
from tests.e2e.servers import CHAT_TEMPLATE, metrics, start_serve, stop_serve, with_chat_template

ENGINE = {"compile": False, "dtype": "float32", "kv_cache_gib": 0.02, "max_model_len": 256,
          "enable_lora": True, "max_lora_rank": 8}  # fmt: skip
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("serve") / "m")
    return with_chat_template(checkpoint_dir("tiny-llama"), d, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory):
    from tests.lora.test_lora_e2e import make_adapter

    path = str(tmp_path_factory.mktemp("adapter") / "sql")
    return LoRARequest("sql", 1, make_adapter(model_dir, path, 1, 8, ["q_proj", "v_proj"]))


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model=model_dir, **ENGINE)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(model_dir, adapter):
    """`ember serve MODEL` with the key from EMBER_API_KEY (never on the command line) and an
    adapter served as the model "sql"."""
    args = [model_dir, "--no-compile", "--kv-cache-gib", "0.02", "--max-model-len", "256",
            "--dtype", "float32", "--served-model-name", "tiny", "--enable-lora",
            "--max-lora-rank", "8", "--lora-modules", f"sql={adapter.lora_path}"]  # fmt: skip
    proc, url = start_serve(args, dict(os.environ, EMBER_API_KEY=KEY))
    yield url
    stop_serve(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def _greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_completions_equal_offline_generate(client, offline):
    prompts = ["Hello world", "The quick brown fox", "Once upon"]
    want = offline.generate(prompts, _greedy(), use_tqdm=False)
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    ids = make_prompts(1, seed=3)[0]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    want = offline.generate({"prompt_token_ids": ids}, _greedy(), use_tqdm=False)
    assert r.choices[0].text == want[0].outputs[0].text


def test_chat_equals_offline_chat_and_streams_the_same(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = offline.chat(messages, _greedy(), use_tqdm=False)[0].outputs[0].text
    kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_follows_vllms_rule_streamed_or_not(client, offline, include):
    """A completion that stops on a stop_token_ids entry: the token's text is left out unless
    include_stop_str_in_output, in the whole response and in the joined stream, as offline."""
    prompt = "The quick brown fox"
    free = offline.generate(prompt, _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    n = free.index(stop) + 1
    cut = offline.generate(prompt, _greedy(n - 1 + include), use_tqdm=False)[0].outputs[0].text
    want = offline.generate(prompt, _greedy(stop_token_ids=[stop], include_stop_str_in_output=include),
                            use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert want.token_ids[-1] == stop and want.text == cut
    body = {"ignore_eos": True, "stop_token_ids": [stop], "include_stop_str_in_output": include}
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=body)
    r = client.completions.create(**kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == n
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut


def test_streamed_completions_with_n_equal_the_whole_response(client):
    kw = dict(model="tiny", prompt="Hello there", max_tokens=10, temperature=1.0, seed=7, n=2)
    whole = client.completions.create(**kw)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]


def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="x", logit_bias={"999999": 1.0})
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt=list(range(5, 300)), max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.UnprocessableEntityError):
        client.post("/completions", body={"model": "tiny"}, cast_to=object)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    req = urllib.request.Request(server + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == 401
    with urllib.request.urlopen(server + "/health") as r:  # no key needed
        assert r.status == 200
    assert [m.id for m in client.models.list()] == ["tiny", "sql"]
    r = client.completions.create(model="tiny", prompt="still fine", max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_async_engine_concurrent_requests_and_abort_free_blocks(model_dir, offline):
    """Coroutines submit concurrently; each stream equals its offline output; a consumer that
    stops early aborts its request and the engine's blocks all come back."""
    from ember.serve.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(LLMEngine.from_config(offline.config, show_progress=False))
    prompts = make_prompts(6, seed=31)
    want = [
        o.outputs[0].token_ids
        for o in offline.generate(
            [{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False
        )  # fmt: skip
    ]

    async def run_one(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(f"r{i}", {"prompt_token_ids": prompts[i]}, _greedy()):
            tokens += out.outputs[0].token_ids
        return tokens

    async def abort_early() -> None:
        stream = engine.generate("gone", {"prompt_token_ids": prompts[0]}, _greedy(200))
        async for _ in stream:
            break
        await stream.aclose()

    async def main() -> list[list[int]]:
        results = await asyncio.gather(*(run_one(i) for i in range(6)), abort_early())
        with pytest.raises(ValueError, match="prompt"):
            async for _ in engine.generate("bad", {"prompt_token_ids": []}, _greedy()):
                pass
        return results[:6]

    try:
        assert asyncio.run(main()) == want
        deadline = time.time() + 10
        while engine.engine.has_unfinished_requests() and time.time() < deadline:
            time.sleep(0.05)
        bm = engine.engine.block_manager
        assert not engine.engine.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_usable_blocks
    finally:
        engine.shutdown()


def test_64_concurrent_streams_with_disconnects(server, offline):
    """64 streaming clients at once, every fourth hanging up after its first chunk: each
    completed stream equals its offline greedy output, /health answers throughout, and once
    they are done /metrics shows no request running and no KV block in use."""
    prompts = make_prompts(64, seed=41, low=3, high=40)
    want = offline.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16),
                            use_tqdm=False)  # fmt: skip
    health: list[int] = []

    async def one(i: int) -> str | None:
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        hang_up = i % 4 == 3  # these ask for 200 tokens and leave after the first chunk
        stream = await client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=200 if hang_up else 16, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text = ""
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            if hang_up:
                await stream.close()
                return None
        await client.close()
        return text

    async def poll(done: asyncio.Event) -> None:
        while not done.is_set():
            status = await asyncio.to_thread(
                lambda: urllib.request.urlopen(server + "/health").status
            )
            health.append(status)
            await asyncio.sleep(0.1)

    async def main() -> list[str | None]:
        done = asyncio.Event()
        poller = asyncio.create_task(poll(done))
        results = await asyncio.gather(*(one(i) for i in range(64)))
        done.set()
        await poller
        return results

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if text is not None:
            assert text == want[i].outputs[0].text, i
    assert sum(r is not None for r in results) == 48
    assert health and set(health) == {200}
    deadline = time.time() + 15
    while time.time() < deadline:
        m = metrics(server, KEY)
        if m["ember_kv_blocks_used"] == 0 and m["ember_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert m["ember_kv_blocks_used"] == 0 and m["ember_num_requests_running"] == 0
    assert m["ember_num_requests_waiting"] == 0
    assert m["ember_time_to_first_token_seconds_count"] >= 64
    assert m["ember_generation_tokens_total"] >= 48 * 16
    assert m["ember_requests_aborted_total"] >= 8  # hung up mid-generation: aborted, not run out


def test_lora_modules_are_models_of_their_own(client, offline, adapter):
    prompts = make_prompts(3, seed=51)
    want = offline.generate([{"prompt_token_ids": p} for p in prompts], _greedy(),
                            lora_request=adapter, use_tqdm=False)  # fmt: skip
    base = offline.generate([{"prompt_token_ids": p} for p in prompts], _greedy(),
                            use_tqdm=False)  # fmt: skip
    for p, w, b in zip(prompts, want, base, strict=True):
        kw = dict(prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(model="sql", **kw).choices[0].text == w.outputs[0].text
        assert client.completions.create(model="tiny", **kw).choices[0].text == b.outputs[0].text
    assert [w.outputs[0].token_ids for w in want] != [b.outputs[0].token_ids for b in base]


def test_embeddings_equal_offline_embed(client, offline):
    texts = ["A man is eating food.", "A man is eating bread.", "The sky is blue."]
    want = [o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)]
    r = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, w in zip(r.data, want, strict=True):
        assert d.embedding == pytest.approx(w, abs=1e-6)
    assert r.usage.prompt_tokens > 0
    b64 = client.embeddings.create(model="tiny", input=texts[0], encoding_format="base64")
    raw = base64.b64decode(b64.data[0].embedding)  # little-endian float32, as OpenAI sends it
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(want[0], abs=1e-6)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.embeddings.create(model="tiny", input=[[]])


def test_serving_benchmark_runs_against_the_server(server, model_dir):
    """The benchmark reports what the server served: its requests, prompt and output tokens
    by the server's own metrics; client-side TTFTs no shorter in all than the server's
    arrival-to-first-token times (the server's clock starts later and stops sooner), each
    request's end after its first token, the run's duration within the call; the summary
    prints those figures."""
    import random
    import statistics

    from ember.tools.serve_bench import make_prompt, run_serve_bench

    before = metrics(server, KEY)
    start = time.perf_counter()
    r = run_serve_bench(server, "tiny", request_rate=20.0, num_prompts=6, input_words=20,
                        output_len=8, api_key=KEY)  # fmt: skip
    wall = time.perf_counter() - start
    after = metrics(server, KEY)

    def served(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert r.errors == 0 and r.num_requests == 6 and r.output_tokens == 6 * 8
    assert served("ember_generation_tokens_total") == r.output_tokens
    assert served('ember_requests_finished_total{finish_reason="length"}') == 6
    assert served("ember_time_to_first_token_seconds_count") == 6
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)  # the benchmark's seed: its prompts, as the server tokenizes them
    prompts = [make_prompt(rng, 20) for _ in range(6)]
    assert served("ember_prompt_tokens_total") == sum(len(tok(p)["input_ids"]) for p in prompts)
    assert len(r.ttft_ms) == len(r.tpot_ms) == len(r.e2e_ms) == 6
    assert sum(r.ttft_ms) / 1e3 >= served("ember_time_to_first_token_seconds_sum") > 0
    assert all(e > t > 0 for e, t in zip(r.e2e_ms, r.ttft_ms, strict=True))
    assert all(0 < t < e for t, e in zip(r.tpot_ms, r.e2e_ms, strict=True))
    assert max(r.e2e_ms) / 1e3 <= r.duration_s <= wall
    head, ttft, tpot, e2e = r.summary().splitlines()
    assert head == (f"6 requests in {r.duration_s:.1f} s, 0 errors; "
                    f"output {48 / r.duration_s:.1f} tok/s")  # fmt: skip
    for line, name, xs in ((ttft, "TTFT ms", r.ttft_ms), (tpot, "TPOT ms", r.tpot_ms),
                           (e2e, "E2E  ms", r.e2e_ms)):  # fmt: skip
        assert line.strip().startswith(name + " p50 ")
        p50 = float(line.split("p50 ")[1].split()[0])
        assert p50 == pytest.approx(statistics.median(xs), abs=0.051)


def _post(server: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server + path, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_as_vllm(server, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    status, r = _post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200
    assert r["tokens"] == tok("Hello world")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    status, chat = _post(server, "/tokenize", {"messages": messages})
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    status, back = _post(server, "/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and back["prompt"] == tok.decode(r["tokens"])
    assert _post(server, "/detokenize", {"tokens": [10**9]})[0] == 400
    assert _post(server, "/tokenize", {})[0] == 400
    assert _post(server, "/tokenize", {"prompt": "x", "model": "nope"})[0] == 404


def test_completion_logprobs_and_echo_equal_offline(client, offline):
    prompt = "The quick brown fox"
    want = offline.generate(prompt, _greedy(logprobs=2, prompt_logprobs=2), use_tqdm=False)[0]
    got = want.outputs[0]
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})  # fmt: skip
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == got.text
    sampled = [next(iter(e.values())) for e in got.logprobs]
    assert lp.token_logprobs == pytest.approx([s.logprob for s in sampled], abs=1e-4)
    assert all(len(t) <= 3 for t in lp.top_logprobs)  # the sampled token and the top 2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]  # fmt: skip
    assert streamed == lp.tokens
    # echo: the prompt leads the text and, with logprobs, its tokens lead the logprobs (the
    # first has none), their values the offline prompt_logprobs.
    r = client.completions.create(**kw, echo=True)
    assert r.choices[0].text == prompt + got.text
    elp = r.choices[0].logprobs
    n = len(want.prompt_token_ids)
    assert elp.token_logprobs[0] is None and elp.tokens[n:] == lp.tokens
    prompt_want = [e[t].logprob for t, e in zip(want.prompt_token_ids[1:],
                                                want.prompt_logprobs[1:], strict=True)]  # fmt: skip
    assert elp.token_logprobs[1:n] == pytest.approx(prompt_want, abs=1e-4)
    chunks = list(client.completions.create(**{**kw, "logprobs": None}, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + got.text


def test_chat_logprobs_equal_offline_streamed_or_not(client, offline):
    messages = [{"role": "user", "content": "hi"}]
    got = offline.chat(messages, _greedy(logprobs=3), use_tqdm=False)[0].outputs[0]
    kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True,
              top_logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content == got.text
    assert [c.logprob for c in content] == pytest.approx(
        [next(iter(e.values())).logprob for e in got.logprobs], abs=1e-4
    )
    for c in content:
        assert len(c.top_logprobs) == 3 and bytes(c.bytes).decode() == c.token
        ranked = [t.logprob for t in c.top_logprobs]
        assert ranked == sorted(ranked, reverse=True) and c.logprob <= ranked[0] + 1e-6
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]  # fmt: skip
    assert streamed == [c.token for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny", messages=messages, top_logprobs=2)


def test_chat_without_max_tokens_runs_to_the_context_end(client):
    """As vLLM: a chat request with no max_tokens is bounded by the context only (a
    completion's default stays OpenAI's 16)."""
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 256
    r = client.completions.create(model="tiny", prompt="hi", temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == 16
