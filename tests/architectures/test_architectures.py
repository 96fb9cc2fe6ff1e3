"""Every architecture in transformers' causal-LM mapping is exact or refused.

For each model_type: ember either decodes token-identically to HF `generate` (fp32, greedy,
tiny random weights, eager; two prompts in one batch, the longer one past the sliding window
and split into chunks by a token budget smaller than it), or refuses the checkpoint at load
with `UnsupportedModelError` naming what it lacks. `ember.model.architectures` holds the
verdicts; this file holds it to them, so an architecture can only join `EXACT` by passing
here, and a transformers upgrade that adds one fails `test_the_table_covers_the_mapping`
until it is given a verdict.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ember import LLM, SamplingParams
from ember.errors import UnsupportedModelError
from ember.model import architectures
from ember.model.spec import read_model_spec
from tests.architectures import zoo
from tests.conftest import hf_greedy

MAX_NEW = 6
PROMPT_LENGTHS = (5, 19)  # the longer one: past the window (8) and over two chunks of 16
BUDGET = 16
# Checked by a test of its own (images through cross-attention, tests/e2e/test_mllama.py).
CHECKED_ELSEWHERE = {"mllama"}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, zoo.VOCAB - 6, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


EXACT = sorted(architectures.EXACT & set(zoo.causal_model_types()) - CHECKED_ELSEWHERE)
NOT_EXACT = sorted(set(zoo.causal_model_types()) - architectures.EXACT)


@pytest.mark.parametrize("model_type", EXACT)
def test_an_exact_architecture_decodes_what_hf_does(model_type, tmp_path):
    path = zoo.build(model_type, str(tmp_path / model_type))
    prompts = _prompts()
    want = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(
        model=path,
        compile=False,
        dtype="float32",
        kv_cache_gib=0.005,
        max_model_len=64,
        max_num_batched_tokens=BUDGET,
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    blocks = llm.llm_engine.block_manager
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def _config_only(model_type: str, path: str) -> str:
    """A checkpoint directory holding only `model_type`'s config (tiny where it shrinks,
    else the default): refusal happens before any weight is read."""
    os.makedirs(path, exist_ok=True)
    try:
        config = zoo.tiny_config(model_type)
    except Exception:  # noqa: BLE001  (a config that does not shrink generically)
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001
            config = None
    if config is None:
        raw = {"model_type": model_type, "architectures": [_causal_class(model_type)]}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f)
        return path
    config.architectures = [_causal_class(model_type)]
    config.save_pretrained(path)
    return path


def _causal_class(model_type: str) -> str:
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


@pytest.mark.parametrize("model_type", NOT_EXACT)
def test_every_other_architecture_is_refused_at_load_naming_why(model_type, tmp_path):
    path = _config_only(model_type, str(tmp_path / model_type))
    with pytest.raises(UnsupportedModelError) as refused:
        read_model_spec(path)
    why = str(refused.value)
    if model_type in architectures.REFUSED:
        assert architectures.REFUSED[model_type] in why
    assert len(why) > 40, why


def test_the_table_covers_the_mapping():
    """Every model_type of the installed transformers has a verdict: exact (checked above), a
    reason of ember's own, or a refusal by `model_task` (attention outside transformers'
    interface, encoder-decoder heads) or as not checked. The two tables never overlap."""
    assert not architectures.EXACT & set(architectures.REFUSED)
    unknown = set(architectures.EXACT) - set(zoo.causal_model_types())
    # names from another transformers release in the supported range are allowed to be
    # absent here, never misspelled: each is a model_type transformers knows
    assert all(m in CONFIG_MAPPING for m in unknown - CHECKED_ELSEWHERE), unknown


def test_a_recurrent_layer_kind_is_refused_even_for_a_checked_model_type():
    """A checkpoint of a checked model_type whose config declares linear-attention or sparse
    layers (a future variant) is refused by its layer kinds, not served as full attention."""
    config = zoo.tiny_config("qwen3")
    config.layer_types = ["full_attention", "linear_attention", "full_attention", "conv"]
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        architectures.check_architecture(config)
    config.layer_types = ["full_attention", "indexed_attention"] * 2
    with pytest.raises(UnsupportedModelError, match="indexed or compressed sparse"):
        architectures.check_architecture(config)


def test_an_unchecked_model_type_loads_only_when_the_user_opts_in(monkeypatch, caplog):
    config = zoo.tiny_config("llama")
    monkeypatch.setattr(architectures, "EXACT", frozenset())
    monkeypatch.delenv(architectures.UNVERIFIED_ENV, raising=False)
    with pytest.raises(UnsupportedModelError, match=architectures.UNVERIFIED_ENV):
        architectures.check_architecture(config)
    monkeypatch.setenv(architectures.UNVERIFIED_ENV, "1")
    architectures.check_architecture(config)  # loads, with a warning
    assert "has not been checked against HF" in caplog.text
    # a known refusal stays one under the opt-in
    with pytest.raises(UnsupportedModelError, match="recurrent state"):
        architectures.check_architecture(zoo.tiny_config("qwen3_next"))


@pytest.mark.parametrize(
    "model_type",
    [
        "persimmon",  # fused QKV, partial rotary: a transposed query
        # sinks on SWA layers only, K/V heads per layer, MoE. Under -m slow: once it compiled
        # in a process, a later engine's background-compiled whole graph failed to load there
        # ("Missing required external references: ['torch']"), not yet explained
        pytest.param("mimo_v2_flash", marks=pytest.mark.slow),
        pytest.param("gpt_oss", marks=pytest.mark.slow),  # sinks, MoE with biases, clamps
    ],
)
def test_compiled_graphs_decode_what_hf_does(model_type, tmp_path):
    """A compiled representative: chunked prefill beside decodes, no recompile after warm-up.
    (Before the attention ops' shape functions gave a contiguous output, these three decoded
    other tokens compiled than eager.)"""
    path = zoo.build(model_type, str(tmp_path / model_type))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, zoo.VOCAB - 6, (n,), generator=g).tolist() for n in (5, 19, 30, 3)]
    want = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(
        model=path, dtype="float32", kv_cache_gib=0.005, block_size=4, max_model_len=64,
        max_num_batched_tokens=BUDGET,
    )  # fmt: skip
    assert llm.llm_engine.config.compile
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    blocks = llm.llm_engine.block_manager
    assert blocks.num_free_blocks == blocks.num_usable_blocks
