"""Weight-only int8 (`dtype="int8"`): the op against a dequantised reference, and end-to-end
greedy decoding that stays within the top-5 of fp32 HF transformers at every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ember import LLM, EngineArgs, SamplingParams
from ember.model.layers.packed import Int8Linear
from ember.model.layers.rewrite import quantize_int8_
from ember.tools import bench
from tests.conftest import make_prompts

pytestmark = pytest.mark.host_isa  # on this CPU and as an AVX2-only host: tests/host_isa.py


def _naive_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8, written out: (int8 weight, fp32 scales)."""
    scales = weight.detach().abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(weight.detach() / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _integer_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """numpy: x [M, K] quantized per group of 32 as the kernels do it in fp32 (x * (127 /
    max|x|), rounded half to even; scale max|x| / 127), each group's exact int64 dot with the
    codes [N, K], scaled in float64 by the group's x scale and the channel's weight scale."""
    xs = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xs).max(axis=-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(xs * inv).astype(np.int64)
    dx = (amax / np.float32(127)).astype(np.float64)
    wq = codes.numpy().astype(np.int64).reshape(codes.shape[0], -1, 32)
    dots = np.einsum("mgk,ngk->mgn", xq, wq)  # exact int64
    return (dots * dx).sum(axis=1) * scales.double().numpy()


@pytest.mark.parametrize("in_features", [96, 100, 160])  # 100: a tail past the SIMD width
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 7, 9, 13, 63, 64, 130])
def test_int8_linear_matches_dequantised_reference(bias, tokens, in_features):
    """fp32 activations (`int8_activations=False`, and any input size not a multiple of 32):
    the codes widened to fp32, exact against the dequantised weight."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 300, bias=bias)  # 300: full panels plus a partial one
    q = Int8Linear(linear, int8_activations=False)
    w8, scales = _naive_int8(linear.weight)
    assert q.packed.dtype == torch.int8 and torch.equal(q.scales, scales)
    assert not q.int8_activations and not Int8Linear(nn.Linear(100, 8)).int8_activations
    x = torch.randn(1, tokens, in_features)
    dequant = w8.float() * scales[:, None]
    ref = x @ dequant.T + (linear.bias if bias else 0)
    torch.testing.assert_close(q(x), ref, rtol=1e-5, atol=1e-5)
    # Per-channel int8 is within half a quantisation step of every weight.
    assert (dequant - linear.weight).abs().max() <= scales.max() / 2 + 1e-7
    assert torch.allclose(q(x), linear(x), atol=0.05)


@pytest.mark.parametrize("in_features", [32, 96, 1056])  # 1056: past one K block of 1024
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 7, 9, 13, 64, 130])
def test_int8_activations_match_an_integer_reference(bias, tokens, in_features):
    """The default: x quantized to int8 per group of 32, integer dot products (vpdpbusd or
    vpmaddubsw), each group scaled once: equal to a numpy int64 reference of that scheme up
    to fp32 rounding, and within the activations' quantization error of the fp32 path."""
    torch.manual_seed(tokens)
    linear = nn.Linear(in_features, 300, bias=bias)
    q, exact = Int8Linear(linear), Int8Linear(linear, int8_activations=False)
    assert q.int8_activations and q.packed.dtype == torch.uint8
    w8, scales = _naive_int8(linear.weight)
    codes, got_scales = q.codes()
    assert torch.equal(codes, w8) and torch.equal(got_scales, scales)
    x = torch.randn(2, tokens, in_features)
    x[0, 0, :7] = 0.0  # a group partly zero; and a row entirely zero
    x[1, -1] = 0.0
    y = q(x)
    want = _integer_reference(x.reshape(-1, in_features), w8, scales).reshape(2, tokens, 300)
    want = want + (linear.bias.detach().double().numpy() if bias else 0.0)
    np.testing.assert_allclose(y.double().numpy(), want, rtol=1e-5, atol=1e-5)
    ref = exact(x)
    err = (y - ref).abs().max() / ref.abs().max()
    assert err < 0.02, err  # int8 activations: about 1/127 of each group's range
    assert y.dtype == x.dtype and q(x.bfloat16()).dtype == torch.bfloat16
    torch.library.opcheck(
        torch.ops.ember_cpu.packed_linear.default,
        (x, q.packed, q.scales, q.bias, q.out_features),
    )


