"""One request never takes `ember serve` down: bounded fields answer 400 before any work, every
malformed body gets a 4xx in OpenAI's error shape, the host memory budget refuses (503 with
Retry-After) what would grow the process past it, a fuzzed HTTP surface answers no 5xx and
leaks nothing, and SIGTERM drains then exits (a second one exits at once)."""

from __future__ import annotations

import collections
import http.client
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.e2e.servers import metrics, start_serve, stop_serve, with_chat_template

MAX_NUM_SEQS = 8
MAX_REQUEST_BYTES = 1 << 20
ARGS = ["--no-compile", "--kv-cache-gib", "0.02", "--max-model-len", "256", "--dtype", "float32",
        "--served-model-name", "tiny", "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-request-bytes", str(MAX_REQUEST_BYTES)]  # fmt: skip
# SmolLM2's (ChatML) way of joining a message: string concatenation, which a template of a real
# checkpoint does and a non-string content breaks (a TypeError inside Jinja).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("robust") / "m")
    return with_chat_template(checkpoint_dir("tiny-llama"), d, CHATML)


@pytest.fixture(scope="module")
def served(model_dir):
    proc, url = start_serve([model_dir, *ARGS])
    yield proc, url
    stop_serve(proc)


def _request(
    url: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    method: str = "POST",
    timeout: float = 120,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one HTTP request, the body read to its end (a stream too)."""
    host = url.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _post(url: str, path: str, body: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
    return _request(url, path, json.dumps(body).encode(), **kw)


def _assert_openai_error(status: int, body: bytes) -> dict[str, Any]:
    """The error body in OpenAI's shape, with the status as its code."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    return error


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _greedy(url: str) -> str:
    status, _, body = _post(url, "/v1/chat/completions",
                            {**CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert status == 200, body
    return json.loads(body)["choices"][0]["message"]["content"]


def _blocks_used(url: str) -> float:
    return metrics(url)["ember_kv_blocks_used"]


def _idle(url: str, timeout: float = 30) -> None:
    """Wait until no request holds a KV block (aborted streams are freed between steps)."""
    deadline = time.time() + timeout
    while _blocks_used(url) != 0:
        assert time.time() < deadline, "KV blocks still held with no request in flight"
        time.sleep(0.2)


def test_n_far_over_the_limit_is_a_400_at_once(served):
    """The request that grew the server until the OOM killer ended it: refused before any work,
    naming the field and the limit; the server's memory does not move."""
    proc, url = served
    before = _rss_mib(proc.pid)
    start = time.monotonic()
    status, _, body = _post(url, "/v1/chat/completions", {**CHAT, "n": 100000})
    assert status == 400 and time.monotonic() - start < 5
    error = _assert_openai_error(status, body)
    assert "n must be at most 8" in error["message"], error
    assert _rss_mib(proc.pid) < before + 50
    status, _, body = _post(url, "/v1/completions", {"model": "tiny", "prompt": "a", "n": 9})
    assert status == 400 and "n must be at most 8" in _assert_openai_error(status, body)["message"]
    status, _, _ = _post(url, "/v1/completions", {"model": "tiny", "prompt": "a", "n": 8,
                                                  "max_tokens": 2})  # fmt: skip
    assert status == 200


# (path, body or raw bytes, headers, status, words the message must hold)
MALFORMED = {
    "content_is_a_number": ("/v1/chat/completions",
                            {**CHAT, "messages": [{"role": "user", "content": 5}]}, None, 400,
                            "messages[0].content"),  # fmt: skip
    "content_part_without_type": ("/v1/chat/completions",
                                  {**CHAT, "messages": [{"role": "user", "content": [{"x": 1}]}]},
                                  None, 400, "messages[0].content[0]"),  # fmt: skip
    "role_is_a_list": ("/v1/chat/completions", {**CHAT, "messages": [{"role": [], "content": "x"}]},
                       None, 400, "messages[0].role"),  # fmt: skip
    "template_raises": ("/v1/chat/completions",
                        {**CHAT, "chat_template": "{{ raise_exception('no') }}"}, None, 400,
                        "chat template"),  # fmt: skip
    "template_is_broken": ("/v1/chat/completions", {**CHAT, "chat_template": "{% for %}"}, None,
                           400, "chat template"),  # fmt: skip
    "not_utf8": ("/v1/chat/completions", b'{"model": "tiny", "messages": "\xff\xfe"}', None, 400,
                 "parsing the body"),  # fmt: skip
    "not_json": ("/v1/completions", b"{prompt: hi", None, 422, "invalid request body"),
    "json_not_an_object": ("/v1/completions", b"[1, 2]", None, 422, "invalid request body"),
    "wrong_content_type": ("/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "text/plain"},
                           415, "application/json"),  # fmt: skip
    "oversized": ("/v1/completions", {"model": "tiny", "prompt": "x" * MAX_REQUEST_BYTES}, None,
                  413, str(MAX_REQUEST_BYTES)),  # fmt: skip
    "too_many_stop_strings": ("/v1/completions", {"prompt": "a", "stop": ["s"] * 257}, None, 400,
                              "stop must be at most 256"),  # fmt: skip
    "stop_string_too_long": ("/v1/completions", {"prompt": "a", "stop": ["s" * 1025]}, None, 400,
                             "stop[0] must be at most 1024"),  # fmt: skip
    "too_many_tools": ("/v1/chat/completions",
                       {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}] * 129},
                       None, 400, "tools must be at most 128"),  # fmt: skip
    "schema_too_big": ("/v1/completions",
                       {"prompt": "a", "guided_json": {"enum": ["x" * 1000] * 300}}, None, 400,
                       "guided_json must be at most"),  # fmt: skip
    "best_of_over_n": ("/v1/completions", {"prompt": "a", "n": 1, "best_of": 3}, None, 400,
                       "best_of"),  # fmt: skip
    "too_many_prompts": ("/v1/completions", {"prompt": ["a"] * 1025, "max_tokens": 1}, None, 400,
                         "prompt must be at most 1024"),  # fmt: skip
    "nan_temperature": ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', None, 400,
                        "temperature"),  # fmt: skip
    "unknown_route": ("/v1/nothing", {}, None, 404, "Not Found"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_body_gets_a_4xx_in_openais_shape(served, case):
    _, url = served
    path, body, headers, want, words = MALFORMED[case]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = _request(url, path, raw, headers)
    assert status == want, answer[:300]
    assert words in _assert_openai_error(status, answer)["message"]


def test_a_get_on_a_post_route_is_a_405_in_openais_shape(served):
    _, url = served
    status, _, body = _request(url, "/v1/completions", method="GET")
    assert status == 405
    _assert_openai_error(status, body)


# ---- the fuzzed surface --------------------------------------------------------------------

ROUTES = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": CHAT,
    "/v1/embeddings": {"model": "tiny", "input": "hi"},
    "/tokenize": {"model": "tiny", "prompt": "hi"},
    "/detokenize": {"model": "tiny", "tokens": [5, 6]},
}
_SAMPLING = ["model", "n", "best_of", "max_tokens", "temperature", "top_p", "top_k", "min_p",
             "stop", "seed", "stream", "stream_options", "logit_bias", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
             "stop_token_ids", "skip_special_tokens", "response_format", "structured_outputs",
             "guided_json", "guided_regex", "guided_choice", "guided_grammar", "unknown_field"]
# The fields each route's mutations pick from: its own, and (for generation) the sampling ones.
FIELDS = {
    "/v1/completions": ["prompt", "prompt", "prompt", "logprobs", "echo", *_SAMPLING],
    "/v1/chat/completions": ["messages", "messages", "messages.0.content", "messages.0.content",
                             "messages.0.content", "messages.0.content", "messages.0.role",
                             "messages.0.role", "tools", "tool_choice", "chat_template",
                             "chat_template_kwargs", "logprobs", "top_logprobs",
                             "max_completion_tokens", "add_generation_prompt",
                             "continue_final_message", *_SAMPLING],
    "/v1/embeddings": ["model", "input", "input", "encoding_format", "unknown_field"],
    "/tokenize": ["model", "prompt", "messages", "messages.0.content", "add_special_tokens",
                  "add_generation_prompt", "chat_template", "tools", "return_token_strs"],
    "/detokenize": ["model", "tokens", "tokens", "unknown_field"],
}  # fmt: skip

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, 2, 8, 9, 255, 256, 257, -1, 10**6, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["", "tiny", "\x00", "{{ x }}", "<|image|>", "json_object", "required"])
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),  # fmt: skip
    max_leaves=10,
)


