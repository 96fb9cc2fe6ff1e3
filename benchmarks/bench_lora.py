"""Multi-LoRA throughput: W-THRU on llama-160m (fp32) with (a) no LoRA (engine built without
LoRA), (a') LoRA enabled but no request using an adapter, (b) every request on one rank-16
adapter, (c) requests spread over 4 rank-16 adapters, compiled and eager.

Run: python -m pytest benchmarks/bench_lora.py -s --benchmark-columns=median
Prints each case's throughput ratio to (a) of the same mode; all figures from this one process.
Adapters: peft LoraConfig(r=16) on all seven projections, random weights.
"""

from __future__ import annotations

import pytest
import torch

from ember import LLM, LoRARequest
from ember.tools import bench as tools
from ember.tools.bench import WORKLOADS, run_ember

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RESULTS: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tools.bench_checkpoint("llama-160m")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> list[LoRARequest]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(4):
        torch.manual_seed(i)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_dir),
            LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False),
        )
        path = str(tmp_path_factory.mktemp(f"adapter{i}"))
        model.save_pretrained(path)
        out.append(LoRARequest(f"a{i}", i + 1, path))
    return out


@pytest.mark.parametrize("mode", ["compiled", "eager"])
@pytest.mark.parametrize(
    "case", ["a_lora_disabled", "a_lora_enabled_unused", "b_one_adapter", "c_four_adapters"]
)
def bench_lora_thru(benchmark, model_dir, adapters, mode, case):
    llm = LLM(
        model=model_dir,
        dtype="float32",
        compile=mode == "compiled",
        use_tqdm=False,
        enable_lora=case != "a_lora_disabled",
        max_loras=4,
        max_lora_rank=16,
    )
    loras = {"b_one_adapter": adapters[:1], "c_four_adapters": adapters}.get(case)
    result = benchmark.pedantic(
        run_ember, args=(llm, WORKLOADS["thru"], 2), kwargs={"loras": loras}, rounds=1
    )
    RESULTS[(mode, case)] = result.out_tok_s
    benchmark.extra_info["out_tok_s"] = round(result.out_tok_s, 1)
    base = RESULTS.get((mode, "a_lora_disabled"))
    if base:
        benchmark.extra_info["ratio_to_no_lora"] = round(result.out_tok_s / base, 3)
        ratio = result.out_tok_s / base
        print(f"\n{mode} {case}: {result.out_tok_s:.1f} out tok/s, {ratio:.3f}x of (a)")
    llm.close()
