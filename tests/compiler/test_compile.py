"""The compiled path: zero graph breaks, one graph per bucket, no recompiles, compiled == HF.

Compile is slow on 2 cores, so these use short bucket ladders (max_num_batched_tokens 4-8).
"""

from __future__ import annotations

import json
import os
import platform
import random
import stat
import subprocess
import sys
import textwrap

import pytest
from torch._dynamo.utils import counters

from ember import LLM, SamplingParams
from ember.runtime.buckets import graph_sizes, padded_num_tokens
from tests.conftest import FAMILIES, drive_random, gib_for_blocks, hf_greedy, make_prompts
from tests.e2e.test_generate_hf import run_staggered


def flat_calls(llm: LLM) -> int:
    """How many of the engine's graphs run as `ember.compile.flat_call`s."""
    forwards = llm.llm_engine.runner.forwards.compiled()
    return sum(hasattr(g, "__wrapped__") for _, f in forwards for g in f.graphs.values())


def test_buckets_padding_and_graph_sizes():
    ladder = (1, 4, 16)
    assert [padded_num_tokens(n, ladder) for n in (1, 2, 4, 5, 16, 17, 300)] == [
        1,
        4,
        4,
        16,
        16,
        17,
        300,
    ]
    assert graph_sizes(ladder, 16) == (1, 4, 16)
    assert graph_sizes(ladder, 2048) == (1, 4, 16, 17)
    assert graph_sizes((1,), 2048) == (1, 2)
    assert graph_sizes((1, 2, 4), 4) == (1, 2, 4)


def test_dynamic_token_graph_is_compiled_for_the_token_budget():
    """The dynamic graph's token dim carries the engine's token budget as its size hint (not
    the 2-token example step's), so inductor parallelizes its kernels for large steps; the
    per-sequence dims keep their example sizes; static buckets mark no token dim."""
    from types import SimpleNamespace

    import torch

    from ember.compile.capture import _mark_step_dynamic

    def step():
        meta = SimpleNamespace(
            query_start_loc=torch.zeros(3, dtype=torch.int32),
            seq_lens=torch.zeros(2, dtype=torch.int32),
            cross_seq_lens=None,
            block_tables=torch.zeros(2, 4, dtype=torch.int32),
            cross_block_tables=None,
            slot_mapping=torch.zeros(2, dtype=torch.int64),
            cross_token_ranges=None,
            cross_row_mask=None,
        )
        return torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), meta

    ids, positions, meta = step()
    _mark_step_dynamic((ids, positions, torch.zeros(2, dtype=torch.int64), meta, []), True, 2048)
    for t in (ids, positions, meta.slot_mapping):
        assert t._dynamo_dynamic_indices == {0} and t._dynamo_hint_overrides == {0: 2048}
    assert meta.seq_lens._dynamo_dynamic_indices == {0}
    assert not getattr(meta.seq_lens, "_dynamo_hint_overrides", None)
    ids, positions, meta = step()
    _mark_step_dynamic((ids, positions, torch.zeros(1, dtype=torch.int64), meta, []), False, 2048)
    assert not hasattr(ids, "_dynamo_dynamic_indices")


def test_token_buckets_are_validated(checkpoint_dir):
    with pytest.raises(ValueError, match="token_buckets"):
        LLM(model=checkpoint_dir("tiny-llama"), compile=False, token_buckets=(4, 2))


# tiny-qwen2 (biases on q/k/v) compiles in the int8 and GGUF tests too; tiny-mistral (a sliding
# window) runs on this CPU only: its graphs are traced as any other shape's, and the attention
# kernel's window on an AVX2 build is held to its reference by
# test_paged_attention_sliding_window[torch-avx2-host-*] (11 s of the child's run saved).
_COMPILED_FAMILIES = {
    "tiny-qwen2": pytest.mark.slow,
    "tiny-mistral": pytest.mark.one_host("the sliding window's graphs do not follow the ISA"),
}


