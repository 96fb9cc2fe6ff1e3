"""The prefix cache's disk tier end to end: a restarted engine reads a prompt's blocks back
from `prefix_cache_dir` and decodes exactly what a cold engine decodes (tokens and logprobs),
for each KV cache dtype, a sliding-window model, LoRA adapters and a compiled engine; whatever
changes the K/V (weights, dtype, KV dtype, adapter) misses."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ember import LLM, LoRARequest, SamplingParams, cli
from ember.serve.metrics import EngineMetrics
from tests.conftest import make_prompts

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
EAGER = dict(compile=False, dtype="float32", kv_cache_gib=0.01, block_size=4, use_tqdm=False)


def run(model: str, prompt: list[int], directory, lora=None, times: int = 1, **kw):
    """One engine's output for `prompt` (a list of `times` outputs, one run after the other,
    where `times` > 1), and its disk tier's counters."""
    with LLM(model=model, prefix_cache_dir=str(directory), **(EAGER | kw)) as llm:
        outs = [
            llm.generate({"prompt_token_ids": prompt}, PARAMS, lora_request=lora)[0]
            for _ in range(times)
        ]
        stats = llm.llm_engine.prefix_store.stats
    return outs[0] if times == 1 else outs, stats


def same_output(a, b) -> None:
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].logprobs == b.outputs[0].logprobs  # exactly: the same K/V bits


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
def test_restart_reads_the_prefix_from_disk_and_decodes_as_cold(checkpoint_dir, tmp_path, kv):
    model = checkpoint_dir("tiny-llama")
    prompt = make_prompts(1, seed=4, low=38, high=39)[0]
    cold, written = run(model, prompt, tmp_path / "pc", kv_cache_dtype=kv)
    assert cold.num_cached_tokens == 0 and written.blocks_written >= 9
    warm, read = run(model, prompt, tmp_path / "pc", kv_cache_dtype=kv)
    assert warm.num_cached_tokens == 36  # every full block but the one with the last token
    assert read.hits == 9 and read.errors == 0 and read.blocks_written <= 3
    same_output(cold, warm)


def test_sliding_window_model_restarts_exactly(checkpoint_dir, tmp_path):
    model = checkpoint_dir("tiny-mistral", sliding_window=8)
    prompt = make_prompts(1, seed=5, low=40, high=41)[0]
    cold, _ = run(model, prompt, tmp_path / "pc")
    warm, read = run(model, prompt, tmp_path / "pc")
    assert warm.num_cached_tokens == 36 and read.hits == 9
    same_output(cold, warm)


def test_changed_weights_dtype_or_kv_dtype_miss(checkpoint_dir, tmp_path):
    model = checkpoint_dir("tiny-llama")
    prompt = make_prompts(1, seed=6, low=30, high=31)[0]
    run(model, prompt, tmp_path / "pc")
    for kw in ({"kv_cache_dtype": "bfloat16"}, {"dtype": "bfloat16"}):
        out, stats = run(model, prompt, tmp_path / "pc", **kw)
        assert out.num_cached_tokens == 0 and stats.hits == 0, kw
    copy = str(tmp_path / "copy")
    shutil.copytree(model, copy)
    out, _ = run(copy, prompt, tmp_path / "pc")  # the same bytes at another path: a miss
    assert out.num_cached_tokens == 0
    _, stats = run(copy, prompt, tmp_path / "pc")
    assert stats.hits > 0
    weights = os.path.join(copy, "model.safetensors")
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place
    out, stats = run(copy, prompt, tmp_path / "pc")
    assert out.num_cached_tokens == 0 and stats.hits == 0


def test_lora_blocks_are_keyed_by_the_adapter(checkpoint_dir, tmp_path):
    from tests.lora.test_lora_e2e import ALL, make_adapter

    model = checkpoint_dir("tiny-llama")
    a = LoRARequest("a", 1, make_adapter(model, str(tmp_path / "a"), 1, 8, ALL))
    b = LoRARequest("b", 1, make_adapter(model, str(tmp_path / "b"), 2, 8, ALL))
    kw = dict(enable_lora=True, max_lora_rank=8)
    prompt = make_prompts(1, seed=7, low=30, high=31)[0]
    (cold_a, hit_a), _ = run(model, prompt, tmp_path / "pc", a, times=2, **kw)
    warm_a, read = run(model, prompt, tmp_path / "pc", a, **kw)
    assert warm_a.num_cached_tokens == 28 and read.hits == 7
    # With an adapter, a prefix hit in memory already moves logprobs by ~1e-7 (the LoRA
    # GEMMs round differently for 2 rows than for 30): the restart equals the in-memory
    # hit bit for bit, and the cold run token for token.
    same_output(hit_a, warm_a)
    assert warm_a.outputs[0].token_ids == cold_a.outputs[0].token_ids
    # another adapter under the same id, and the base model: neither reads adapter a's K/V
    cold_b, stats = run(model, prompt, tmp_path / "pc", b, **kw)
    assert cold_b.num_cached_tokens == 0 and stats.hits == 0
    assert cold_b.outputs[0].token_ids != cold_a.outputs[0].token_ids
    base, stats = run(model, prompt, tmp_path / "pc", None, **kw)
    assert base.num_cached_tokens == 0 and stats.hits == 0


