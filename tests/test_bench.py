"""Smoke test of the standard-workload harness (`ember bench`) so it never rots."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from ember import LLM
from ember.model.layers.packed import PackedLinear
from ember.tools import bench


def test_bench_workloads_run_and_report(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    tiny = dataclasses.replace(bench.WORKLOADS["thru"], num_requests=3, prompt_len=8, output_len=4)
    with LLM(model=d, compile=False, kv_cache_gib=0.01, max_model_len=64, use_tqdm=False) as llm:
        ours = bench.run_ember(llm, tiny, repeats=2)
        model = llm.llm_engine.runner.model
        per_token = bench.decode_bytes_per_token(model)
        # Untied tiny Llama: everything but the input embedding table is read per token: the
        # parameters left (norms) and every packed linear weight, padding included.
        expected = sum(
            p.numel() * p.element_size()
            for n, p in model.named_parameters()
            if "embed_tokens" not in n
        ) + sum(
            m.packed.numel() * m.packed.element_size()
            for m in model.modules()
            if isinstance(m, PackedLinear)
        )
        assert any(isinstance(m, PackedLinear) for m in model.modules())
        # The per-step split reads the runner's "ember::forward" profiler range.
        split = bench.profile_decode_steps(llm, context=8, steps=4)
        assert 0 < split.graph < split.step and split.linears > 0 and split.host >= 0
        flops = bench.workload_flops(model, tiny)
        cfg = model.config
        # Every projection once, from the config (q/k/v and gate/up run fused, once).
        kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
        linears = cfg.num_hidden_layers * (
            2 * cfg.hidden_size * cfg.hidden_size
            + 2 * cfg.hidden_size * kv
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
    tokens = 8 + 4 - 1
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * tokens * 12 / 2
    head = 2 * cfg.hidden_size * cfg.vocab_size * 4
    assert flops == pytest.approx(3 * (2 * linears * tokens + head + attention))
    hf = bench.run_hf(d, llm.config.dtype, tiny, repeats=1)
    assert ours.out_tok_s > 0 and ours.ttft_ms > 0 and ours.tpot_ms > 0 and len(ours.runs) == 2
    assert hf.out_tok_s > 0 and hf.startup_s is not None
    assert per_token == expected
    # The compute roofline's GEMM rate: the faster of ATen and ember's packed kernel (loaded here)
    assert bench.measure_gemm_gflops(torch.float32, m=16, k=32, n=48, repeats=1) > 0
    report = bench.Report(tiny, [ours, hf], 20.0, per_token, 100.0, "float32", flops, False)
    table = bench.format_table(report)
    assert "ember vs hf-eager" in table and "compute roofline" in table and "cold" in table
    assert "of it" not in table  # the batch-1 bandwidth roofline is only compared at batch 1
    lat = dataclasses.replace(tiny, num_requests=1)
    assert "of it" in bench.format_table(dataclasses.replace(report, workload=lat))


@pytest.mark.slow  # torch.compile of HF's model (~7-12 s); a benchmark's reference only
def test_hf_static_compile_reference_runs(checkpoint_dir):
    """The static-cache torch.compile HF baseline (W-LAT's second reference) runs and reports."""
    d = checkpoint_dir("tiny-llama")
    lat = dataclasses.replace(bench.WORKLOADS["lat"], prompt_len=8, output_len=4)
    r = bench.run_hf(d, torch.float32, lat, repeats=1, static_compile=True)
    assert r.engine == "hf-static-compile" and r.tpot_ms > 0 and r.startup_s > 0


_BENCH = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable"]


def test_benchmark_suites_import_and_attention_smoke():
    """The pytest-benchmark suites collect, and the op suites run once per case (no timing)."""
    ops = subprocess.run(
        [
            *_BENCH,
            "benchmarks/bench_attention.py",
            "benchmarks/bench_linear.py",
            "benchmarks/bench_lora_ops.py",
            "-k",
            "(bench_attention and torch and (b1_ctx128 or prefill_512 or mixed)) or "
            "((bench_linear or bench_lora_ops) and 1-)",
            "-rA",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ops.returncode == 0, ops.stdout[-2000:]
    assert ops.stdout.count("PASSED benchmarks/bench_attention.py::") == 3
    collect = subprocess.run(
        [
            *_BENCH,
            "--collect-only",
            "benchmarks/bench_embed.py",
            "benchmarks/bench_lora.py",
            "benchmarks/bench_prompt_cache.py",
            "benchmarks/bench_startup.py",
            "benchmarks/bench_workloads.py",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert collect.returncode == 0, collect.stdout[-2000:]
    # Only benchmarks: a helper imported under a bench_* name would be collected (and fail).
    assert "bench_checkpoint" not in collect.stdout and "bench_warm_start" in collect.stdout
    assert "bench_prompt_cache[llama-1b-bfloat16]" in collect.stdout


@pytest.mark.slow  # compiles ember (~30 s)
def test_the_workload_suite_runs_on_a_tiny_shape(tmp_path):
    """The end-to-end workload suite on a tiny shape: compiled ember and HF eager, fp32 W-LAT."""
    e2e = subprocess.run(
        [*_BENCH, "benchmarks/bench_workloads.py", "-k", "float32 and lat", "-s"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "EMBER_BENCH_SHAPES": "tiny-llama", "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert e2e.returncode == 0, e2e.stdout[-2000:]
    assert "2 passed" in e2e.stdout and "out tok/s" in e2e.stdout


def test_run_ember_child_runs_a_workload_in_a_fresh_process(checkpoint_dir):
    """The peer benchmarks' child runner: one engine per process, its numbers and cache dtype
    back as JSON; a child that fails is a RuntimeError carrying its error."""
    d = checkpoint_dir("tiny-llama")
    tiny = dataclasses.replace(bench.WORKLOADS["lat"], name="tiny", prompt_len=8, output_len=4)
    engine = {"compile": False, "kv_cache_gib": 0.01, "max_model_len": 64}
    out = bench.run_ember_child(d, 1, [tiny], **engine)
    assert out["kv"] == "float32"
    assert out["tiny"]["ttft_ms"] > 0 and out["tiny"]["tpot_ms"] > 0
    assert out["tiny"]["out_tok_s"] > 0
    with pytest.raises(RuntimeError, match="max_model_len"):
        bench.run_ember_child(d, 1, [tiny], **{**engine, "max_model_len": -1})


def test_alternate_mirrors_the_order_and_takes_each_engines_medians():
    calls: list[str] = []

    def engine(name: str, tpots: list[float]):
        def run() -> dict:
            calls.append(name)
            tpot = tpots[sum(c == name for c in calls) - 1]
            return {
                "lat": {"ttft_ms": 10 * tpot, "tpot_ms": tpot},
                "thru": {"out_tok_s": 1 / tpot},
                "kv": name,
            }

        return run

    a, b = bench.alternate([engine("a", [3.0, 1.0, 2.0]), engine("b", [5.0, 9.0, 4.0])], 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert a["lat"] == {"ttft_ms": 20.0, "tpot_ms": 2.0} and a["thru"]["out_tok_s"] == 0.5
    assert b["lat"]["tpot_ms"] == 5.0 and b["kv"] == "b"
    assert [r["lat"]["tpot_ms"] for r in a["runs"]] == [3.0, 1.0, 2.0]
    assert bench.tpots(b) == "5.00, 9.00, 4.00"


def test_tpots_show_each_runs_bandwidth_probe():
    runs = [
        {"lat": {"tpot_ms": 2.0, "probe_gbs": 41.2}},
        {"lat": {"tpot_ms": 2.5, "probe_gbs": 29.0}},
    ]
    assert bench.tpots({"runs": runs}) == "2.00 @41, 2.50 @29"
    assert bench.probe_bandwidth_gbs() > 0