@pytest.mark.host_isa  # ember's fp32 kernels and attention in the graphs follow the ISA
@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=_COMPILED_FAMILIES.get(f, ())) for f in FAMILIES],
)
def test_compiled_graph_count_no_breaks_and_matches_hf(checkpoint_dir, family, monkeypatch):
    """Static buckets (1, 2) plus one dynamic-token graph for 3..8 tokens: 3 graphs, compiled
    by 3 processes at once (`capture.prepare_graphs`): this one traces only the first, and the
    graphs the two forked workers compiled run as they would compiled here."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", "3")
    d = checkpoint_dir(family)
    graphs_before = counters["stats"]["unique_graphs"]
    breaks_before = sum(counters["graph_break"].values())
    llm = LLM(
        model=d,
        dtype="float32",
        kv_cache_gib=0.01,
        block_size=4,
        max_num_batched_tokens=8,
        max_model_len=96,
        token_buckets=(1, 2),
        use_tqdm=False,
    )
    assert llm.llm_engine.runner.graph_sizes == (1, 2, 3)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert sum(counters["graph_break"].values()) == breaks_before
    assert llm.llm_engine.runner.graphs_compiled == 3
    assert flat_calls(llm) == 3  # adopted from the workers too
    prompts = make_prompts(6, seed=11, low=2, high=20)
    got = run_staggered(
        llm, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    assert got == hf_greedy(d, prompts, 10)
    assert llm.llm_engine.runner.graphs_compiled == 3  # the warm-up compiled every graph
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_two_engines_of_one_shape_each_run_their_own_weights(checkpoint_dir):
    """Compiled graphs have no guards and read the model they were compiled from
    (`CompiledForward`): two live engines over same-shaped models with different weights,
    stepped in turn, must each match HF on their own weights, with no recompiles."""
    dirs = [checkpoint_dir("tiny-llama", seed=seed) for seed in (21, 22)]
    kwargs = dict(dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=16, use_tqdm=False)
    llms = [LLM(model=d, max_model_len=64, **kwargs) for d in dirs]
    prompts = make_prompts(3, seed=12, low=2, high=12)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(d, prompts, 6) for d in dirs]
    assert want[0] != want[1]
    for _ in range(2):
        for llm, expected in zip(llms, want, strict=True):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert [o.outputs[0].token_ids for o in outs] == expected
    assert [llm.llm_engine.runner.graphs_compiled for llm in llms] == [2, 2]


def test_compiled_long_random_workload_never_recompiles_and_matches_eager(checkpoint_dir):
    """200+ steps of random arrivals, lengths, shared prefixes and aborts after warm-up."""
    d = checkpoint_dir("tiny-llama")
    kw = dict(
        dtype="float32",
        kv_cache_gib=gib_for_blocks(d, 24, 4),
        block_size=4,
        max_num_batched_tokens=8,
        max_model_len=64,
        use_tqdm=False,
    )
    compiled = LLM(model=d, **kw).llm_engine
    rng = random.Random(0)
    shared = make_prompts(1, seed=12, low=9, high=10)[0]
    prompts = [
        (shared if rng.random() < 0.4 else []) + p
        for p in make_prompts(64, seed=13, low=1, high=24)
    ]
    lengths = [rng.randint(1, 16) for _ in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    graphs = compiled.runner.graphs_compiled
    done, aborted, steps = drive_random(
        compiled, prompts, params, rng, lambda: int(rng.random() < 0.3), abort_prob=0.05
    )
    assert compiled.runner.graphs_compiled == graphs
    assert steps >= 200
    assert compiled.scheduler.num_preemptions > 0
    assert compiled.block_manager.num_free_blocks == compiled.block_manager.num_usable_blocks
    eager = LLM(model=d, compile=False, **kw)
    keep = sorted(int(i) for i in done)
    want = eager.generate(
        [{"prompt_token_ids": prompts[i]} for i in keep], [params[i] for i in keep], use_tqdm=False
    )
    assert [done[str(i)][0] for i in keep] == [o.outputs[0].token_ids for o in want]
    assert len(keep) + len(aborted) == len(prompts)


_CHILD = textwrap.dedent("""
    import json, sys
    from torch._dynamo.utils import counters
    from ember import LLM, SamplingParams
    from ember.tools.bench import count_vec_isa_probes
    probes = count_vec_isa_probes()
    llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_gib=0.01, block_size=4,
              max_num_batched_tokens=8, max_model_len=64, compile_cache_dir=sys.argv[2],
              use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]},
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.runner
    print(json.dumps({"hit": llm.llm_engine.compile_cache_hit,
                      "tokens": out[0].outputs[0].token_ids,
                      "compiled": runner.graphs_compiled,
                      "loaded": runner.graphs_loaded,
                      "traced": counters["stats"]["unique_graphs"],
                      "isa_probes": len(probes)}))