def test_compiled_engine_restarts_from_disk_with_no_recompile(checkpoint_dir, tmp_path):
    """The compiled representative: the blocks read back feed the same graphs."""
    model = checkpoint_dir("tiny-llama")
    prompt = make_prompts(1, seed=8, low=45, high=46)[0]
    kw = dict(EAGER, compile=True, compile_cache_dir=str(tmp_path / "cc"))
    outs = []
    for times in (2, 1):
        with LLM(model=model, prefix_cache_dir=str(tmp_path / "pc"), **kw) as llm:
            with torch.compiler.set_stance("fail_on_recompile"):
                for _ in range(times):
                    outs.append(llm.generate({"prompt_token_ids": prompt}, PARAMS)[0])
            metrics = EngineMetrics()
            metrics.step(llm.llm_engine)
    cold, hit, restart = outs
    assert hit.num_cached_tokens == restart.num_cached_tokens == 44
    # A hit runs the last tokens in another graph than the cold prompt's (rounding moves
    # logprobs by ~1e-7): the restart equals the in-memory hit bit for bit.
    same_output(hit, restart)
    assert restart.outputs[0].token_ids == cold.outputs[0].token_ids
    hits = metrics.registry.get_sample_value("ember_prefix_cache_disk_hits_total")
    assert hits == 11
    assert metrics.registry.get_sample_value("ember_prefix_cache_disk_bytes_read_total") > 0


def test_save_prefix_then_a_new_engine_starts_warm(checkpoint_dir, tmp_path):
    model = checkpoint_dir("tiny-llama")
    system = make_prompts(1, seed=9, low=26, high=27)[0]
    with LLM(model=model, prefix_cache_dir=str(tmp_path / "pc"), **EAGER) as llm:
        assert llm.save_prefix({"prompt_token_ids": system}) == [24]
        assert llm.llm_engine.prefix_store.stats.blocks_written == 6
    question = system + [7, 8, 9]
    out, stats = run(model, question, tmp_path / "pc")
    assert out.num_cached_tokens == 24 and stats.hits == 6
    with LLM(model=model, **EAGER) as llm, pytest.raises(ValueError, match="prefix_cache_dir"):
        llm.save_prefix("hello")


def test_ember_generate_twice_reads_the_prompt_back(checkpoint_dir, tmp_path, capsys):
    model = checkpoint_dir("tiny-llama")
    args = ["generate", "--model", model, "--no-compile", "--dtype", "float32",
            "--kv-cache-gib", "0.01", "--block-size", "4", "--max-tokens", "4",
            "--prefix-cache-dir", str(tmp_path / "pc"), "--prompt", "a b c d e f g h i j k"]  # fmt: skip
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    assert cli.main(args) == 0
    second = capsys.readouterr().out
    assert "0 prompt tokens cached, 0 blocks read" in first
    assert " 0 blocks read" not in second and "prompt tokens cached" in second
    text = [line for line in first.splitlines() if line.startswith("'")]
    assert text and text == [line for line in second.splitlines() if line.startswith("'")]


def test_a_restarted_server_reads_the_prefix_back(checkpoint_dir, tmp_path):
    """`ember serve` twice on one directory (each stopped as a server stops): the second
    answers the same prompt with it cached (usage's cached tokens, the disk counters)."""
    import openai

    from ember.runtime.config import EngineArgs
    from ember.runtime.engine import LLMEngine
    from ember.serve.async_engine import AsyncLLMEngine
    from ember.serve.server import build_app
    from tests.e2e.servers import metrics, serve_in_thread

    model = checkpoint_dir("tiny-llama")
    kw = {k: v for k, v in EAGER.items() if k != "use_tqdm"}
    args = EngineArgs(model=model, prefix_cache_dir=str(tmp_path / "pc"), **kw)
    prompt = make_prompts(1, seed=10, low=30, high=31)[0]
    answers = []
    for _ in range(2):
        engine = AsyncLLMEngine(LLMEngine.from_config(args.create_engine_config(), False))
        with serve_in_thread(build_app(engine, "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            answers.append(client.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2
            ))  # fmt: skip
            counters = metrics(url)
        engine.shutdown()
    cold, warm = answers
    assert warm.choices[0].text == cold.choices[0].text
    assert warm.usage.prompt_tokens_details.cached_tokens == 28
    assert counters["ember_prefix_cache_disk_hits_total"] == 7
