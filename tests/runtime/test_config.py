"""Engine knobs are validated; bad values raise ValueError naming the knob and the range."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ember import LLM
from ember.runtime.config import resolve_dtype


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
    assert "--- prompt: 'Hello'" in out and "tok/s" in out