def _mutate(body: dict[str, Any], edits: list[tuple[str, Any, bool]]) -> dict[str, Any]:
    """`body` with each (field, value, delete) edit: a dotted field into messages' first."""
    body = json.loads(json.dumps(body))
    for field, value, delete in edits:
        target, key = body, field
        if field.startswith("messages.0."):
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and isinstance(messages[0], dict)):
                continue
            target, key = messages[0], field.rsplit(".", 1)[1]
        if delete:
            target.pop(key, None)
        else:
            target[key] = value
    return body


# The generating routes, which reach furthest into the engine, twice as often.
_WEIGHTED_ROUTES = [*sorted(ROUTES), "/v1/chat/completions", "/v1/completions"]


@st.composite
def _mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A route's valid body with one or two of its fields set to any JSON value or removed
    (more would mostly fail the body's types, and reach no further than validation)."""
    route = draw(st.sampled_from(_WEIGHTED_ROUTES))
    edits = draw(st.lists(st.tuples(st.sampled_from(FIELDS[route]), _values, st.booleans()),
                          min_size=1, max_size=2))  # fmt: skip
    return route, json.dumps(_mutate(ROUTES[route], edits), allow_nan=True).encode()


_requests = st.one_of(
    _mutated(),
    _mutated(),
    _mutated(),
    _mutated(),
    st.tuples(st.sampled_from(sorted(ROUTES)), st.binary(max_size=64)),
    st.tuples(st.sampled_from(sorted(ROUTES)), _values.map(lambda v: json.dumps(v).encode())),
)


class _Tally:
    def __init__(self) -> None:
        self.statuses: collections.Counter[int] = collections.Counter()
        self.lock = threading.Lock()

    def add(self, status: int) -> None:
        with self.lock:
            self.statuses[status] += 1


def _check_answer(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status < 500, body[:500]
    if status >= 400:
        _assert_openai_error(status, body)
    elif headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in body.decode().split("\n\n") if line.strip()]
        assert events and events[-1] == "data: [DONE]", body[-300:]
        for event in events[:-1]:
            json.loads(event.removeprefix("data: "))
    else:
        json.loads(body)


def _fuzz(url: str, max_examples: int) -> collections.Counter[int]:
    tally = _Tally()

    # No shrinking: each example is HTTP requests to a live server, and the failing one is
    # printed as it is.
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.lists(_requests, min_size=1, max_size=4))
    def run(batch: list[tuple[str, bytes]]) -> None:
        with ThreadPoolExecutor(len(batch)) as pool:  # concurrently, as clients would
            answers = list(pool.map(lambda r: _request(url, r[0], r[1]), batch))
        for status, headers, body in answers:
            tally.add(status)
            _check_answer(status, headers, body)

    run()
    return tally.statuses


