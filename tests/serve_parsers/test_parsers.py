"""Tool-call and reasoning parsers (`ember.serve.tool_parsers`, `ember.serve.reasoning_parsers`):
whole outputs against hand-written expectations (vLLM's behaviour for each format), and the
streaming contract, checked for every text over many splits (whole, character by character,
every single cut, token-like pieces, seeded random pieces): the streamed content concatenates to
`extract`'s content, and each call arrives once, id and name on its first delta, its arguments
pieces concatenating to `extract`'s arguments."""

from __future__ import annotations

import json
import random
import re

import pytest

from ember.serve import reasoning_parsers as rp
from ember.serve import tool_parsers as tp

WEATHER = ("get_weather", {"city": "Paris"})
WEATHER_UNIT = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"timezone": "Europe/Paris"})
TRANSLATE = ("translate", {"text": "Grüße aus Zürich", "target": "日本語"})
SEARCH = (
    "search",
    {
        "query": "hotels",
        "filters": {
            "price": {"min": 50, "max": 200},
            "amenities": ["wifi", "pool"],
            "rating": None,
        },
    },
)


def hermes(call: tuple[str, dict]) -> str:
    body = json.dumps({"name": call[0], "arguments": call[1]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


HERMES = [
    (hermes(WEATHER_UNIT), None, [WEATHER_UNIT]),
    (hermes(WEATHER) + "\n" + hermes(TIME), None, [WEATHER, TIME]),
    (
        "I'll check the current weather in Paris for you.\n" + hermes(WEATHER),
        "I'll check the current weather in Paris for you.",
        [WEATHER],
    ),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("  Paris.\n", "  Paris.\n", []),
    ("", None, []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        [],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
        [],
    ),
    (hermes(TRANSLATE), None, [TRANSLATE]),
    (
        '<tool_call>\n{"name": "translate", "arguments": {"text": "caf\\u00e9"}}\n</tool_call>',
        None,
        [("translate", {"text": "café"})],
    ),
    (hermes(SEARCH), None, [SEARCH]),
    (
        "Let me look that up.\n"
        + hermes(WEATHER)
        + "\nAnd the time:\n"
        + hermes(TIME)
        + "\nOne moment.",
        "Let me look that up.\nAnd the time:\nOne moment.",
        [WEATHER, TIME],
    ),
    (
        hermes(WEATHER) + '\n<tool_call>\n{"name": "get_time", "arguments": }\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": }\n</tool_call>',
        [WEATHER],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        None,
        [WEATHER],
    ),
    (
        'Checking. <tool_call>\n{"name": "get_weather", "argu',
        'Checking. <tool_call>\n{"name": "get_weather", "argu',
        [],
    ),
    ("Wrap each call in <tool_call> tags.", "Wrap each call in <tool_call> tags.", []),
]


def llama(call: tuple[str, dict], key: str = "parameters") -> str:
    return json.dumps({"name": call[0], key: call[1]}, ensure_ascii=False)


LLAMA3 = [
    (llama(WEATHER_UNIT), None, [WEATHER_UNIT]),
    ("<|python_tag|>" + llama(WEATHER), None, [WEATHER]),
    (llama(WEATHER) + "; " + llama(TIME), None, [WEATHER, TIME]),
    (llama(WEATHER, "arguments"), None, [WEATHER]),
    (" \n" + llama(TIME) + "\n", None, [TIME]),
    ("Sure! " + llama(WEATHER), "Sure! " + llama(WEATHER), []),
    ("Paris is the capital of France.", "Paris is the capital of France.", []),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        [],
    ),
    (
        '{"name": "get_weather", "parameters": {"city": Paris}}',
        '{"name": "get_weather", "parameters": {"city": Paris}}',
        [],
    ),
    ('{"answer": 42}', '{"answer": 42}', []),
    (llama(TRANSLATE), None, [TRANSLATE]),
    (llama(SEARCH), None, [SEARCH]),
    (llama(WEATHER) + "\n\nLet me know.", "Let me know.", [WEATHER]),
    (
        llama(WEATHER) + '; {"name": "get_time", "parameters": {',
        '; {"name": "get_time", "parameters": {',
        [WEATHER],
    ),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
]


def mistral_array(*calls: tuple[str, dict]) -> str:
    items = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return json.dumps(items, ensure_ascii=False)


def mistral_args(call: tuple[str, dict], args_token: str = "[ARGS]") -> str:
    return f"[TOOL_CALLS]{call[0]}{args_token}{json.dumps(call[1], ensure_ascii=False)}"


MISTRAL = [
    ("[TOOL_CALLS]" + mistral_array(WEATHER_UNIT), None, [WEATHER_UNIT]),
    ("[TOOL_CALLS] " + mistral_array(WEATHER, TIME), None, [WEATHER, TIME]),
    (
        "Let me check the weather.[TOOL_CALLS]" + mistral_array(WEATHER),
        "Let me check the weather.",
        [WEATHER],
    ),
    (mistral_args(WEATHER), None, [WEATHER]),
    (mistral_args(WEATHER) + mistral_args(TIME), None, [WEATHER, TIME]),
    (mistral_args(WEATHER, ""), None, [WEATHER]),
    ("The weather in Paris is sunny [1].", "The weather in Paris is sunny [1].", []),
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',
        [],
    ),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
        [],
    ),
    ("[TOOL_CALLS] I cannot call tools.", "[TOOL_CALLS] I cannot call tools.", []),
    ("[TOOL_CALLS]" + mistral_array(TRANSLATE, SEARCH), None, [TRANSLATE, SEARCH]),
    (mistral_args(SEARCH), None, [SEARCH]),
]

