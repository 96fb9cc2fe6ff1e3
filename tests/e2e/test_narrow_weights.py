"""Narrow weights by default: `dtype="auto"` keeps a bf16 checkpoint's linear weights in bf16.
Where the CPU lacks native bf16 math (an AVX2-only host, and every test's `[avx2-host]` run:
tests/host_isa.py), the math is fp32 and the kernels widen the weights, so greedy output is
token-identical to HF transformers running the same (bf16-valued) weights in fp32."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams, kernels
from ember.host.isa import cpu_has_native_bf16
from ember.tools.bench import teacher_forced_ranks
from tests.conftest import build_tiny_bart, build_tiny_bert, hf_bart_greedy, hf_greedy, make_prompts
from tests.host_isa import needs_fp32_math

pytestmark = pytest.mark.host_isa  # on this CPU and as an AVX2-only host: tests/host_isa.py


def _linear_weight_dtypes(llm: LLM) -> set[torch.dtype]:
    model = llm.llm_engine.runner.model
    return {m.weight.dtype for m in model.modules() if hasattr(m, "in_features")}


def test_auto_keeps_a_bf16_checkpoint_narrow(checkpoint_dir):
    d = checkpoint_dir("tiny-llama", dtype=torch.bfloat16)
    with LLM(model=d, compile=False, kv_cache_gib=0.01, max_model_len=128) as llm:
        assert llm.config.weight_dtype == torch.bfloat16
        native = cpu_has_native_bf16()
        assert llm.config.dtype == (torch.bfloat16 if native else torch.float32)
        assert _linear_weight_dtypes(llm) == {torch.bfloat16}
    fp32 = checkpoint_dir("tiny-llama")
    with LLM(model=fp32, compile=False, kv_cache_gib=0.01, max_model_len=128) as llm:
        assert (llm.config.weight_dtype, llm.config.dtype) == (torch.float32, torch.float32)


def _ranks_in_hf_fp32(model_dir: str, prompts: list[list[int]], outs: list[list[int]]) -> list[int]:
    """`teacher_forced_ranks` of every generated token in HF fp32 (0 = HF's own argmax)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [r for p, g in zip(prompts, outs, strict=True) for r in teacher_forced_ranks(hf, p, g)]


def test_bf16_weights_fp32_math_match_hf_fp32_compiled(checkpoint_dir):
    """Without native bf16 math: a float32 cache is token-identical to HF in fp32 (compiled);
    the default cache (bf16, as narrow as the weights) stays within HF fp32's top 5, mostly
    its argmax."""
    needs_fp32_math()
    d = checkpoint_dir("tiny-llama", dtype=torch.bfloat16, initializer_range=0.3)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(4, seed=3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for kv_cache_dtype, compiled in (("float32", True), ("auto", False)):
        kw = dict(kv_cache_gib=0.01, max_model_len=128, use_tqdm=False, compile=compiled)
        with LLM(model=d, kv_cache_dtype=kv_cache_dtype, **kw) as llm:
            assert (llm.config.dtype, llm.config.weight_dtype) == (torch.float32, torch.bfloat16)
            assert _linear_weight_dtypes(llm) == {torch.bfloat16}
            kv = {c.dtype for c in llm.llm_engine.runner.kv_caches}
            assert kv == {torch.float32 if kv_cache_dtype == "float32" else torch.bfloat16}
            outs = llm.generate(prompts, params)
            got[kv_cache_dtype] = [o.outputs[0].token_ids for o in outs]
    ids = [p["prompt_token_ids"] for p in prompts]
    assert got["float32"] == hf_greedy(d, ids, 12, dtype=torch.float32)
    ranks = _ranks_in_hf_fp32(d, ids, got["auto"])
    assert max(ranks) < 5 and sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_bf16_kv_cache_under_fp32_math(checkpoint_dir, compiled):
    """kv_cache_dtype="bfloat16" with dtype="float32", on any CPU: the cache is bf16 and holds
    twice the blocks in the same GiB; greedy tokens stay within HF fp32's top 5 (mostly its
    argmax), and no block leaks."""
    d = checkpoint_dir("tiny-llama", initializer_range=0.3)
    prompts = make_prompts(4, seed=7)
    kw = dict(dtype="float32", kv_cache_gib=0.01, max_model_len=128, use_tqdm=False)
    with LLM(model=d, compile=False, **kw) as llm:
        fp32_blocks = llm.llm_engine.block_manager.num_blocks
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(model=d, compile=compiled, kv_cache_dtype="bfloat16", **kw) as llm:
        assert (llm.config.dtype, llm.config.kv_dtype) == (torch.float32, torch.bfloat16)
        assert {c.dtype for c in llm.llm_engine.runner.kv_caches} == {torch.bfloat16}
        pool = llm.llm_engine.block_manager
        assert pool.num_blocks // 2 == fp32_blocks  # twice, but for the rounding
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert pool.num_free_blocks == pool.num_blocks - 1
    ranks = _ranks_in_hf_fp32(d, prompts, [o.outputs[0].token_ids for o in outs])
    assert max(ranks) < 5 and sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


def test_encoder_decoder_and_encoder_with_bf16_weights_fp32_math(tmp_path):
    """BART (learned positions, a bias on the logits) and BERT (position and token-type
    embeddings, LayerNorms) stored in bf16: the non-linear parameters are widened, the linears
    read bf16, and the results equal HF's in fp32 on the same weights."""
    from transformers import BertModel

    needs_fp32_math()
    bart = build_tiny_bart(str(tmp_path / "b"), 200, torch.bfloat16)
    bert = build_tiny_bert(str(tmp_path / "e"), torch.bfloat16)
    kw = dict(compile=False, kv_cache_gib=0.01, use_tqdm=False)
    got = {}
    with LLM(model=bart, kv_cache_dtype="float32", **kw) as llm:
        assert (llm.config.dtype, llm.config.weight_dtype) == (torch.float32, torch.bfloat16)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        prompt = {"encoder_prompt": {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, "decoder_prompt": ""}
        got["bart"] = llm.generate([prompt], params)[0].outputs[0].token_ids
    with LLM(model=bert, **kw) as llm:
        got["bert"] = llm.embed([{"prompt_token_ids": [2, 5, 6, 7, 8, 3]}])[0].outputs.embedding
    assert got["bart"] == hf_bart_greedy(bart, [([5, 6, 7, 8, 9, 10], [])], 8)[0]
    with torch.no_grad():
        bert = BertModel.from_pretrained(bert, dtype=torch.float32).eval()
        hidden = bert(input_ids=torch.tensor([[2, 5, 6, 7, 8, 3]])).last_hidden_state[0]
    ref = torch.nn.functional.normalize(hidden.mean(0), dim=-1)
    torch.testing.assert_close(torch.tensor(got["bert"]), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "compiled"),
    [("float32", False), ("float32", True), ("bfloat16", False)],
    ids=["fp32-eager", "fp32-compiled", "bf16-eager"],
)
def test_a_tied_head_is_packed_once_and_the_lookup_reads_it(checkpoint_dir, dtype, compiled):
    """A head tied to a plain embedding is packed like every linear; the embedding gathers its
    rows from the head's packed tensor, so the table is held once. fp32: token-identical to HF
    fp32; bf16 weights: within HF bf16's top 5."""
    from transformers import AutoModelForCausalLM

    from ember.host.isa import cpu_has_amx
    from ember.model.layers.packed import GemvLinear, PackedEmbedding, PackedLinear

    ckpt_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    d = checkpoint_dir("tiny-qwen2", dtype=ckpt_dtype, tie_word_embeddings=True)
    prompts = make_prompts(3, seed=4)
    kw = dict(compile=compiled, dtype=dtype, kv_cache_gib=0.01, max_model_len=128)
    with LLM(model=d, max_num_batched_tokens=64, use_tqdm=False, **kw) as llm:
        model = llm.llm_engine.runner.model
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        # bf16 on AMX CPUs: a GemvLinear head over the embedding's own weight (oneDNN's AMX
        # GEMM needs the [vocab, d] layout), still one table.
        packed = llm.config.dtype == torch.float32 or (kernels.bf16_pairs() and not cpu_has_amx())
        if packed:
            assert isinstance(embed, PackedEmbedding) and isinstance(head, PackedLinear)
            assert embed.packed is head.packed  # one table
            assert not any(isinstance(m, torch.nn.Embedding) for m in model.modules())
        else:
            assert isinstance(head, GemvLinear) and head.weight is embed.weight
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.outputs[0].token_ids for o in outs]
    if dtype == "float32":
        assert got == hf_greedy(d, prompts, 8)
        return
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    with torch.inference_mode():
        for p, gen in zip(prompts, got, strict=True):
            logits = hf(torch.tensor([p + gen])).logits[0, len(p) - 1 : -1].float()
            top5 = logits.topk(5, dim=-1).indices
            assert all(t in top5[i].tolist() for i, t in enumerate(gen))


@pytest.mark.parametrize("weights", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_head_tied_to_a_scaled_table_is_packed_and_the_lookup_scales_rows(weights):
    """Gemma 3's table is a scaled embedding (rows times sqrt(hidden)) tied to the head: the
    head is packed and the lookup gathers and scales its rows, as for a plain table. fp16 (a
    GGUF F16 file's table) had no path at all: the head became a `GemvLinear`, which has no
    fp16 kernel, and the load failed. Logits against HF running the same (fp16-valued)
    weights in fp32."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from ember.model.layers.packed import PackedEmbedding, PackedLinear
    from ember.model.layers.rewrite import use_kernel_linears_
    from ember.model.loader import _widen_all_but_linear_weights

    if not kernels.available():
        pytest.skip("ember's C++ kernels cannot be built here")
    config = Gemma3TextConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    reference = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(weights).float())
    model = Gemma3ForCausalLM(config).eval().to(weights)
    model.load_state_dict(reference.state_dict())
    use_kernel_linears_(model, torch.float32)
    _widen_all_but_linear_weights(model, torch.float32)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embed, PackedEmbedding) and isinstance(head, PackedLinear)
    assert embed.packed is head.packed and head.packed.dtype == weights
    assert embed.scale == pytest.approx(64**0.5)
    ids = torch.tensor([[2, 17, 301, 42, 499, 7, 7, 123]])
    with torch.inference_mode():
        want, got = reference(ids).logits, model(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
