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


def test_stop_string_trimmed_and_found_across_tokens():
    text = "abc STOP def"
    assert find_stop_string(text, len(text), ["STOP"], False) == ("abc ", "STOP")
    assert find_stop_string(text, len(text), ["STOP"], True) == ("abc STOP", "STOP")
    # Only the newly added characters (plus overlap) are searched.
    assert find_stop_string("abc STOP def", 2, ["STOP"], False) is None
    assert find_stop_string("abc ST", 2, ["ST"], False) == ("abc ", "ST")
    assert find_stop_string("xyz", 0, ["x"], False) is None
