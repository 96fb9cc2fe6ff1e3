"""W-PREFIX side by side: ember's disk tier against llama.cpp's slot save/restore, one GGUF file.

The same token ids in both engines: a `--prefix-len`-token random prefix plus a 32-token
question, 16 greedy tokens. llama-server (one slot, `--slot-save-path`, 2 threads):
  cold     /completion on prefix + question 0 (cache_prompt: the slot keeps its K/V)
  save     POST /slots/0?action=save, then the server is stopped
  restart  a new server; POST /slots/0?action=restore, then /completion on prefix + question 1:
           TTFT = restore + the question's prompt time (timings.prompt_ms)
ember (`ember.tools.bench_prompt_cache.run_prefix`) on the same file: cold, warm and after a
restart from `prefix_cache_dir`. Where llama.cpp's repacked matmul crashes (AMX Xeons), pass
`--no-repack` (LLAMA_ARG_REPACK=0).

usage: python benchmarks/llamacpp/prompt_cache.py FILE.gguf --llama-cpp BIN_DIR
           [--prefix-len 4000] [--repeats 3] [--no-repack]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

import torch
from llama_server import llama_server, post  # this directory's (run as a script)


def complete(url: str, ids: list[int]) -> dict:
    """The /completion timings (prompt_ms, prompt_n, ...) of 16 greedy tokens."""
    body = {"prompt": ids, "n_predict": 16, "temperature": 0.0, "top_k": 1,
            "samplers": ["top_k"], "ignore_eos": True, "cache_prompt": True}  # fmt: skip
    return post(f"{url}/completion", body)["timings"]


def llamacpp_prefix(args: argparse.Namespace, vocab: int, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (args.prefix_len,), generator=g).tolist()
    questions = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(3)]
    with tempfile.TemporaryDirectory() as slots:
        server = functools.partial(
            llama_server, args.llama_cpp, args.gguf,
            ["-c", str(args.prefix_len + 256), "--slot-save-path", slots], not args.no_repack,
        )  # fmt: skip
        with server() as url:
            complete(url, questions[2])  # first use
            cold = complete(url, prefix + questions[0])
            saved = post(f"{url}/slots/0?action=save", {"filename": "prefix.bin"})
        size_mb = os.path.getsize(os.path.join(slots, "prefix.bin")) / 1e6
        with server() as url:
            t = time.perf_counter()
            restored = post(f"{url}/slots/0?action=restore", {"filename": "prefix.bin"})
            restore_ms = (time.perf_counter() - t) * 1e3
            warm = complete(url, prefix + questions[1])
    return {
        "cold_ms": cold["prompt_ms"],
        "save_ms": saved["timings"]["save_ms"],
        "restore_ms": restore_ms,
        "restore_reported_ms": restored["timings"]["restore_ms"],
        "restart_ms": restore_ms + warm["prompt_ms"],
        "restart_prompt_n": warm["prompt_n"],
        "slot_mb": size_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's bin dir")
    parser.add_argument("--prefix-len", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-repack", action="store_true")
    args = parser.parse_args()
    from ember.model.gguf.reader import weight_types
    from ember.tools.bench_prompt_cache import run_prefix

    print(f"{args.gguf}: {dict(weight_types(args.gguf))}")
    rows = []
    ember_rows = []
    for rep in range(args.repeats):  # alternate the engines
        from ember import LLM

        with LLM(model=args.gguf, compile=False, use_tqdm=False) as probe:
            vocab = probe.llm_engine.vocab_size
        rows.append(llamacpp_prefix(args, vocab, rep))
        print("llama.cpp", json.dumps({k: round(v, 1) for k, v in rows[-1].items()}))
        ember_rows.append(run_prefix(args.gguf, {}, args.prefix_len, repeats=1))
        print(ember_rows[-1].summary())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"llama.cpp (median of {len(rows)}): cold {med['cold_ms']:.0f} ms, slot save "
        f"{med['save_ms']:.0f} ms ({med['slot_mb']:.0f} MB), restart: restore "
        f"{med['restore_ms']:.0f} ms + question {med['restart_ms'] - med['restore_ms']:.0f} ms "
        f"= {med['restart_ms']:.0f} ms ({med['restart_ms'] / med['cold_ms']:.3f}x cold)"
    )
    e = sorted(ember_rows, key=lambda r: r.restart_disk_ms)[len(ember_rows) // 2]
    print(
        f"ember (median restart of {len(ember_rows)}): cold {e.cold_ms:.0f} ms, restart from "
        f"the page cache {e.restart_ms:.0f} ms ({e.restart_ms / e.cold_ms:.3f}x cold), from "
        f"the disk {e.restart_disk_ms:.0f} ms ({e.restart_disk_ms / e.cold_ms:.3f}x)"
    )


if __name__ == "__main__":
    main()