PYTHONIC = [
    ('[get_weather(city="Paris", unit="celsius")]', None, [WEATHER_UNIT]),
    ('[get_weather(city="Paris"), get_time(timezone="Europe/Paris")]', None, [WEATHER, TIME]),
    ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [WEATHER]),
    ('I will check: [get_weather(city="Paris")]', 'I will check: [get_weather(city="Paris")]', []),
    ("Paris is lovely in spring.", "Paris is lovely in spring.", []),
    ("[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    ('[get_weather(city="Paris"]', '[get_weather(city="Paris"]', []),
    ("[get_weather(city=paris)]", "[get_weather(city=paris)]", []),
    ('[get_weather("Paris")]', '[get_weather("Paris")]', []),
    (
        '[set_alarm(hour=7, minute=-5, volume=0.8, repeat=True, label=None, days=["mon", "tue"],'
        ' extra={"snooze": {"minutes": 9}})]',
        None,
        [
            (
                "set_alarm",
                {
                    "hour": 7,
                    "minute": -5,
                    "volume": 0.8,
                    "repeat": True,
                    "label": None,
                    "days": ["mon", "tue"],
                    "extra": {"snooze": {"minutes": 9}},
                },
            )
        ],
    ),
    ("[translate(text=\"Grüße aus Zürich\", target='日本語')]", None, [TRANSLATE]),
    ("[get_time()]", None, [("get_time", {})]),
    (
        "[search(query=\"a ] b) [c\", note='it\\'s')]",
        None,
        [("search", {"query": "a ] b) [c", "note": "it's"})],
    ),
    ('[get_weather(city="Paris")]\nOne moment.', "One moment.", [WEATHER]),
    (" \n[get_time()]", None, [("get_time", {})]),
]

CASES = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "pythonic": PYTHONIC}
ALL_CASES = [(name, case) for name, cases in CASES.items() for case in cases]
CASE_IDS = [f"{name}-{i}" for name, cases in CASES.items() for i in range(len(cases))]

MARKERS = re.compile(
    r"<tool_call>|</tool_call>|\[TOOL_CALLS\]|\[ARGS\]|<\|python_tag\|>|<\|python_start\|>"
    r"|<\|python_end\|>|<think>|</think>"
)
WORDS = re.compile(r" ?[^\W\d_]+| ?\d+| ?[^\w\s]+|\s+|_")


