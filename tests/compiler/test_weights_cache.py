"""A checkpoint's model, as the loader built it (fused, packed, quantized), is kept in ember's
weights cache and mapped back by the next load of the same checkpoint with the same settings
(`ember.model.packed_cache`; the GGUF side is tested in tests/e2e/test_gguf.py)."""

from __future__ import annotations

import os

import pytest
import torch

from ember import LLM, SamplingParams
from ember.host.memory import in_file_map
from ember.model import packed_cache
from ember.tools.checkpoints import build_tiny_mllama
from tests.conftest import build_tiny_bart, build_tiny_bert, make_prompts

KW = dict(compile=False, kv_cache_gib=0.01, max_model_len=96, use_tqdm=False)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _entries(root) -> list[str]:
    directory = root / "ember" / "weights"
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def _build(kind: str, root, checkpoint_dir) -> tuple[str, dict]:
    """(checkpoint dir, LLM arguments) of each kind of load the cache keeps."""
    if kind == "fp32":
        return checkpoint_dir("tiny-llama"), {}
    if kind == "narrow":  # bf16 weights under fp32 math: widened norms, a widening hook
        return checkpoint_dir("tiny-qwen2", dtype=torch.bfloat16), {"dtype": "float32"}
    if kind in ("int8", "int4"):
        return checkpoint_dir("tiny-llama", dtype=torch.bfloat16), {"quantization": kind}
    if kind == "bart":
        return build_tiny_bart(str(root / "bart"), vocab_size=320), {"dtype": "float32"}
    if kind == "bert":
        return build_tiny_bert(str(root / "bert")), {"dtype": "float32"}
    assert kind == "mllama"
    return build_tiny_mllama(str(root / "mllama")), {"dtype": "float32"}


def _run(llm: LLM, kind: str) -> list:
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, seed=5, low=3, high=20, vocab=300)]
    if kind == "bert":
        return [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    if kind == "bart":
        prompts = [
            {"encoder_prompt": p, "decoder_prompt": {"prompt_token_ids": [2]}} for p in prompts
        ]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("kind", ["fp32", "narrow", "int8", "int4", "bart", "bert", "mllama"])
def test_a_second_load_maps_the_built_model_back(kind, checkpoint_dir, tmp_path, monkeypatch):
    """The first load writes the model it built; the second maps it back: every weight a view
    of the entry's file, equal to the first load's, the same module types, the same outputs
    (greedy tokens and logprobs, or embeddings)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, args = _build(kind, tmp_path, checkpoint_dir)
    runs = []
    for _ in range(2):
        with LLM(model=path, **args, **KW) as llm:
            model = llm.llm_engine.runner.model
            runs.append((model, _run(llm, kind)))
        packed_cache.wait()
    (first, first_out), (second, second_out) = runs
    assert len(_entries(tmp_path / "cache")) == 1
    assert [type(m) for m in first.modules()] == [type(m) for m in second.modules()]
    want, got = _tensors(first), _tensors(second)
    assert want.keys() == got.keys()
    assert all(in_file_map(t) for t in got.values())
    assert not any(in_file_map(t) for t in want.values())
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert first_out == second_out


def test_the_entry_follows_the_checkpoint_and_the_settings(checkpoint_dir, tmp_path, monkeypatch):
    """Other settings (dtype, quantization) and a changed weight file each get an entry of
    their own; an engine with LoRA slots builds its model afresh and writes none."""
    import shutil

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = shutil.copytree(checkpoint_dir("tiny-llama", dtype=torch.bfloat16), tmp_path / "m")
    root = tmp_path / "cache"

    def load(**args) -> list:
        with LLM(model=str(path), **args, **KW) as llm:
            out = _run(llm, "generate")
        packed_cache.wait()
        return out

    lora = load(enable_lora=True, max_lora_rank=8)
    assert _entries(root) == []
    default = load()
    assert len(_entries(root)) == 1 and load() == default == lora
    load(dtype="float32")
    load(quantization="int8")
    assert len(_entries(root)) == 3
    weights = next(p for p in path.iterdir() if p.suffix == ".safetensors")
    os.utime(weights, ns=(0, 0))  # a changed file: its own entry, the same model
    assert load() == default and len(_entries(root)) == 4


def test_the_sources_fingerprint_covers_the_kernel_headers(tmp_path, monkeypatch):
    """The weights and compile caches are keyed by ember's sources; the kernels' families live
    in headers (linear_group.h holds the group layouts), so a change to any of them is a new
    fingerprint (a copy of the package with one byte more in each header in turn)."""
    import shutil

    import ember
    from ember import keys

    root = os.path.dirname(os.path.abspath(ember.__file__))
    copy = tmp_path / "ember"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    monkeypatch.setattr(keys, "__file__", str(copy / "keys.py"))
    fingerprint = keys.sources_fingerprint.__wrapped__  # the cached one is per process
    base = fingerprint()
    headers = sorted((copy / "kernels" / "csrc").glob("*.h"))
    assert headers
    for header in headers:
        text = header.read_text()
        header.write_text(text + "\n")
        assert fingerprint() != base, header.name
        header.write_text(text)
    assert fingerprint() == base
