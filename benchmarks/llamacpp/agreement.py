"""Greedy agreement of ember with HF transformers on the same GGUF files, per quant type.

ember runs each file with its own kernels (Q8_0/Q4_0/Q4_1/Q5_0 as the file's groups, Q4_K and
Q6_K in super-blocks as the file holds them, other types requantized to 8-bit groups, float
types as they are; activations quantized to int8 per group of 32 for the quantized linears, as
llama.cpp does). HF transformers loads the same file with `from_pretrained(gguf_file=...)`,
which dequantizes every tensor to fp32. Under teacher forcing on ember's greedy tokens, each
token's rank in HF's logits at that step is counted: rank 0 = HF's argmax.

usage: python benchmarks/llamacpp/agreement.py FILE.gguf [FILE.gguf ...] [--max-tokens 32]
           [--kv-cache-dtype auto,int8] [--llama-cpp BIN_DIR]

`--kv-cache-dtype`: one ember row per cache dtype. `--llama-cpp`: a row for llama.cpp on the
same file, its greedy tokens from `llama-server` (top-k 1, the same prompt token ids, EOS
ignored), ranked in HF the same way: the bar ember's rows are held to.

Real weights give the ranks meaning (random checkpoints have near-flat logits); to get every
type from one real model, requantize the demo model's file with llama.cpp:

    llama-quantize --allow-requantize gemma-3-270m-q4_k_m.gguf gemma-q8_0.gguf Q8_0
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from llama_server import llama_server, post  # this directory's (run as a script)

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


def ember_greedy(path: str, max_tokens: int, kv_cache_dtype: str) -> list[tuple[list, list]]:
    """(prompt ids, greedy ids) of each prompt, from ember."""
    from ember import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    kw = dict(compile=False, kv_cache_gib=0.05, max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    with LLM(model=path, **kw) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def llamacpp_greedy(bin_dir: str, path: str, prompts: list[list[int]], max_tokens: int) -> list:
    """(prompt ids, greedy ids) of each prompt from llama-server on `path`: the same token ids
    in, top-k 1 sampling, EOS ignored, no prompt cache."""
    pairs = []
    with llama_server(bin_dir, path, ["-c", "512"]) as url:
        for ids in prompts:
            body = {
                "prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "samplers": ["top_k"], "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True,
            }  # fmt: skip
            pairs.append((ids, post(f"{url}/completion", body)["tokens"]))
    return pairs


def agreement(path: str, pairs: list[tuple[list, list]]) -> dict:
    """Teacher-forced ranks in HF fp32 (HF's GGUF loader) of each pair's generated tokens."""
    from transformers import AutoModelForCausalLM

    from ember.model.gguf.reader import weight_types
    from ember.tools.bench import teacher_forced_ranks

    directory, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    ranks = [r for prompt, gen in pairs for r in teacher_forced_ranks(hf, prompt, gen)]
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
    parser.add_argument("--kv-cache-dtype", default="auto", help="comma-separated")
    parser.add_argument("--llama-cpp", metavar="BIN_DIR", help="also rank llama.cpp's tokens")
    args = parser.parse_args()
    print(
        f"{'file':36} {'engine':18} {'tensor types':34} {'tokens':>6} {'argmax':>8} "
        f"{'top-5':>8} {'worst':>5}"
    )
    for path in args.files:
        runs = [(f"ember kv={kv}", kv) for kv in args.kv_cache_dtype.split(",")]
        if args.llama_cpp:
            runs.append(("llama.cpp", None))
        prompts = None
        for engine, kv in runs:
            start = time.perf_counter()
            if kv is None:
                pairs = llamacpp_greedy(args.llama_cpp, path, prompts, args.max_tokens)
            else:
                pairs = ember_greedy(path, args.max_tokens, kv)
                prompts = [p for p, _ in pairs]
            row = agreement(path, pairs)
            n = row["tokens"]
            types = ", ".join(
                f"{c} {t}" for t, c in sorted(row["types"].items(), key=lambda i: -i[1])
            )
            print(
                f"{os.path.basename(path):36} {engine:18} {types:34} {n:6d} "
                f"{row['argmax'] / n:8.1%} {row['top5'] / n:8.1%} {row['worst']:5d}"
                f"   ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
