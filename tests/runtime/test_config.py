"""Engine knobs are validated; bad values raise ValueError naming the knob and the range."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from ember import LLM, SamplingParams
from ember.runtime.config import EngineArgs
from ember.runtime.dtypes import resolve_dtype, resolve_kv_cache_dtype
from tests.conftest import build_tiny_bert

pytestmark = pytest.mark.host_isa  # on this CPU and as an AVX2-only host: tests/host_isa.py


@pytest.mark.parametrize(
    "kwargs,knob",
    [
        (dict(kv_cache_gib=0), "kv_cache_gib"),
        (dict(kv_cache_gib=-1), "kv_cache_gib"),
        (dict(block_size=3), "block_size"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=10**6), "max_model_len"),
        (dict(dtype="int4"), "dtype"),
        (dict(kv_cache_dtype="float16"), "kv_cache_dtype"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
        (dict(kv_cache_gib=1e-5, max_model_len=2048), "kv_cache_gib"),
    ],
)
def test_engine_config_rejects_bad_knobs(checkpoint_dir, kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        LLM(model=checkpoint_dir("tiny-llama"), compile=False, **kwargs)


def test_a_second_cpu_isa_in_one_process_is_a_value_error(checkpoint_dir, monkeypatch):
    """A process holds one kernel build: an engine asking for another ISA is told so (before,
    a GGUF file failed with "kernels cannot be built here", and a checkpoint silently ran
    without the kernels)."""
    from ember import kernels

    monkeypatch.setattr(kernels, "_loaded_isa", "native")
    with pytest.raises(ValueError, match=r"cpu_isa='avx2'.*cpu_isa='native'.*new process"):
        LLM(model=checkpoint_dir("tiny-llama"), compile=False, cpu_isa="avx2")


def test_dtype_resolution():
    assert resolve_dtype("float32", None) == torch.float32
    assert resolve_dtype("bfloat16", None) == torch.bfloat16
    with pytest.warns(UserWarning, match="bfloat16"):
        assert resolve_dtype("float16", None) == torch.bfloat16
    assert resolve_dtype("auto", torch.float32) == torch.float32


def test_kv_cache_dtype_resolution(checkpoint_dir, monkeypatch, tmp_path):
    """kv_cache_dtype="auto": as narrow as the weights where the model decodes, also under
    fp32 math (no native bf16 math, patched here), int8 where they are quantized; the math's
    dtype for encoder-only models and fp32 checkpoints. bf16 math cannot use a float32
    cache."""
    from ember.runtime import dtypes as config

    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_kv_cache_dtype("auto", bf16, f32) == bf16
    assert resolve_kv_cache_dtype("float32", bf16, f32) == f32
    assert resolve_kv_cache_dtype("bf16", f32, f32) == bf16
    assert resolve_kv_cache_dtype(bf16, f32, f32) == bf16
    with pytest.raises(ValueError, match="kv_cache_dtype='float32'.*bfloat16"):
        resolve_kv_cache_dtype("float32", bf16, bf16)

    def engine_config(shape, weights=f32, **kw):
        return EngineArgs(model=checkpoint_dir(shape, dtype=weights), **kw).create_engine_config()

    bert = build_tiny_bert(str(tmp_path / "bert"), bf16)

    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda isa="native": False)
    cfg = engine_config("tiny-llama", bf16)
    assert (cfg.dtype, cfg.weight_dtype, cfg.kv_dtype) == (f32, bf16, bf16)
    assert engine_config("tiny-llama", bf16, kv_cache_dtype="float32").kv_dtype == f32
    assert engine_config("tiny-llama", bf16, dtype="float32").kv_dtype == f32
    # quantized linears: int8 (a scale per token and head), as OpenVINO's u8 cache
    assert engine_config("tiny-llama", bf16, dtype="int8").kv_dtype == torch.int8
    assert engine_config("tiny-llama", quantization="int4").kv_dtype == torch.int8
    assert engine_config("tiny-llama", dtype="int8", kv_cache_dtype="bf16").kv_dtype == bf16
    assert engine_config("tiny-llama").kv_dtype == f32
    assert EngineArgs(model=bert).create_engine_config().kv_dtype == f32  # encoder-only
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda isa="native": True)
    cfg = engine_config("tiny-llama", bf16)
    assert (cfg.dtype, cfg.kv_dtype) == (bf16, bf16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config("tiny-llama", bf16, kv_cache_dtype="float32")


def test_unsupported_architecture_fails_at_load_naming_it(tmp_path):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertForQuestionAnswering"]})
    )
    with pytest.raises(ValueError, match="BertForQuestionAnswering"):
        LLM(model=str(tmp_path))


def test_missing_model_dir_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path))


def test_cli_generate_prints_text_and_throughput(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ember.cli",
            "generate",
            "--model",
            d,
            "--prompt",
            "Hello",
            "--max-tokens",
            "8",
            "--no-compile",
            "--kv-cache-gib",
            "0.01",
            "--max-model-len",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    # The text and tokens the same engine settings give in-process (greedy: the CLI's default
    # temperature 0, EOS kept), then the throughput line's own arithmetic.
    with LLM(model=d, compile=False, kv_cache_gib=0.01, max_model_len=64) as llm:
        want = llm.generate(
            ["Hello"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
        )
        dtype = llm.config.dtype
    c = want[0].outputs[0]
    lines = out.splitlines()
    first = lines.index("--- prompt: 'Hello'")
    assert lines[first + 1 : first + 3] == [
        repr(c.text),
        f"    tokens={c.token_ids} finish={c.finish_reason}",
    ]
    m = re.fullmatch(
        r"generated (\d+) tokens for 1 prompts in ([\d.]+) s: ([\d.]+) tok/s "
        r"\(load ([\d.]+) s, dtype (\S+)\)",
        lines[first + 3],
    )
    assert m is not None, lines[first + 3]
    tokens, gen_s, rate, load_s = int(m[1]), float(m[2]), float(m[3]), float(m[4])
    assert tokens == len(c.token_ids) > 0 and m[5] == str(dtype)
    assert gen_s > 0 and load_s > 0
    # tok/s is tokens over the generation time (both printed rounded: 3 and 1 decimals)
    assert tokens / (gen_s + 5e-4) - 0.05 <= rate <= tokens / max(gen_s - 5e-4, 1e-9) + 0.05