""")


class _WarmupCache:
    """`ember warmup` and engines in fresh processes over one default compile cache."""

    def __init__(self, model: str, tmp_path) -> None:
        self.model = model
        self.cache_dir = str(tmp_path / "xdg" / "ember" / "compile")
        self.env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "default_inductor"))
        self.env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), EMBER_DISABLE_COMPILE_CACHE="0")

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=900,
            env=self.env,
            check=True,
        )

    def warmup(self, block_size: int) -> subprocess.CompletedProcess:
        return self.run(
            "-m", "ember.cli", "warmup", "--model", self.model, "--dtype", "float32",
            "--kv-cache-gib", "0.01", "--block-size", str(block_size),
            "--max-num-batched-tokens", "8", "--max-model-len", "64",
        )  # fmt: skip

    def serve(self) -> dict:
        child = self.run("-c", _CHILD, self.model, "auto")
        return json.loads(child.stdout.strip().splitlines()[-1]) | {"log": child.stderr}


@pytest.mark.slow  # two fresh processes, one compiling (~70 s); the cache's hit and miss in
# the default run: test_graphs_compiled_for_one_vector_isa_are_not_served_to_another, and
# tests/kernels/test_fast_calls.py's compiled graphs kept out of other processes' caches
def test_compile_cache_round_trip_ember_warmup_then_engine(checkpoint_dir, tmp_path):
    """`ember warmup` fills the default compile cache, which an engine uses unless told
    otherwise (`compile_cache_dir="auto"`, as vLLM caches by default)."""
    cache = _WarmupCache(checkpoint_dir("tiny-qwen2"), tmp_path)
    warm = cache.warmup(block_size=4)
    assert "2 graphs (static token buckets [1] + one dynamic) compiled and saved" in warm.stdout
    assert f"cache dir {cache.cache_dir}" in warm.stdout
    served = cache.serve()
    assert served["hit"] and served["loaded"] == 2
    assert served["compiled"] == 0 and served["traced"] == 0  # a warm start traces nothing
    # nor loads the vector-ISA test libraries again that loaded in the entry's build (~1 s)
    assert served["isa_probes"] == 0
    # The cache holds code the engine loads: created private.
    assert stat.S_IMODE(os.stat(cache.cache_dir).st_mode) == 0o700


@pytest.mark.slow  # three more processes, two of them compiling (~45 s)
def test_compile_cache_misses_on_another_shape_and_is_refused_once_others_can_write(
    checkpoint_dir, tmp_path
):
    """A warm start gives the tokens of the first; a different engine shape misses, says why
    in one line, and compiles normally; a cache dir others can write to is refused."""
    cache = _WarmupCache(checkpoint_dir("tiny-qwen2"), tmp_path)
    cache.warmup(block_size=4)
    served = cache.serve()
    assert served["hit"] and cache.serve()["tokens"] == served["tokens"]
    other = cache.warmup(block_size=8)
    assert "differs in block_size" in other.stderr and "compiled and saved" in other.stdout
    os.chmod(cache.cache_dir, 0o777)
    refused = cache.serve()
    assert (
        "not using compile cache" in refused["log"]
        and "writable by group or others" in (refused["log"])
    )
    assert not refused["hit"] and refused["loaded"] == 0 and refused["compiled"] == 2
    x86 = platform.machine() in ("x86_64", "AMD64")
    assert refused["isa_probes"] > 0 or not x86  # compiling, inductor probes as always
    assert refused["tokens"] == served["tokens"]


def test_frozen_graphs_match_eager(checkpoint_dir):
    """`freeze_weights`: weights folded into the graphs, which torch.compile dispatches itself."""
    d = checkpoint_dir("tiny-llama")
    kw = dict(dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=8, max_model_len=64)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, seed=14, low=2, high=12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    frozen = LLM(model=d, freeze_weights=True, use_tqdm=False, **kw)
    eager = LLM(model=d, compile=False, **kw)
    got = [o.outputs[0].token_ids for o in frozen.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert frozen.llm_engine.runner.graphs_compiled == 2


_TASK_CHILD = textwrap.dedent("""
    import json, sys
    from ember import LLM, SamplingParams
    kind, d, cache = sys.argv[1:4]
    llm = LLM(model=d, dtype="float32", kv_cache_gib=0.01, block_size=4,
              max_num_batched_tokens=16, compile_cache_dir=cache, use_tqdm=False)
    if kind == "bart":
        prompt = {"encoder_prompt": {"prompt_token_ids": [5, 6, 7, 8]},
                  "decoder_prompt": {"prompt_token_ids": [2]}}
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        result = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    else:
        out = llm.embed([{"prompt_token_ids": [5, 6, 7, 8, 9]}], use_tqdm=False)
        result = out[0].outputs.embedding
    runner = llm.llm_engine.runner
    flat = sum(hasattr(g, "__wrapped__") for _, f in runner.forwards.compiled()
               for g in f.graphs.values())
    print(json.dumps({"hit": llm.llm_engine.compile_cache_hit, "result": result,
                      "compiled": runner.graphs_compiled, "loaded": runner.graphs_loaded,
                      "flat": flat}))
