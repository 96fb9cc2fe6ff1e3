"""Multi-LoRA generation against peft's PeftModel (fp32 greedy, token-identical): batches that
mix three adapters and the base model, chunked prefill, prefix-cache hits, LRU slot swaps with
zero recompiles, and adapters that do not fit failing their own request only."""

from __future__ import annotations

import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from ember import LLM, LoRARequest, SamplingParams
from ember.tools.checkpoints import build_checkpoint
from tests.conftest import make_prompts
from tests.host_isa import needs_fp32_math

MAX_NEW = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def make_adapter(base: str, dest: str, seed: int, rank: int, targets: list[str], **kw) -> str:
    """A PEFT adapter with random (non-zero) A and B, saved by peft's save_pretrained."""
    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=rank, lora_alpha=16, target_modules=targets, init_lora_weights=False, **kw),
    )
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def setup(checkpoint_dir, tmp_path_factory):
    base = checkpoint_dir("tiny-llama")
    root = tmp_path_factory.mktemp("adapters")
    loras = [
        LoRARequest("qv", 1, make_adapter(base, str(root / "qv"), 1, 8, ["q_proj", "v_proj"])),
        LoRARequest("all", 2, make_adapter(base, str(root / "all"), 2, 16, ALL)),
        LoRARequest(
            "rs",
            3,
            make_adapter(base, str(root / "rs"), 3, 4, ["o_proj", "down_proj"], use_rslora=True),
        ),
    ]
    return base, loras


def peft_greedy(
    base: str, lora: LoRARequest | None, prompt: list[int], dtype: torch.dtype | str = "auto"
) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora.lora_path)
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _mixed_batch(loras, num: int = 8):
    prompts = make_prompts(num, seed=3, low=5, high=40)
    # The same 20-token prefix twice per adapter: the second one hits the prefix cache.
    prompts[4] = prompts[0][:20] + prompts[4][:5] if len(prompts[0]) >= 20 else prompts[4]
    chosen = [loras[0], None, loras[1], loras[2], loras[0], None, loras[2], loras[1]][:num]
    return prompts, chosen


def _eager_lora_llm(base: str, **kw) -> LLM:
    """An uncompiled fp32 engine with rank-16 adapter slots and 4-token blocks (prefix hits on
    short prompts)."""
    args = dict(compile=False, dtype="float32", kv_cache_gib=0.01, block_size=4)
    return LLM(model=base, enable_lora=True, max_lora_rank=16, **(args | kw))


def test_mixed_adapters_and_base_match_peft(setup):
    base, loras = setup
    prompts, chosen = _mixed_batch(loras)
    want = [peft_greedy(base, lora, p) for lora, p in zip(chosen, prompts, strict=True)]
    assert len({tuple(w) for w in want}) == len(want)
    llm = _eager_lora_llm(base, max_num_batched_tokens=16, max_loras=2)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=chosen, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    engine = llm.llm_engine
    assert engine.lora.num_swaps > 3  # 3 adapters through 2 slots
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks
    # Prefix caching: the same prompt hits with its own adapter, never across adapters.
    p = prompts[0]
    again = llm.generate(
        [{"prompt_token_ids": p}] * 3,
        GREEDY,
        use_tqdm=False,
        lora_request=[loras[0], loras[1], None],
    )
    assert again[0].num_cached_tokens > 0
    assert again[0].outputs[0].token_ids == want[0]
    assert again[1].outputs[0].token_ids == peft_greedy(base, loras[1], p)
    assert again[2].outputs[0].token_ids == peft_greedy(base, None, p)


