"""Greedy agreement of ember with HF transformers on the same GGUF files, per quant type.

ember runs each file with its own kernels (Q8_0/Q4_0/Q4_1 as the file's groups, Q4_K as 4-bit
groups with offsets, Q6_K as 6-bit codes, other types requantized to 8-bit groups, float types
as they are; activations quantized to int8 per group of 32 for the quantized linears, as
llama.cpp does). HF transformers loads the same file with `from_pretrained(gguf_file=...)`,
which dequantizes every tensor to fp32. Under teacher forcing on ember's greedy tokens, each
token's rank in HF's logits at that step is counted: rank 0 = HF's argmax.

usage: python benchmarks/llamacpp/agreement.py FILE.gguf [FILE.gguf ...] [--max-tokens 32]

Real weights give the ranks meaning (random checkpoints have near-flat logits); to get every
type from one real model, requantize the demo model's file with llama.cpp:

    llama-quantize --allow-requantize gemma-3-270m-q4_k_m.gguf gemma-q8_0.gguf Q8_0
"""

from __future__ import annotations

import argparse
import os
import time

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\n\n# compute the mean of each row\n",
    "Photosynthesis is the process by which",
]


def agreement(path: str, max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from ember import LLM, SamplingParams
    from ember.compiler.gguf import weight_types
    from ember.tools.bench import teacher_forced_ranks

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(model=path, compile=False, kv_cache_gib=0.05, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    directory, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    ranks = [
        r
        for o in outs
        for r in teacher_forced_ranks(hf, list(o.prompt_token_ids), list(o.outputs[0].token_ids))
    ]
    return {
        "types": weight_types(path),
        "tokens": len(ranks),
        "argmax": sum(r == 0 for r in ranks),
        "top5": sum(r < 5 for r in ranks),
        "worst": max(ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"{'file':36} {'tensor types':34} {'tokens':>6} {'argmax':>8} {'top-5':>8} {'worst':>5}")
    for path in args.files:
        start = time.perf_counter()
        row = agreement(path, args.max_tokens)
        n = row["tokens"]
        types = ", ".join(f"{c} {t}" for t, c in sorted(row["types"].items(), key=lambda i: -i[1]))
        print(
            f"{os.path.basename(path):36} {types:34} {n:6d} "
            f"{row['argmax'] / n:8.1%} {row['top5'] / n:8.1%} {row['worst']:5d}"
            f"   ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