def token_pieces(text: str) -> list[str]:
    """Pieces like a BPE detokenizer's: markers whole, words with their leading space, runs of
    punctuation, at most 4 characters a piece."""
    pieces = []
    pos = 0
    for marker in [*MARKERS.finditer(text), None]:
        stop = marker.start() if marker else len(text)
        for word in WORDS.findall(text[pos:stop]):
            pieces += [word[i : i + 4] for i in range(0, len(word), 4)]
        if marker:
            pieces.append(marker.group())
            pos = marker.end()
    assert "".join(pieces) == text
    return pieces


def splits(text: str) -> list[list[str]]:
    """Whole, character by character, every single cut, token-like, and seeded random pieces."""
    out = [[text], list(text), token_pieces(text)]
    out += [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    rng = random.Random(len(text))
    for _ in range(12):
        pieces, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, 9)
            pieces.append(text[pos : pos + size])
            pos += size
        out.append(pieces)
    return out


def run_stream(parser: tp.ToolParser, pieces: list[str]):
    """(content, [(id, name, arguments)]) of a stream fed `pieces`, checking the delta shape."""
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    calls: dict[int, list] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index in calls:
                assert call.id is None and call.name is None
                calls[call.index][2] += call.arguments
            else:
                assert call.id and call.name
                calls[call.index] = [call.id, call.name, call.arguments]
    assert sorted(calls) == list(range(len(calls)))
    return "".join(delta.content for delta in deltas), [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name, case", ALL_CASES, ids=CASE_IDS)
def test_extract(name, case):
    text, content, calls = case
    got_content, got_calls = tp.get_tool_parser(name)().extract(text)
    assert got_content == content
    assert [(call.name, json.loads(call.arguments)) for call in got_calls] == calls
    for call in got_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    if not calls:
        assert got_content == (text or None)


@pytest.mark.parametrize("name, case", ALL_CASES, ids=CASE_IDS)
def test_stream_matches_extract(name, case):
    text = case[0]
    parser = tp.get_tool_parser(name)()
    content, calls = parser.extract(text)
    expected = (content or "", [(call.name, call.arguments) for call in calls])
    for pieces in splits(text):
        got_content, got_calls = run_stream(parser, pieces)
        assert (got_content, [call[1:] for call in got_calls]) == expected, pieces
        assert len({call[0] for call in got_calls}) == len(got_calls)


def test_unicode_arguments_are_not_escaped():
    (call,) = tp.get_tool_parser("hermes")().extract(hermes(TRANSLATE))[1]
    assert call.arguments == '{"text": "Grüße aus Zürich", "target": "日本語"}'


def test_call_ids():
    for name, cases in CASES.items():
        parser = tp.get_tool_parser(name)()
        for text, _, expected in cases:
            ids = [call.id for call in parser.extract(text)[1]]
            ids += [call[0] for call in run_stream(parser, token_pieces(text))[1]]
            assert len(set(ids)) == 2 * len(expected)
            for call_id in ids:
                if name == "mistral":
                    assert len(call_id) == 9 and call_id.isalnum() and call_id.isascii()
                else:
                    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_text_is_released_at_once(name):
    """Content that cannot start a call comes out with the piece that completes it; only the
    trailing whitespace waits (it would be dropped before a call)."""
    text = "The capital of France is Paris, the largest city."
    stream = tp.get_tool_parser(name)().stream()
    emitted = ""
    for end in range(1, len(text) + 1):
        emitted += stream.feed(text[end - 1]).content
        assert emitted == text[:end].rstrip()
    assert stream.finish().content == ""


def test_hermes_holds_only_a_possible_marker():
    stream = tp.get_tool_parser("hermes")().stream()
    assert stream.feed("Hello wor").content == "Hello wor"
    assert stream.feed("ld <tool").content == "ld"
    assert stream.feed("s and more").content == " <tools and more"
    delta = stream.feed(" <tool_")
    assert delta.content == "" and delta.tool_calls == []
    delta = stream.feed('call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_')
    assert delta.content == "" and delta.tool_calls == []
    delta = stream.feed("call>")
    assert delta.content == ""
    assert [(c.index, c.name, c.arguments) for c in delta.tool_calls] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]
    assert stream.feed("\n").content == ""
    assert stream.feed("Done").content == "\nDone"
    assert stream.finish() == tp.StreamDelta()


