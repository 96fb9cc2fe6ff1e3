"""Structured outputs (xgrammar) on a random tiny model: the grammar, not the model, makes every
output that finishes with "stop" valid (JSON parsed and checked against its schema with
jsonschema, regexes fully matched, choices exact), in batches that mix constrained and plain
requests, sampled and greedy, with n > 1, chunked prefill and preemption, eager and compiled."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import xgrammar  # noqa: F401  (the structured outputs backend)
from torch._dynamo.utils import counters

from ember import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from tests.conftest import gib_for_blocks, make_prompts

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]},
                   "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["a", "b"],
    "additionalProperties": False,
}  # fmt: skip
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe not"]
GRAMMAR = 'root ::= "(" [a-c]+ ")"'

KINDS = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
             lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    "grammar": (StructuredOutputsParams(grammar=GRAMMAR), lambda t: re.fullmatch(r"\([a-c]+\)", t)),
    "json_object": (StructuredOutputsParams(json_object=True), lambda t: json.loads(t) is not None),
}  # fmt: skip


def _llm(d: str, **kw) -> LLM:
    kw = {"compile": False, "dtype": "float32", "kv_cache_gib": 0.02, "max_model_len": 256} | kw
    return LLM(model=d, **kw)


def _check(outs, valid) -> int:
    """Every output that stopped is valid; returns how many stopped."""
    stopped = 0
    for out in outs:
        assert out.error is None, out.error
        for c in out.outputs:
            if c.finish_reason == "stop":
                assert valid(c.text), c.text
                stopped += 1
            else:
                assert c.finish_reason == "length"
    return stopped


@pytest.mark.parametrize("kind", list(KINDS))
def test_structured_outputs_that_stop_are_valid_in_mixed_batches(checkpoint_dir, kind):
    d = checkpoint_dir("tiny-llama")
    llm = _llm(d)
    so, valid = KINDS[kind]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(8, seed=21, low=3, high=30)]
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = llm.generate(prompts[:2], plain, use_tqdm=False)
    params = [plain, plain] + [
        SamplingParams(max_tokens=60, temperature=t, seed=i, structured_outputs=so)
        for i, t in enumerate([0.0, 0.7, 1.0, 1.3, 1.0, 0.0])
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # The plain requests in the batch are untouched by the others' masks.
    assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in alone]
    assert _check(outs[2:], valid) >= 3
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_structured_outputs_with_n_chunked_prefill_and_preemption(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    llm = _llm(d, kv_cache_gib=gib_for_blocks(d, 24, 4), block_size=4, max_num_batched_tokens=16,
               max_model_len=80)  # fmt: skip
    so, valid = KINDS["regex"]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(6, seed=22, low=20, high=40)]
    params = SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=5, structured_outputs=so)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    assert _check(outs, valid) == 12  # the regex is bounded: every sequence completes
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_structured_outputs_compiled_without_recompiles(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    llm = _llm(d, compile=True)
    compiled = llm.llm_engine.runner.graphs_compiled
    graphs = counters["stats"]["unique_graphs"]
    so, valid = KINDS["json"]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(4, seed=23)]
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=1, structured_outputs=so)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _check(outs, valid) >= 1
    assert llm.llm_engine.runner.graphs_compiled == compiled  # warm-up compiled every graph
    assert counters["stats"]["unique_graphs"] == graphs


def test_guided_decoding_is_the_same_and_bad_specs_are_value_errors(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    llm = _llm(d)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    a = llm.generate(
        prompt,
        SamplingParams(
            max_tokens=8,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(choice=CHOICES),
        ),
        use_tqdm=False,
    )
    b = llm.generate(
        prompt,
        SamplingParams(
            max_tokens=8, temperature=0.0, guided_decoding=GuidedDecodingParams(choice=CHOICES)
        ),
        use_tqdm=False,
    )
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].outputs[0].text in CHOICES  # fmt: skip
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=GuidedDecodingParams(regex="b"))  # fmt: skip
    for bad, field in [({"json": '{"type": "nope"}'}, "json"), ({"regex": "(["}, "regex"),
                       ({"grammar": "root ::= ("}, "grammar")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
            llm.generate(prompt, SamplingParams(structured_outputs=StructuredOutputsParams(**bad)))
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


@pytest.mark.parametrize("vocab", [1, 31, 32, 1000, 50257])
def test_bitmask_kernel_matches_xgrammar_and_the_torch_path(vocab, monkeypatch):
    """`ember_cpu::apply_token_bitmask` against xgrammar's own CPU function and ember's PyTorch
    fallback, at vocabulary sizes that are and are not multiples of 32; opcheck."""
    import torch
    import xgrammar as xgr

    from ember import kernels
    from ember.runtime import structured
    from tests.kernels import require_kernels

    require_kernels()  # skips only where no compiler exists; a failed build fails
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int32)
    bitmask[1] = 0  # nothing allowed
    bitmask[2] = -1  # everything allowed
    logits = torch.randn(3, vocab, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    got = logits.clone()
    torch.ops.ember_cpu.apply_token_bitmask(got, bitmask)
    assert torch.equal(got, want)
    monkeypatch.setattr(kernels, "loaded_isa", lambda: None)
    fallback = logits.clone()
    structured.apply_bitmask(fallback, bitmask)
    assert torch.equal(fallback, want)
    torch.library.opcheck(torch.ops.ember_cpu.apply_token_bitmask.default, (logits, bitmask))


def test_a_choice_that_stops_on_another_eos_id_leaves_its_text_out(checkpoint_dir, tmp_path):
    """A model whose generation config has an EOS id besides the tokenizer's (a plain token
    here, "@", that no choice contains): the choice ends on it, and as in vLLM its text is not
    part of the output, which is exactly one of the choices."""
    import shutil

    from transformers import AutoTokenizer

    d = str(tmp_path / "m")
    shutil.copytree(checkpoint_dir("tiny-llama"), d)
    other = AutoTokenizer.from_pretrained(d).convert_tokens_to_ids("@")
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, other]}, f)
    llm = _llm(d)
    so = StructuredOutputsParams(choice=CHOICES)
    params = [
        SamplingParams(max_tokens=20, temperature=t, seed=i, structured_outputs=so,
                       logit_bias={other: 30.0})
        for i, t in enumerate([0.0, 1.0, 1.0, 1.0])
    ]  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in make_prompts(4, seed=5, low=3, high=20)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == other and c.token_ids[-1] == other
        assert c.text in CHOICES, c.text


def test_a_grammar_that_starts_after_the_reasoning(checkpoint_dir):
    """`start_after` (set by `ember serve --reasoning-parser`): the output is free until it
    holds the reasoning's end, then the grammar holds. A logits processor makes the tiny
    model write `<think>...</think>` first; without start_after the grammar would forbid it."""
    from transformers import AutoTokenizer

    d = checkpoint_dir("tiny-llama")
    forced = AutoTokenizer.from_pretrained(d).encode("<think>hmm</think>", add_special_tokens=False)

    def think_first(output_ids, row):
        if len(output_ids) < len(forced):
            keep = row[forced[len(output_ids)]].clone()
            row.fill_(float("-inf"))
            row[forced[len(output_ids)]] = keep
        return row

    llm = _llm(d)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, seed=7, low=3, high=20)]
    after = StructuredOutputsParams(choice=CHOICES, start_after="</think>")
    params = [SamplingParams(max_tokens=40, temperature=t, seed=i, structured_outputs=after,
                             logits_processors=[think_first])
              for i, t in enumerate([0.0, 1.0, 1.0])]  # fmt: skip
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        assert out.error is None and c.finish_reason == "stop", (out.error, c.text)
        assert c.text.startswith("<think>hmm</think>") and c.text[18:] in CHOICES, c.text
    # Without it, the grammar holds from the first token: the forced reasoning is refused.
    plain = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        logits_processors=[think_first],
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    out = llm.generate(prompts[0], plain, use_tqdm=False)[0]
    assert not out.outputs[0].text.startswith("<think>")
