"""Narrow weights by default: `dtype="auto"` keeps a bf16 checkpoint's linear weights in bf16.
Where the CPU lacks native bf16 math (forced here with `cpu_isa="avx2"`, in a process of its
own), the math is fp32 and the kernels widen the weights, so greedy output is token-identical
to HF transformers running the same (bf16-valued) weights in fp32."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from ember import LLM
from ember.host import cpu_has_native_bf16
from tests.conftest import hf_greedy, make_prompts


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


_CHILD = """
import json, sys
import torch
from ember import LLM, SamplingParams
d, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=d, cpu_isa="avx2", kv_cache_gib=0.01, max_model_len=128, use_tqdm=False)
assert (llm.config.dtype, llm.config.weight_dtype) == (torch.float32, torch.bfloat16)
model = llm.llm_engine.runner.model
dtypes = sorted({str(m.weight.dtype) for m in model.modules() if hasattr(m, "in_features")})
kv = sorted({str(c.dtype) for c in llm.llm_engine.runner.kv_caches})
params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "weights": dtypes, "kv": kv}))
"""


def test_bf16_weights_fp32_math_match_hf_fp32_compiled(checkpoint_dir):
    d = checkpoint_dir("tiny-llama", dtype=torch.bfloat16)
    prompts = make_prompts(4, seed=3)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, d, json.dumps(prompts), "12"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["weights"] == ["torch.bfloat16"] and got["kv"] == ["torch.float32"]
    assert got["tokens"] == hf_greedy(d, prompts, 12, dtype=torch.float32)