def test_calls_are_emitted_when_complete():
    """Each call arrives with the character that completes it, before `finish`."""
    first, second = hermes(WEATHER), hermes(TIME)
    cases = {
        "hermes": (["Sure.\n", first, "\n", second], [2, 4]),
        "llama3_json": ([llama(WEATHER), "; ", llama(TIME)], [1, 3]),
        "mistral": ([mistral_args(WEATHER), mistral_args(TIME)], [1, 2]),
        "pythonic": (['[get_weather(city="Paris"), get_time(timezone="Europe/Paris")]'], [1, 1]),
    }
    cases["mistral-array"] = (["[TOOL_CALLS]" + mistral_array(WEATHER, TIME)], [1, 1])
    for name, (parts, closing_parts) in cases.items():
        text = "".join(parts)
        expected = [len("".join(parts[:count])) for count in closing_parts]
        stream = tp.get_tool_parser(name.split("-")[0])().stream()
        arrived = []
        for end in range(1, len(text) + 1):
            arrived += [end] * len(stream.feed(text[end - 1]).tool_calls)
        assert arrived == expected, name
        assert stream.finish().tool_calls == []


def test_unparseable_call_is_released_at_finish():
    text = 'Checking. <tool_call>\n{"name": "get_weather", "argu'
    stream = tp.get_tool_parser("hermes")().stream()
    assert stream.feed(text).content == "Checking."
    assert stream.finish().content == ' <tool_call>\n{"name": "get_weather", "argu'
    stream = tp.get_tool_parser("pythonic")().stream()
    assert stream.feed("[get_weather(city=").content == ""
    assert stream.finish().content == "[get_weather(city="
    stream = tp.get_tool_parser("pythonic")().stream()
    assert stream.feed("[1, 2").content == "[1, 2"


def test_special_tokens_flag():
    assert {name for name, cls in tp.TOOL_PARSERS.items() if cls.needs_special_tokens} >= {
        "llama3_json",
        "mistral",
    }
    assert not tp.get_tool_parser("hermes").needs_special_tokens
    assert not tp.get_tool_parser("pythonic").needs_special_tokens


def test_tool_registry():
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(tp.TOOL_PARSERS)
    with pytest.raises(ValueError) as info:
        tp.get_tool_parser("nope")
    for name in ["'nope'", "hermes", "llama3_json", "mistral", "pythonic"]:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="already registered"):
        tp.register_tool_parser(type("Other", (tp.ToolParser,), {"name": "hermes"}))


def test_new_tool_parser_is_one_class(monkeypatch):
    monkeypatch.setattr(tp, "TOOL_PARSERS", dict(tp.TOOL_PARSERS))

    @tp.register_tool_parser
    class AngleParser(tp.ToolParser):
        """`<<name {json}>>` calls."""

        name = "angle"

        def step(self, buf, mode, final):
            if not buf.startswith("<<"):
                start = buf.find("<<")
                if start < 0:
                    start = len(buf) - (0 if final else tp.held_prefix(buf, "<<"))
                return ([buf[:start]], start, mode) if start else None
            end = buf.find(">>")
            if end < 0:
                return ([buf], len(buf), mode) if final else None
            name, _, arguments = buf[2:end].partition(" ")
            return [self.make_call(name, json.loads(arguments)) or buf[: end + 2]], end + 2, mode

    parser = tp.get_tool_parser("angle")()
    text = 'Checking < 3 cities. <<get_weather {"city": "Paris"}>> <<get_time {}>> ok'
    content, calls = parser.extract(text)
    assert content == "Checking < 3 cities.\nok"
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    for pieces in splits(text):
        assert run_stream(parser, pieces)[0] == content


