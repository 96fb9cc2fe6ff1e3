"""Smoke test of the standard-workload harness (`ember bench`) so it never rots."""

from __future__ import annotations

import dataclasses

from ember import LLM, bench


def test_bench_workloads_run_and_report(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    tiny = dataclasses.replace(bench.WORKLOADS["thru"], num_requests=3, prompt_len=8, output_len=4)
    with LLM(model=d, compile=False, kv_cache_gib=0.01, max_model_len=64, use_tqdm=False) as llm:
        ours = bench.run_ember(llm, tiny, repeats=2)
        model = llm.llm_engine.runner.model
        per_token = bench.decode_bytes_per_token(model)
        # Untied tiny Llama: everything but the input embedding table is read per token.
        expected = sum(
            p.numel() * p.element_size()
            for n, p in model.named_parameters()
            if "embed_tokens" not in n
        )
    hf = bench.run_hf(d, llm.config.dtype, tiny, repeats=1)
    assert ours.out_tok_s > 0 and ours.ttft_ms > 0 and ours.tpot_ms > 0 and len(ours.runs) == 2
    assert hf.out_tok_s > 0
    assert per_token == expected
    table = bench.format_table(tiny, [ours, hf], 1.0, 20.0, 0.5)
    assert "ratio ember/hf-eager" in table and "roofline" in table
    lat = dataclasses.replace(tiny, num_requests=1)
    assert "of it)" in bench.format_table(lat, [ours], 1.0, 20.0, 0.5)
    assert "of it)" not in table


def test_benchmark_suites_import_and_attention_smoke():
    """The pytest-benchmark suites collect, and the op suites run once per case (no timing)."""
    import subprocess
    import sys

    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable"]
    smoke = subprocess.run(
        [
            *run,
            "benchmarks/bench_attention.py",
            "-k",
            "torch and (b1_ctx128 or prefill_512 or mixed)",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert smoke.returncode == 0, smoke.stdout[-2000:]
    assert "3 passed" in smoke.stdout
    ops = subprocess.run(
        [*run, "benchmarks/bench_linear.py", "benchmarks/bench_lora_ops.py", "-k", "1-"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ops.returncode == 0, ops.stdout[-2000:]
    collect = subprocess.run(
        [*run, "--collect-only", "benchmarks/bench_embed.py", "benchmarks/bench_lora.py"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert collect.returncode == 0, collect.stdout[-2000:]
