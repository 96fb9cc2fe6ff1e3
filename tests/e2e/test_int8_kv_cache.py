"""`kv_cache_dtype="int8"`: the KV cache holds each token's K/V head rows as int8 codes with a
float32 scale per token and head (`ember.attention.ops.quantize_kv_rows`), half of bfloat16's
bytes and a quarter of float32's, plus 4 bytes per row. Greedy decoding stays within HF fp32's
top 5 (mostly its argmax), the pool holds the blocks the bytes allow, and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from ember.tools.bench import teacher_forced_ranks
from tests.conftest import build_tiny_bart, hf_bart_greedy, make_prompts

pytestmark = pytest.mark.host_isa  # on this CPU and as an AVX2-only host: tests/host_isa.py


def _ranks_in_hf_fp32(model_dir: str, prompts: list[list[int]], outs: list[list[int]]) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [r for p, g in zip(prompts, outs, strict=True) for r in teacher_forced_ranks(hf, p, g)]


@pytest.mark.parametrize(
    ("dtype", "compiled"),
    [("float32", False), ("float32", True), ("bfloat16", False)],
    ids=["fp32-eager", "fp32-compiled", "bf16-eager"],
)
def test_an_int8_kv_cache_stays_within_hf_fp32s_top5(checkpoint_dir, dtype, compiled):
    """An int8 cache under float32 math (eager and compiled) and under bfloat16 weights (native
    bf16 math where the CPU has it): the caches are int8 rows of head_dim + 4, the pool holds
    4 * head_dim / (head_dim + 4) times the float32 blocks, prompts sharing a prefix hit the
    prefix cache, and greedy tokens stay within HF fp32's top 5, mostly its argmax."""
    weights = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    d = checkpoint_dir("tiny-llama", dtype=weights, initializer_range=0.3)
    shared = make_prompts(1, seed=11, low=40, high=41)[0]
    prompts = make_prompts(4, seed=7) + [shared + [5, 6], shared + [7, 8, 9]]
    kw = dict(dtype=dtype, kv_cache_gib=0.01, max_model_len=128, use_tqdm=False)
    with LLM(model=d, compile=False, kv_cache_dtype="float32" if dtype == "float32" else "auto",
             **kw) as llm:  # fmt: skip
        wide = llm.llm_engine.block_manager.num_blocks
        wide_bytes = {c.element_size() for c in llm.llm_engine.runner.kv_caches}.pop()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(model=d, compile=compiled, kv_cache_dtype="int8", **kw) as llm:
        assert llm.config.kv_dtype == torch.int8
        caches = llm.llm_engine.runner.kv_caches
        heads, head_dim = llm.llm_engine.runner.loaded.kv_layer_shapes[0]
        assert {c.dtype for c in caches} == {torch.int8}
        assert {c.shape[-2:] for c in caches} == {(heads, head_dim + 4)}
        pool = llm.llm_engine.block_manager
        want = wide * wide_bytes * head_dim / (head_dim + 4)
        assert abs(pool.num_blocks - want) <= 1 + want / 1000, (pool.num_blocks, want)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:-1]], params)
        # the last prompt's first 32 tokens are cached blocks of the one before it
        outs += llm.generate([{"prompt_token_ids": prompts[-1]}], params)
        assert outs[-1].num_cached_tokens >= 32
        assert pool.num_free_blocks == pool.num_blocks - 1
    ranks = _ranks_in_hf_fp32(d, prompts, [o.outputs[0].token_ids for o in outs])
    assert max(ranks) < 5 and sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


def test_an_int8_kv_cache_for_encoder_decoder_cross_attention(tmp_path):
    """BART: the decoder's self-attention K/V and the encoder's cross-attention K/V (written
    by `ember::write_kv_cache`, the Python writer) both in the int8 cache; greedy output equals
    HF fp32's on this random model."""
    bart = build_tiny_bart(str(tmp_path / "b"), 200)
    kw = dict(compile=False, kv_cache_gib=0.01, use_tqdm=False, kv_cache_dtype="int8")
    cases = [([5, 6, 7, 8, 9, 10], []), ([11, 3, 40, 41, 42, 7, 8, 9, 12], [])]
    with LLM(model=bart, **kw) as llm:
        assert {c.dtype for c in llm.llm_engine.runner.kv_caches} == {torch.int8}
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        prompts = [
            {"encoder_prompt": {"prompt_token_ids": e}, "decoder_prompt": ""} for e, _ in cases
        ]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == hf_bart_greedy(bart, cases, 8)


def test_kv_cache_dtype_int8_and_fp8_names(checkpoint_dir):
    """ "int8" resolves to an int8 cache; vLLM's fp8 names are a ValueError that names the
    field and points to int8; a backend without an int8 cache says so."""
    from ember.runtime.config import EngineArgs

    d = checkpoint_dir("tiny-llama")
    assert EngineArgs(model=d, kv_cache_dtype="int8").create_engine_config().kv_dtype == torch.int8
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8.*int8"):
            EngineArgs(model=d, kv_cache_dtype=name).create_engine_config()
    with pytest.raises(ValueError, match="int8 is not supported by attention backend 'triton'"):
        EngineArgs(
            model=d, kv_cache_dtype="int8", attention_backend="triton"
        ).create_engine_config()