""")


@pytest.mark.slow  # ~25 s each; the decoder-only round trip runs by default
@pytest.mark.parametrize("kind", ["bart", "bert"])
def test_compile_cache_round_trip_encoder_decoder_and_embedding(kind, tmp_path):
    """The encoder pass and the embedding graphs load from the cache like a decoder's: a second
    process compiles nothing and gives the same result."""
    from tests.conftest import build_tiny_bart, build_tiny_bert

    d = str(tmp_path / kind)
    build_tiny_bart(d, 200) if kind == "bart" else build_tiny_bert(d)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "default_inductor"))
    args = [sys.executable, "-c", _TASK_CHILD, kind, d, str(tmp_path / "cache")]

    def run() -> dict:
        out = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    graphs = 4 if kind == "bart" else 2  # (static bucket + dynamic) x (decoder [+ encoder])
    assert (cold["hit"], cold["compiled"], cold["loaded"]) == (False, graphs, 0)
    assert (warm["hit"], warm["compiled"], warm["loaded"]) == (True, 0, graphs)
    assert cold["flat"] == warm["flat"] == graphs  # `flat_call`s, compiled or loaded
    assert warm["result"] == cold["result"]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-bart"])
def test_one_token_step_runs_the_lm_head_on_one_row(checkpoint_dir, tmp_path, family):
    """A batch-1 decode pads `logits_indices` to two rows (`MIN_DYNAMIC_SIZE`): the head runs on
    the one hidden row and its logits are gathered (`capture._one_token`), while larger steps
    run it on the indexed rows only; greedy output still matches HF."""
    if family == "tiny-bart":
        from tests.conftest import build_tiny_bart

        d = build_tiny_bart(str(tmp_path / "bart"), vocab_size=96)
        vocab = 96
    else:
        d, vocab = checkpoint_dir(family), 500
    llm = LLM(model=d, dtype="float32", compile=False, kv_cache_gib=0.01, use_tqdm=False)
    rows = []
    head = llm.llm_engine.runner.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[-2]))
    prompt = make_prompts(1, seed=3, low=5, high=6, vocab=vocab)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    hook.remove()
    assert rows[-3:] == [1, 1, 1]  # the three decode steps
    assert rows[0] <= 2  # the prefill: its last row (and a padding row), not all 5
    if family == "tiny-llama":
        assert out == hf_greedy(d, [prompt], 4)[0]


_COMPILE_ODD_WIDTHS = """
import torch
from ember.host import isa as host
from ember.compile.inductor import compile_settings

def step(a, b):  # rows of 40 and 96 floats: whole 8-lane vectors, not 16-lane ones
    return torch.cat([a[:, 96:136] * 2, b[:, :96] * b[:, 96:]], dim=1)

torch.manual_seed(0)
a, b = torch.randn(5, 136), torch.randn(5, 192)
with torch.inference_mode(), compile_settings(freezing=False):
    got = torch.compile(step, fullgraph=True, dynamic=False)(a, b)
assert torch.equal(got, step(a, b)), (got - step(a, b)).abs().max()
print(host.host_isa(), torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.one_host("it starts a process of each ISA itself")
def test_graphs_compiled_for_one_vector_isa_are_not_served_to_another(tmp_path):
    """Torch's FX graph cache keys a graph without the vector ISA inductor generated it for:
    without ember's tag (`compile_settings` adds ATen's capability to `cache_key_tag`), an
    AVX-512 process was served an AVX2 process's code from the shared inductor cache, built it
    with AVX-512 flags and wrote past its buffers (heap corruption), and the other way round
    left half of each row unwritten."""
    from ember.host.isa import beyond_avx2

    if not beyond_avx2():
        pytest.skip("this CPU has no vector ISA past AVX2 to mix with it")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("EMBER_CPU_ISA", None)
    for isa in ("avx2", "native"):  # without the tag: the second corrupted its heap
        run = subprocess.run(
            [sys.executable, "-c", _COMPILE_ODD_WIDTHS],
            env=dict(env, EMBER_CPU_ISA=isa),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, (isa, run.stderr[-3000:])
        assert run.stdout.split()[0] == isa