def _fuzz_and_check(served: tuple[Any, str], max_examples: int) -> None:
    proc, url = served
    want = _greedy(url)
    before = _rss_mib(proc.pid)
    statuses = _fuzz(url, max_examples)
    print(f"fuzz: {sum(statuses.values())} requests, status codes {dict(sorted(statuses.items()))}")
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0
    status, _, _ = _request(url, "/health", method="GET")
    assert status == 200
    assert _greedy(url) == want
    _idle(url)
    assert _rss_mib(proc.pid) < before + 400


def test_a_fuzzed_surface_answers_no_5xx_and_leaks_nothing(served):
    _fuzz_and_check(served, max_examples=200)


@pytest.mark.slow
def test_a_longer_fuzz_answers_no_5xx_and_leaks_nothing(served):
    _fuzz_and_check(served, max_examples=2000)


# ---- memory budget under a flood ------------------------------------------------------------


def test_a_flood_under_the_limits_is_answered_or_refused_within_the_budget(served, model_dir):
    """64 clients, each sending requests just under every limit (n = max_num_seqs, the whole
    context of tokens, the most logprobs): each is answered or refused with 503 and
    Retry-After; the server stays within its budget (set to its idle size plus 96 MiB); a
    plain request of another client completes meanwhile."""
    idle = _rss_mib(served[0].pid)
    total_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    budget_mib = idle + 96
    proc, url = start_serve([model_dir, *ARGS, "--host-memory-fraction",
                             f"{budget_mib / total_mib:.6f}"])  # fmt: skip
    try:
        heavy = {**CHAT, "n": MAX_NUM_SEQS, "max_tokens": 200, "logprobs": True,
                 "top_logprobs": 20, "ignore_eos": True}  # fmt: skip
        tally = _Tally()
        peak = [0.0]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_mib(proc.pid))
                time.sleep(0.05)

        def client(i: int) -> None:
            for _ in range(2):
                status, headers, body = _post(url, "/v1/chat/completions", heavy, timeout=300)
                tally.add(status)
                assert status in (200, 503), body[:300]
                if status == 503:
                    assert headers.get("retry-after") == "1"
                    assert "memory budget" in _assert_openai_error(status, body)["message"]

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(64) as pool:
            flood = [pool.submit(client, i) for i in range(64)]
            for _ in range(20):  # another client's plain request, retried on 503
                status, _, _ = _post(url, "/v1/completions",
                                     {"model": "tiny", "prompt": "hi", "max_tokens": 4})  # fmt: skip
                if status == 200:
                    break
                time.sleep(0.5)
            assert status == 200
            for f in flood:
                f.result()
        stop.set()
        watcher.join()
        statuses = tally.statuses
        print(f"flood: {dict(statuses)}, peak RSS {peak[0]:.0f} MiB, budget {budget_mib:.0f} MiB")
        assert statuses[200] > 0 and statuses[503] > 0
        assert peak[0] < budget_mib
        _idle(url)
    finally:
        stop_serve(proc)


# ---- shutdown -------------------------------------------------------------------------------


def _stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, list[Any]]:
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(_post(url, "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                      "max_tokens": max_tokens, "stream": True,
                                                      "ignore_eos": True}))  # fmt: skip
        except (OSError, http.client.HTTPException) as e:
            got.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def test_sigterm_stops_admitting_finishes_in_flight_and_exits(model_dir):
    proc, url = start_serve([model_dir, *ARGS, "--shutdown-timeout", "60"])
    try:
        thread, got = _stream_in_background(url, 200)
        time.sleep(1.0)  # the stream is running
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # a new client: refused (the socket is closed) or told 503
            status, _, body = _post(url, "/v1/completions", {"prompt": "a"}, timeout=5)
            assert status == 503, body
        except (ConnectionError, OSError):
            pass
        thread.join(60)
        status, _, body = got[0]
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")  # finished, not cut
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_sigterm_exits_at_once(model_dir):
    proc, url = start_serve([model_dir, *ARGS, "--shutdown-timeout", "600"])
    try:
        thread, _ = _stream_in_background(url, 250)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        assert time.monotonic() - start < 20
        thread.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