def test_adapter_swaps_never_recompile(setup):
    base, loras = setup
    prompts, chosen = _mixed_batch(loras, 6)
    want = [peft_greedy(base, lora, p) for lora, p in zip(chosen, prompts, strict=True)]
    llm = LLM(
        model=base,
        dtype="float32",
        kv_cache_gib=0.01,
        block_size=4,
        max_num_batched_tokens=32,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    graphs = counters["stats"]["unique_graphs"]
    for lora, p, w in zip(chosen, prompts, want, strict=True):  # one at a time: a swap per change
        out = llm.generate({"prompt_token_ids": p}, GREEDY, lora_request=lora, use_tqdm=False)
        assert out[0].outputs[0].token_ids == w
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=chosen, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    assert counters["stats"]["unique_graphs"] == graphs
    assert llm.llm_engine.runner.graphs_compiled == len(llm.llm_engine.runner.graph_sizes)
    assert llm.llm_engine.lora.num_swaps >= 3


def test_bad_adapters_fail_their_request_only(setup, tmp_path):
    base, loras = setup
    too_big = make_adapter(base, str(tmp_path / "big"), 4, 32, ["q_proj"])
    head = make_adapter(base, str(tmp_path / "head"), 5, 4, ["lm_head"])
    other_base = build_checkpoint(str(tmp_path / "other-base"), "tiny-llama", hidden_size=32)
    other = make_adapter(other_base, str(tmp_path / "other"), 6, 4, ["q_proj"])
    llm = LLM(
        model=base,
        compile=False,
        dtype="float32",
        kv_cache_gib=0.01,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    bad = {
        "max_lora_rank=16": LoRARequest("big", 11, too_big),
        "not one ember can adapt": LoRARequest("head", 12, head),
        "a different base model": LoRARequest("other", 13, other),
        "adapter_config.json": LoRARequest("missing", 14, str(tmp_path / "nowhere")),
    }
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    for message, lora in bad.items():
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)
    outs = llm.generate(
        [prompt] * 3,
        GREEDY,
        raise_on_error=False,
        use_tqdm=False,
        lora_request=[loras[0], bad["max_lora_rank=16"], None],
    )
    assert outs[1].error is not None and "max_lora_rank" in outs[1].error
    assert outs[0].outputs[0].token_ids == peft_greedy(base, loras[0], [5, 6, 7, 8])
    assert outs[2].outputs[0].token_ids == peft_greedy(base, None, [5, 6, 7, 8])
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.block_manager.num_usable_blocks


def test_unreadable_adapters_are_value_errors_naming_the_adapter(setup, tmp_path):
    """A truncated safetensors file, bad JSON, a missing or zero `r` raise AdapterError (a
    ValueError naming the adapter), not SafetensorError / JSONDecodeError / KeyError /
    ZeroDivisionError, and no request of the call is left queued."""
    import json
    import shutil

    base, loras = setup
    src = loras[0].lora_path

    def broken(name: str, edit) -> LoRARequest:
        d = str(tmp_path / name)
        shutil.copytree(src, d)
        edit(d)
        return LoRARequest(name, 20 + len(name), d)

    def truncate(d: str) -> None:
        w = f"{d}/adapter_model.safetensors"
        with open(w, "r+b") as f:
            f.truncate(os.path.getsize(w) // 2)

    def set_config(**changes):
        def edit(d: str) -> None:
            with open(f"{d}/adapter_config.json") as f:
                cfg = json.load(f)
            cfg.update(changes)
            cfg.pop("r") if changes.get("r") == "drop" else None
            with open(f"{d}/adapter_config.json", "w") as f:
                json.dump(cfg, f)

        return edit

    def bad_json(d: str) -> None:
        with open(f"{d}/adapter_config.json", "w") as f:
            f.write("{not json")

    llm = _eager_lora_llm(base)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    for lora in (
        broken("trunc", truncate),
        broken("badjson", bad_json),
        broken("no_r", set_config(r="drop")),
        broken("zero_r", set_config(r=0)),
    ):
        with pytest.raises(ValueError, match=repr(lora.lora_name)):
            llm.generate([prompt, prompt], GREEDY, lora_request=[None, lora], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.block_manager.num_usable_blocks


def test_add_remove_list_loras_and_disabled_engine(setup, checkpoint_dir):
    base, loras = setup
    llm = LLM(model=base, compile=False, dtype="float32", kv_cache_gib=0.01, enable_lora=True)
    assert llm.list_loras() == []
    assert llm.add_lora(loras[0]) and llm.add_lora(loras[1])
    assert [r.lora_int_id for r in llm.list_loras()] == [1, 2]
    with pytest.raises(ValueError, match="already"):
        llm.add_lora(LoRARequest("clash", 1, loras[1].lora_path))
    assert llm.remove_lora(1) and not llm.remove_lora(1)
    assert [r.lora_name for r in llm.list_loras()] == ["all"]
    plain = LLM(model=base, compile=False, dtype="float32", kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=loras[0])
    with pytest.raises(ValueError, match="lora_int_id must be a positive int"):
        LoRARequest("zero", 0, loras[0].lora_path)


def test_a_different_adapter_under_a_reused_id_never_reads_the_old_ones_cached_kv(setup):
    """Remove adapter id 1 and add another adapter under id 1: the same prompt must not hit the
    prefix-cache blocks the first adapter computed (the cache salt carries the load
    digest, not just the id)."""
    base, loras = setup
    llm = _eager_lora_llm(base)
    prompt = make_prompts(1, seed=11, low=24, high=25)[0]
    first = LoRARequest("first", 1, loras[0].lora_path)
    second = LoRARequest("second", 1, loras[1].lora_path)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=first, use_tqdm=False)
    assert out[0].outputs[0].token_ids == peft_greedy(base, loras[0], prompt)
    assert llm.remove_lora(1)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=second, use_tqdm=False)
    assert out[0].num_cached_tokens == 0
    assert out[0].outputs[0].token_ids == peft_greedy(base, loras[1], prompt)
    # The same adapter again still hits its own blocks.
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=second, use_tqdm=False)
    assert out[0].num_cached_tokens > 0
    assert out[0].outputs[0].token_ids == peft_greedy(base, loras[1], prompt)


def test_lora_on_bf16_weights_with_fp32_math_matches_peft(checkpoint_dir, tmp_path):
    """A bf16 checkpoint on a CPU without native bf16 math (an AVX2-only host: this test's
    [avx2-host] run): the LoRA wrappers sit on the bf16 GEMV linears and the math is fp32,
    token-identical to PEFT on the fp32 model."""
    needs_fp32_math()
    base = checkpoint_dir("tiny-llama", dtype=torch.bfloat16)
    adapter = make_adapter(base, str(tmp_path / "all"), 2, 16, ALL)
    prompt = make_prompts(1, seed=8)[0]
    kw = dict(compile=False, enable_lora=True, kv_cache_gib=0.01, max_model_len=128)
    with LLM(model=base, use_tqdm=False, **kw) as llm:
        assert (llm.config.weight_dtype, llm.config.dtype) == (torch.bfloat16, torch.float32)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        out = llm.generate(
            [{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("all", 1, adapter)
        )
    tokens = out[0].outputs[0].token_ids
    # PEFT on the same (bf16-valued) weights in fp32
    assert tokens == peft_greedy(base, LoRARequest("all", 1, adapter), prompt, torch.float32)
