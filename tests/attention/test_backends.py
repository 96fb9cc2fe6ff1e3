"""The attention backend registry: selection, availability, load-time feature errors, and the
engine running on each available backend."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from ember.attention import (
    AttentionFeatures,
    BackendUnavailableError,
    get_backend,
    select_backend,
    torch_cpu,
)
from ember.runtime.config import EngineArgs
from tests.attention.test_paged_attention import _run_case, load_backend
from tests.conftest import hf_greedy, make_prompts

pytestmark = pytest.mark.host_isa  # on this CPU and as an AVX2-only host: tests/host_isa.py

FP32 = AttentionFeatures(kv_dtype=torch.float32)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend("flash")


def test_auto_on_cpu_is_ipex_or_torch():
    ipex_ok = get_backend("ipex").unavailable() is None
    assert select_backend("auto", FP32).name == ("ipex" if ipex_ok else "torch")


def test_ipex_unavailable_says_why():
    if get_backend("ipex").unavailable() is None:
        pytest.skip("IPEX is installed and usable here")
    with pytest.raises(BackendUnavailableError, match="'ipex' is unavailable: intel_extension"):
        select_backend("ipex", FP32)


def test_triton_without_gpu_or_interpreter_is_unavailable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(BackendUnavailableError, match="'triton' is unavailable"):
        select_backend("triton", FP32)


@pytest.mark.parametrize(
    "features, lacking",
    [
        (AttentionFeatures(torch.float32, kv_sharing=True), "cross-layer KV sharing"),
        (AttentionFeatures(torch.float16), "KV cache dtype torch.float16"),
    ],
)
def test_feature_a_backend_lacks_fails_naming_backend_and_feature(features, lacking):
    with pytest.raises(BackendUnavailableError, match=f"{lacking} is not supported by .*'torch'"):
        select_backend("torch", features)
    ipex = get_backend("ipex")
    assert ipex.unsupported(AttentionFeatures(torch.float32, softcap=True)) == (
        "attention logit soft-capping"
    )
    assert "cross-attention" in ipex.unsupported(
        AttentionFeatures(torch.float32, cross_attention=True)
    )


def test_a_cache_narrower_than_the_queries_needs_a_backend_that_widens_it(
    checkpoint_dir, fake_ipex, monkeypatch
):
    """torch and triton attend a bf16 cache under fp32 queries; IPEX's kernels take one dtype.
    With kv_cache_dtype="auto", an engine on IPEX keeps its cache in the math's dtype; asked
    for by name, the bf16 cache is an error naming the backend."""
    from ember.runtime import dtypes as config

    mixed = AttentionFeatures(torch.bfloat16, activation_dtype=torch.float32)
    assert get_backend("torch").unsupported(mixed) is None
    assert get_backend("triton").unsupported(mixed) is None
    assert get_backend("ipex").unsupported(mixed) == (
        "a torch.bfloat16 KV cache under torch.float32 activations"
    )
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda isa="native": False)
    d = checkpoint_dir("tiny-llama", dtype=torch.bfloat16)
    cfg = EngineArgs(d, attention_backend="ipex").create_engine_config()
    assert (cfg.attention_backend, cfg.kv_dtype) == ("ipex", torch.float32)
    cfg = EngineArgs(d).create_engine_config()
    assert (cfg.attention_backend, cfg.kv_dtype) == ("torch", torch.bfloat16)
    with pytest.raises(ValueError, match="KV cache under torch.float32 .* 'ipex'"):
        EngineArgs(d, attention_backend="ipex", kv_cache_dtype="bfloat16").create_engine_config()


def test_model_needing_an_unsupported_feature_fails_at_load(checkpoint_dir):
    d = checkpoint_dir("tiny-llama", num_kv_shared_layers=1)
    with pytest.raises(ValueError, match="cross-layer KV sharing is not supported"):
        EngineArgs(d, dtype="float32", attention_backend="torch").create_engine_config()
    with pytest.raises(ValueError, match="no attention backend can run this model"):
        EngineArgs(d, dtype="float32").create_engine_config()


def test_flash_decoding_split_matches_reference(monkeypatch):
    """Few (decode, K/V head) pairs and a long context: the context is split into partitions
    merged by log-sum-exp; sliding windows leave some partitions empty."""
    monkeypatch.setattr(torch_cpu, "_SPLIT_MIN_TOKENS", 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert torch_cpu._decode_partitions(1, 64) == 8
    backend = load_backend("torch")
    for window in (0, 5, 20):
        specs = [(63, 1), (40, 1)]
        out, refs, _ = _run_case(backend, specs, 4, 1, 16, 4, torch.float32, sliding_window=window)
        torch.testing.assert_close(out, torch.cat(refs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["torch", "triton", "ipex"])
def test_engine_on_backend_matches_hf(checkpoint_dir, request, name):
    """Mixed prefill/decode batches through the engine on each available backend (eager: the
    Triton interpreter cannot run inside an inductor graph on CPU; IPEX's stand-in where IPEX
    cannot be installed)."""
    if name == "ipex":
        request.getfixturevalue("fake_ipex")
    load_backend(name)
    d = checkpoint_dir("tiny-mistral")  # GQA (4 heads, 1 KV head) and a sliding window of 24
    prompts = make_prompts(3, seed=5, low=5, high=30)
    llm = LLM(
        model=d,
        compile=False,
        dtype="float32",
        kv_cache_gib=0.01,
        max_model_len=64,
        block_size=4,
        attention_backend=name,
    )
    assert llm.config.attention_backend == name
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(d, prompts, 8)


@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16-math", "fp32-math"])
def test_bf16_cache_math_both_ways(monkeypatch, native_bf16):
    """A bf16 cache is attended in bf16 on CPUs with native bf16 math, else in fp32; both match
    the fp32 oracle within bf16 tolerance (mixed, windowed and split-decode cases)."""
    monkeypatch.setattr(torch_cpu, "cpu_has_native_bf16", lambda: native_bf16)
    want = torch.bfloat16 if native_bf16 else torch.float32
    assert torch_cpu.compute_dtype(torch.bfloat16, torch.bfloat16) == want
    assert torch_cpu.compute_dtype(torch.float32, torch.float32) == torch.float32
    monkeypatch.setattr(torch_cpu, "_SPLIT_MIN_TOKENS", 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    backend = load_backend("torch")
    for specs, window in (([(12, 1), (0, 11), (5, 1), (0, 3)], 0), ([(63, 1), (40, 1)], 20)):
        out, refs, _ = _run_case(backend, specs, 4, 1, 16, 4, torch.bfloat16, sliding_window=window)
        torch.testing.assert_close(out.float(), torch.cat(refs), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16-cpu", "no-bf16-cpu"])
def test_bf16_cache_under_fp32_queries(monkeypatch, name, native_bf16):
    """kv_cache_dtype="bfloat16" under float32 math: the cache holds bf16 K/V and attention
    widens them, on any CPU: float32 out, equal to the float32 oracle over the cache's values
    at float32 tolerance. Decodes and chunks in C++, split decodes and soft-capping in the
    PyTorch code, a sliding window."""
    monkeypatch.setattr(torch_cpu, "cpu_has_native_bf16", lambda: native_bf16)
    assert torch_cpu.compute_dtype(torch.bfloat16, torch.float32) == torch.float32
    monkeypatch.setattr(torch_cpu, "_SPLIT_MIN_TOKENS", 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    backend = load_backend(name)
    cases = (
        ([(12, 1), (0, 11), (5, 1), (0, 3)], 0, 0.0),
        ([(63, 1), (40, 1)], 20, 0.0),
        ([(63, 1), (16, 5), (0, 9)], 0, 30.0),
    )
    for specs, window, softcap in cases:
        out, refs, _ = _run_case(
            backend, specs, 4, 1, 16, 4, torch.bfloat16, sliding_window=window, softcap=softcap,
            query_dtype=torch.float32,
        )  # fmt: skip
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, torch.cat(refs), atol=1e-4, rtol=1e-4)
