"""Per-layer attention geometry: Gemma 4 gives its global-attention layers their own head_dim
(here 32 vs 16 on sliding-window layers). Each layer gets a KV cache of its own shape, and
greedy output equals HF `generate` (fp32, token-identical)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma4 import configuration_gemma4 as gemma4

from ember import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_gemma4(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tiny-gemma4"))
    torch.manual_seed(0)
    config = gemma4.Gemma4TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
        max_position_embeddings=256,
        initializer_range=0.1,
        architectures=["Gemma4ForCausalLM"],
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(d)
    return d


def test_gemma4_per_layer_head_dim_matches_hf(tiny_gemma4):
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma4).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 30)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        want.append(out[0, len(p) :].tolist())
    llm = LLM(
        model=tiny_gemma4,
        compile=False,
        dtype="float32",
        kv_cache_gib=0.01,
        block_size=4,
        max_num_batched_tokens=16,
    )
    assert [c.shape[-1] for c in llm.llm_engine.runner.kv_caches] == [16, 32, 16, 32]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == want