@pytest.mark.parametrize("in_features", [7, 96, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 3, 17, 130])
def test_per_token_int8_matches_an_integer_reference(bias, tokens, in_features):
    """Embedding models' int8 linears (`per_token`): x quantized per row (scale max|x| / 127),
    oneDNN's int8 GEMM, the int32 sums scaled once: equal to a numpy int64 reference up to
    fp32 rounding, any input size, compiled too."""
    from ember.host.isa import cpu_has_int8_dot

    torch.manual_seed(in_features + tokens)
    linear = nn.Linear(in_features, 33, bias=bias)
    q = Int8Linear(linear, per_token=True)
    if not cpu_has_int8_dot():  # oneDNN's int8 sums saturate without VNNI: not used there
        assert not q.per_token and q.int8_activations == (in_features % 32 == 0)
        pytest.skip("per-token int8 GEMMs need int8 dot products (VNNI / AMX-INT8)")
    assert q.per_token and q.int8_activations and q.packed.dtype == torch.int8
    w8, scales = _naive_int8(linear.weight)
    codes, got_scales = q.codes()
    assert torch.equal(codes, w8) and torch.equal(got_scales, scales)
    x = torch.randn(tokens, in_features)
    if tokens:
        x[0] = 0.0  # a row entirely zero
    xs = x.double().numpy()
    amax = np.abs(xs).max(axis=-1, keepdims=True) if tokens else np.zeros((0, 1))
    xq = np.rint(x.float().numpy() * (np.float32(127) / np.maximum(amax, 1e-30)).astype(np.float32))
    want = (xq.astype(np.int64) @ w8.numpy().astype(np.int64).T) * (amax / 127.0)
    want = want * scales.double().numpy() + (linear.bias.detach().double().numpy() if bias else 0)
    y = q(x)
    assert y.shape == (tokens, 33)
    np.testing.assert_allclose(y.double().numpy(), want, rtol=1e-5, atol=1e-5)
    if tokens == 17:
        torch._dynamo.reset()  # a fresh compile per case, not a cache of the others'
        compiled = torch.compile(q, fullgraph=True)
        torch.testing.assert_close(compiled(x), y, rtol=1e-5, atol=1e-5)
    assert q(x[None]).shape == (1, tokens, 33)


def test_quantize_replaces_every_linear_including_a_tied_head(checkpoint_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint_dir("tiny-qwen2", tie_word_embeddings=True)
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    linears = sum(type(m) is nn.Linear for m in model.modules())
    fp32_bytes = bench.decode_bytes_per_token(model)
    assert quantize_int8_(model) == linears
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # The head now has its own int8 copy, so every linear's bytes drop about 4x.
    assert bench.decode_bytes_per_token(model) < fp32_bytes / 3


@pytest.mark.parametrize(
    "compile, int8_x",
    [(False, True), (True, True), (False, False)],
    ids=["eager", "compiled", "fp32-activations"],
)
def test_int8_greedy_within_fp32_top5(checkpoint_dir, compile, int8_x):
    """Greedy tokens stay within fp32 HF's top 5 at every step, mostly its argmax, with the
    activations quantized to int8 (the default) and with them kept in fp32
    (`quantize_activations=False`)."""
    from transformers import AutoModelForCausalLM

    # initializer_range 0.3: peaked logits, so top-5 of 512 is a real constraint.
    d = checkpoint_dir("tiny-qwen2", initializer_range=0.3)
    prompts = make_prompts(4, seed=3, low=5, high=30)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_gib=0.01, max_model_len=128, use_tqdm=False)
    with LLM(
        model=d,
        compile=compile,
        dtype="int8",
        token_buckets=(1, 8, 32),
        quantize_activations=int8_x,
        **kw,
    ) as llm:
        assert llm.config.quantization == "int8" and llm.config.dtype == torch.float32
        linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Int8Linear)]
        assert linears and all(m.int8_activations == int8_x for m in linears)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        pool = llm.llm_engine.block_manager
        assert pool.num_free_blocks == pool.num_blocks - 1
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ranks = [
        r for p, g in zip(prompts, outs, strict=True) for r in bench.teacher_forced_ranks(hf, p, g)
    ]
    assert max(ranks) < 5, ranks
    # Mostly fp32's own choice, step by step: int8 is close to fp32, not merely plausible.
    assert sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(quantization="int2"), "quantization must be None or one of"),
        (dict(dtype="bfloat16", quantization="int8"), "dtype must be float32"),
        (dict(dtype="int8", enable_lora=True), "without LoRA"),
        (dict(quantize_activations=False), "quantize_activations=False needs"),
        (dict(quantization="int4", quantize_activations=False), "always quantize activations"),
        (dict(quantization="int8", quantize_activations=1), "must be True or False"),
    ],
)
def test_int8_bad_config(checkpoint_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=checkpoint_dir("tiny-llama"), compile=False, kv_cache_gib=0.01, **kwargs)


def test_int8_with_auto_dtype_computes_in_fp32_on_a_bf16_checkpoint(checkpoint_dir):
    """`quantization="int8"` alone works on every CPU: "auto" resolves to fp32 math."""
    d = checkpoint_dir("tiny-llama", dtype=torch.bfloat16)
    config = EngineArgs(model=d, quantization="int8", kv_cache_gib=0.01).create_engine_config()
    assert (config.dtype, config.quantization) == (torch.float32, "int8")
