"""Incremental detokenization and stop-string trimming (vLLM semantics)."""

from __future__ import annotations

from ember.runtime.outputs import IncrementalDetokenizer, find_stop_string
from ember.tools.checkpoints import build_tokenizer


def test_incremental_detokenizer_equals_full_decode():
    tok = build_tokenizer(400)
    text = "Hello, world! The quick brown fox — naïve café 日本語 jumps."
    ids = tok(text)["input_ids"]
    prompt, output = ids[:3], ids[3:]
    detok = IncrementalDetokenizer(tok, prompt)
    for t in output:
        detok.append(t)
    detok.flush()
    assert detok.text == tok.decode(output)


def test_the_decode_stream_emits_what_the_python_window_does():
    """A fast tokenizer's DecodeStream (one Rust call a token) against the Python window, on
    real text and on random ids (special tokens, bytes cut mid-character), with and without
    skipping special tokens; and a stream that fails mid-request hands over to the window."""
    import random

    tok = build_tokenizer(400)
    rng = random.Random(0)
    ids = tok("Hello, wörld — naïve café 日本語 🙂 jumps. Hello again.")["input_ids"]
    cases = [(ids[:4], ids[4:])]
    cases += [
        ([rng.randrange(len(tok)) for _ in range(rng.randrange(1, 9))],
         [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))])
        for _ in range(150)
    ]  # fmt: skip
    streamed = 0
    for prompt, output in cases:
        for skip in (True, False):
            fast = IncrementalDetokenizer(tok, prompt, skip)
            slow = IncrementalDetokenizer(tok, prompt, skip)
            slow._stream = None
            streamed += fast._stream is not None
            for t in output:
                assert fast.append(t) == slow.append(t)
                assert fast.text == slow.text
            fast.flush()
            slow.flush()
            assert fast.text == slow.text
    assert IncrementalDetokenizer(tok, ids[:4])._stream is not None
    assert streamed > len(cases) // 2

    class Failing:
        def __init__(self, stream, after):
            self.stream, self.after = stream, after

        def step(self, backend, token_id):
            self.after -= 1
            if self.after < 0:
                raise Exception("Invalid prefix encountered")
            return self.stream.step(backend, token_id)

    detok = IncrementalDetokenizer(tok, ids[:4])
    stream, backend = detok._stream
    detok._stream = (Failing(stream, 5), backend)
    for t in ids[4:]:
        detok.append(t)
    detok.flush()
    assert detok._stream is None and detok.text == tok.decode(ids[4:])


def test_stop_string_trimmed_and_found_across_tokens():
    text = "abc STOP def"
    assert find_stop_string(text, len(text), ["STOP"], False) == ("abc ", "STOP")
    assert find_stop_string(text, len(text), ["STOP"], True) == ("abc STOP", "STOP")
    # Only the newly added characters (plus overlap) are searched.
    assert find_stop_string("abc STOP def", 2, ["STOP"], False) is None
    assert find_stop_string("abc ST", 2, ["ST"], False) == ("abc ", "ST")
    assert find_stop_string("xyz", 0, ["x"], False) is None