DEEPSEEK_R1 = [
    (
        "<think>\nThe user wants 2 + 2.\n</think>\n\nThe answer is 4.",
        "\nThe user wants 2 + 2.\n",
        "\n\nThe answer is 4.",
    ),
    ("The user wants 2 + 2.\n</think>\n\n4", "The user wants 2 + 2.\n", "\n\n4"),
    ("Still thinking about it", "Still thinking about it", None),
    ("<think>Still thinking", "Still thinking", None),
    ("<think>All done</think>", "All done", None),
    ("</think>Just the answer.", None, "Just the answer."),
    ("<think></think>Hi", None, "Hi"),
    ("\n<think>a</think>b</think>c<think>", "a", "b</think>c<think>"),
    ("x<think>y</think>z", "x<think>y", "z"),
    ("", None, None),
]

QWEN3 = [
    (
        "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
        "\nThe user greets me.\n",
        "\n\nHello! How can I help?",
    ),
    ("Hello! How can I help?", None, "Hello! How can I help?"),
    ("<think>\nCut short by max_tokens", "\nCut short by max_tokens", None),
    ("<think>\n\n</think>\n\nHi", "\n\n", "\n\nHi"),
    ("<think></think>Hi", None, "Hi"),
    ("reasoning</think>answer", None, "reasoning</think>answer"),
    ("  <think>a</think>b", "a", "b"),
    ("<thinking> is a tag", None, "<thinking> is a tag"),
    ("", None, None),
]

REASONING = [("deepseek_r1", case) for case in DEEPSEEK_R1] + [("qwen3", case) for case in QWEN3]


@pytest.mark.parametrize(
    "name, case", REASONING, ids=[f"{n}-{i}" for i, (n, _) in enumerate(REASONING)]
)
def test_reasoning_extract_and_stream(name, case):
    text, reasoning, content = case
    parser = rp.get_reasoning_parser(name)()
    assert parser.extract(text) == (reasoning, content)
    for pieces in splits(text):
        stream = parser.stream()
        outs = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert "".join(r for r, _ in outs) == (reasoning or ""), pieces
        assert "".join(c for _, c in outs) == (content or ""), pieces


def test_reasoning_stream_is_prompt():
    stream = rp.get_reasoning_parser("qwen3")().stream()
    assert not stream.in_reasoning
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>\nLet me") == ("\nLet me", "")
    assert stream.in_reasoning
    assert stream.feed(" see.</th") == (" see.", "")
    assert stream.feed("ink>\n\nHi") == ("", "\n\nHi")
    assert not stream.in_reasoning
    assert stream.feed(" there") == ("", " there")
    assert stream.finish() == ("", "")

    stream = rp.get_reasoning_parser("qwen3")().stream()
    assert stream.feed("Hello") == ("", "Hello")
    assert not stream.in_reasoning

    stream = rp.get_reasoning_parser("deepseek_r1")().stream()
    assert stream.in_reasoning
    assert stream.feed("Okay, so") == ("Okay, so", "")
    assert stream.feed(" 4.\n</") == (" 4.\n", "")
    assert stream.finish() == ("</", "")


def test_reasoning_registry(monkeypatch):
    assert {"deepseek_r1", "qwen3"} <= set(rp.REASONING_PARSERS)
    with pytest.raises(ValueError) as info:
        rp.get_reasoning_parser("nope")
    for name in ["'nope'", "deepseek_r1", "qwen3"]:
        assert name in str(info.value)

    monkeypatch.setattr(rp, "REASONING_PARSERS", dict(rp.REASONING_PARSERS))

    @rp.register_reasoning_parser
    class SeedParser(rp.ReasoningParser):
        """`<seed:think>...</seed:think>`."""

        name = "seed"
        start = "<seed:think>"
        end = "</seed:think>"
        implicit_start = False

    parser = rp.get_reasoning_parser("seed")()
    assert parser.extract("<seed:think>hmm</seed:think>ok") == ("hmm", "ok")
    assert parser.extract("ok") == (None, "ok")
