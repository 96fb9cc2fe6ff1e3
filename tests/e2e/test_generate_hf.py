"""Engine vs HF transformers greedy `generate` on tiny seeded checkpoints (fp32: token-identical)."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from tests.conftest import FAMILIES, gib_for_blocks, hf_greedy, make_prompts, with_eos

MAX_NEW = 24


def _greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams, every: int = 2):
    """Submit prompts a few at a time while earlier ones decode; return token ids in order."""
    engine = llm.llm_engine
    pending = list(enumerate(prompts))
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            for _ in range(min(3, len(pending))):
                i, p = pending.pop(0)
                engine.add_request(f"s{i}", {"prompt_token_ids": p}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [done[f"s{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_single_request_matches_hf(checkpoint_dir, family):
    d = checkpoint_dir(family)
    prompt = make_prompts(1, seed=1, low=20, high=21)[0]
    llm = LLM(model=d, compile=False, dtype="float32", kv_cache_gib=0.01, max_model_len=128)
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(d, [prompt], MAX_NEW)[0]
    assert out.outputs[0].finish_reason == "length"
    assert out.prompt_token_ids == prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_staggered_chunked_preempted_batch_matches_hf(checkpoint_dir, family):
    """10 prompts of different lengths, submitted while others decode; a 16-token budget forces
    chunked prefill and mixed steps; a 24-block cache forces preemption."""
    d = checkpoint_dir(family)
    prompts = make_prompts(10, seed=2, low=3, high=45)
    want = hf_greedy(d, prompts, MAX_NEW)
    llm = LLM(
        model=d,
        compile=False,
        dtype="float32",
        kv_cache_gib=gib_for_blocks(d, 24, 4),
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=80,
    )
    assert llm.llm_engine.block_manager.num_blocks == 24
    assert run_staggered(llm, prompts, _greedy()) == want
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0
    assert (
        llm.llm_engine.block_manager.num_free_blocks
        == llm.llm_engine.block_manager.num_usable_blocks
    )


def test_generate_batch_together_matches_hf(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    prompts = make_prompts(9, seed=3)
    llm = LLM(
        model=d,
        compile=False,
        dtype="float32",
        kv_cache_gib=0.01,
        max_model_len=128,
        max_num_batched_tokens=32,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(d, prompts, MAX_NEW)


def test_prefix_caching_reuses_blocks_and_keeps_outputs(checkpoint_dir):
    d = checkpoint_dir("tiny-qwen2")
    prefix = make_prompts(1, seed=4, low=37, high=38)[0]
    prompts = [prefix + tail for tail in ([7, 8], [9], [10, 11, 12], [13, 14])]
    want = hf_greedy(d, prompts, 12)
    llm = LLM(
        model=d, compile=False, dtype="float32", kv_cache_gib=0.01, block_size=8, max_model_len=128
    )
    first = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(12), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], _greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first] + rest] == want
    assert all(o.num_cached_tokens == 32 for o in rest)


def test_prefix_cache_hit_within_one_batch_is_correct(checkpoint_dir):
    """Requests admitted in the same step share blocks one of them is still filling."""
    d = checkpoint_dir("tiny-llama")
    prefix = make_prompts(1, seed=5, low=30, high=31)[0]
    prompts = [prefix + [i + 3] for i in range(4)]
    llm = LLM(
        model=d, compile=False, dtype="float32", kv_cache_gib=0.01, block_size=4, max_model_len=128
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(d, prompts, 8)
    assert [o.num_cached_tokens for o in outs] == [0, 28, 28, 28]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_generate_bf16_tokens_within_hf_top5(checkpoint_dir, compiled):
    """dtype="bfloat16": bf16 activations where the CPU has native bf16 math (ember_cpu::
    bf16_linear, oneDNN), else bf16 weights with fp32 math; eager and compiled."""
    from transformers import AutoModelForCausalLM

    d = checkpoint_dir("tiny-llama", dtype=torch.bfloat16)
    prompts = make_prompts(4, seed=6)
    llm = LLM(
        model=d,
        compile=compiled,
        dtype="bfloat16",
        kv_cache_gib=0.01,
        max_model_len=128,
        max_num_batched_tokens=64,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            gen = o.outputs[0].token_ids
            logits = hf(torch.tensor([p + gen])).logits[0, len(p) - 1 : -1].float()
            top5 = logits.topk(5, dim=-1).indices
            for pos, t in enumerate(gen):
                assert t in top5[pos].tolist(), f"token {pos} not in HF bf16 top-5"


def test_generate_text_prompt_stop_and_logprobs(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    llm = LLM(model=d, compile=False, dtype="float32", kv_cache_gib=0.01, max_model_len=128)
    base = llm.generate("Hello, world", _greedy(16, logprobs=2), use_tqdm=False)[0]
    c = base.outputs[0]
    assert len(c.logprobs) == 16 and all(len(e) >= 2 for e in c.logprobs)
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids))
    )
    tok = llm.get_tokenizer()
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # Stop token id: generation ends at that token, which is kept in token_ids.
    stop_tok = c.token_ids[5]
    first = c.token_ids.index(stop_tok)
    out = llm.generate("Hello, world", _greedy(16, stop_token_ids=[stop_tok]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == c.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # Stop string: text trimmed before it, as vLLM does.
    stop = c.text[len(c.text) // 2 : len(c.text) // 2 + 3]
    if stop.strip():
        out = llm.generate("Hello, world", _greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == c.text[: c.text.index(stop)]


def test_generate_eos_stops_unless_ignored(checkpoint_dir, tmp_path):
    d = checkpoint_dir("tiny-llama")
    prompt = make_prompts(1, seed=7)[0]
    llm = LLM(model=d, compile=False, dtype="float32", kv_cache_gib=0.01, max_model_len=128)
    free = llm.generate({"prompt_token_ids": prompt}, _greedy(16), use_tqdm=False)[0].outputs[0]
    eos = free.token_ids[3]  # declare a token the model emits as its EOS
    llm = LLM(
        model=with_eos(d, eos, str(tmp_path / "eos")),
        compile=False,
        dtype="float32",
        kv_cache_gib=0.01,
        max_model_len=128,
    )
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    # The config's EOS is not the tokenizer's: it stops as a stop token does (vLLM's rule).
    assert out.finish_reason == "stop" and out.stop_reason == eos
    ignored = llm.generate({"prompt_token_ids": prompt}, _greedy(16), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == free.token_ids


def test_generate_parallel_samples_share_prompt_and_seed_is_batch_independent(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    llm = LLM(
        model=d, compile=False, dtype="float32", kv_cache_gib=0.01, block_size=4, max_model_len=128
    )
    prompt = make_prompts(1, seed=8, low=20, high=21)[0]
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, top_k=50, seed=123)
    alone = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(alone.outputs) == 3 and [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1
    others = [{"prompt_token_ids": p} for p in make_prompts(5, seed=9)]
    mixed = llm.generate(
        others + [{"prompt_token_ids": prompt}],
        [SamplingParams(max_tokens=7, temperature=0.7)] * 5 + [params],
        use_tqdm=False,
    )
    assert [c.token_ids for c in mixed[-1].outputs] == [c.token_ids for c in alone.outputs]
    # Siblings after the first reuse the prompt's full blocks.
    assert (
        llm.llm_engine.block_manager.num_free_blocks
        == llm.llm_engine.block_manager.num_usable_blocks
    )


def test_generate_outputs_in_input_order_with_per_request_params(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    llm = LLM(model=d, compile=False, dtype="float32", kv_cache_gib=0.01, max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(4, seed=10)]
    outs = llm.generate(prompts, [_greedy(n) for n in (3, 9, 1, 5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 1, 5]
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
