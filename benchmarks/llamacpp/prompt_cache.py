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
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request

import torch


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


class Server:
    def __init__(self, bin_dir: str, path: str, ctx: int, slots: str, repack: bool) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, **({} if repack else {"LLAMA_ARG_REPACK": "0"}))
        self.proc = subprocess.Popen(
            [f"{bin_dir}/llama-server", "-m", path, "--port", str(port), "-c", str(ctx),
             "-t", "2", "-np", "1", "--slot-save-path", slots],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("llama-server did not start")

    def complete(self, ids: list[int]) -> dict:
        """The /completion timings (prompt_ms, prompt_n, ...) of 16 greedy tokens."""
        body = {"prompt": ids, "n_predict": 16, "temperature": 0.0, "top_k": 1,
                "samplers": ["top_k"], "ignore_eos": True, "cache_prompt": True}  # fmt: skip
        return _post(f"{self.url}/completion", body)["timings"]

    def slot(self, action: str, filename: str) -> dict:
        return _post(f"{self.url}/slots/0?action={action}", {"filename": filename})

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def llamacpp_prefix(args: argparse.Namespace, vocab: int, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (args.prefix_len,), generator=g).tolist()
    questions = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(3)]
    ctx = args.prefix_len + 256
    with tempfile.TemporaryDirectory() as slots:
        server = Server(args.llama_cpp, args.gguf, ctx, slots, not args.no_repack)
        try:
            server.complete(questions[2])  # first use
            cold = server.complete(prefix + questions[0])
            saved = server.slot("save", "prefix.bin")
        finally:
            server.stop()
        size_mb = os.path.getsize(os.path.join(slots, "prefix.bin")) / 1e6
        server = Server(args.llama_cpp, args.gguf, ctx, slots, not args.no_repack)
        try:
            t = time.perf_counter()
            restored = server.slot("restore", "prefix.bin")
            restore_ms = (time.perf_counter() - t) * 1e3
            warm = server.complete(prefix + questions[1])
        finally:
            server.stop()
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
