"""Regional compilation (`ember.compile.regions`): each distinct decoder layer is traced once
per graph and reused for the others; graphs stay whole (one per bucket, no graph breaks, no
recompiles) and match HF transformers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

from ember import LLM, SamplingParams
from ember.compile.regions import MIN_LAYERS, decoder_layers, use_regions
from tests.compiler.test_compile import flat_calls
from tests.conftest import hf_greedy, make_prompts
from tests.e2e.test_generate_hf import run_staggered

_HC_LOGGER = "torch._dynamo.variables.invoke_subgraph"


@contextlib.contextmanager
def traced_subgraphs() -> Iterator[list[str]]:
    """The subgraphs Dynamo traces (not reuses) in this process meanwhile, from its
    hierarchical-compile log."""
    traced: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Installing subgraph" in record.getMessage():
                traced.append(record.getMessage())

    handler = Collect(logging.DEBUG)
    torch._logging.set_logs(hierarchical_compile=True)
    logger = logging.getLogger(_HC_LOGGER)
    logger.addHandler(handler)
    try:
        yield traced
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def _engine(model: str, **kwargs: object) -> LLM:
    return LLM(
        model=model,
        dtype="float32",
        kv_cache_gib=0.01,
        block_size=4,
        max_num_batched_tokens=8,
        max_model_len=96,
        token_buckets=(1,),
        use_tqdm=False,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("shape", "kinds"),
    [("tiny-llama", 1), ("tiny-gemma3", 2)],
)
def test_each_layer_kind_is_traced_once_and_the_engine_matches_hf(
    checkpoint_dir, monkeypatch, shape, kinds
):
    """Four layers, one kind (Llama) or two (Gemma 3: sliding-window and global layers, each
    with its rotary table): each of the two graphs (the one-token bucket and the dynamic one)
    traces one subgraph per kind. Greedy tokens equal HF's over staggered mixed steps, with no
    graph break and nothing compiled after warm-up."""
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", "1")  # traced in this process, where we listen
    d = checkpoint_dir(shape, num_hidden_layers=4, initializer_range=0.02)
    breaks_before = sum(counters["graph_break"].values())
    with traced_subgraphs() as traced:
        llm = _engine(d, regional_compile=True)
    runner = llm.llm_engine.runner
    assert runner.regions
    assert runner.graph_sizes == (1, 2)
    assert flat_calls(llm) == 2  # the graphs run without Dynamo's pre-graph bytecode
    assert len(traced) == 2 * kinds, traced
    assert sum(counters["graph_break"].values()) == breaks_before
    prompts = make_prompts(5, seed=3, low=2, high=20)
    got = run_staggered(
        llm, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    assert got == hf_greedy(d, prompts, 10)
    assert runner.graphs_compiled == 2


def test_regional_lora_and_prefix_caching_match_peft(checkpoint_dir, tmp_path):
    """A regional engine with adapter slots: mixed base and adapter requests, two of them on a
    shared cached prefix, equal PEFT's greedy tokens. The adapter slots and the token-to-slot
    map are inputs of the one subgraph, like the base weights; no blocks leak."""
    from ember import LoRARequest
    from tests.lora.test_lora_e2e import ALL, MAX_NEW, make_adapter, peft_greedy

    d = checkpoint_dir("tiny-llama", num_hidden_layers=4)
    lora = LoRARequest("all", 1, make_adapter(d, str(tmp_path / "all"), 2, 8, ALL))
    prompts = make_prompts(4, seed=5, low=5, high=20)
    prompts[3] = prompts[1][:12] + [7, 8]  # the same 12-token prefix as prompts[1], same adapter
    chosen = [None, lora, None, lora]
    llm = _engine(d, regional_compile=True, enable_lora=True, max_lora_rank=8)
    assert llm.llm_engine.runner.regions
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    first = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:3]], params, lora_request=chosen[:3],
        use_tqdm=False,
    )  # fmt: skip
    last = llm.generate(
        [{"prompt_token_ids": prompts[3]}], params, lora_request=[lora], use_tqdm=False
    )
    assert last[0].num_cached_tokens > 0
    got = [o.outputs[0].token_ids for o in [*first, *last]]
    assert got == [peft_greedy(d, r, p) for r, p in zip(chosen, prompts, strict=True)]
    engine = llm.llm_engine
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks


def test_regions_by_default_from_min_layers_and_only_where_they_apply(checkpoint_dir):
    """`regional_compile=None` compiles by regions from `MIN_LAYERS` decoder layers; models
    whose layers cross-attend, and engines that cannot (frozen weights), keep whole graphs,
    and asking for regions there is a ValueError naming the field."""
    from transformers import AutoModelForCausalLM, BartConfig, BartForConditionalGeneration

    shallow = AutoModelForCausalLM.from_pretrained(checkpoint_dir("tiny-llama"))
    assert len(decoder_layers(shallow)) == 2
    assert not use_regions(shallow, None)
    assert use_regions(shallow, True)
    deep_dir = checkpoint_dir("tiny-llama", num_hidden_layers=MIN_LAYERS)
    deep = AutoModelForCausalLM.from_pretrained(deep_dir)
    assert use_regions(deep, None)
    assert not use_regions(deep, None, supported=False)
    with pytest.raises(ValueError, match="regional_compile=True"):
        use_regions(deep, True, supported=False)
    bart = BartForConditionalGeneration(
        BartConfig(
            vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32,
        )
    )  # fmt: skip
    assert decoder_layers(bart.model.decoder) is None  # self- and cross-attention per layer
    with pytest.raises(ValueError, match="regional_compile=True: .*no repeated decoder layers"):
        use_regions(bart.model.decoder, True)
    with pytest.raises(ValueError, match="regional_compile=True"):
        LLM(model=deep_dir, freeze_weights=True, compile_cache_dir=None, regional_compile=True)
