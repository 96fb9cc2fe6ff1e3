"""`background_compile`: a cold engine answers at once on the eager path while its graphs
compile in forked workers, and switches each graph in between steps; a request that spans the
switch gets the same greedy tokens as an engine that never compiled (and as one that did)."""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from tests.conftest import make_prompts

KW = dict(dtype="float32", kv_cache_gib=0.02, max_model_len=128, compile_cache_dir=None)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("regional", [False, True], ids=["whole-graphs", "regions"])
def test_a_request_spanning_the_switch_gets_the_same_tokens(checkpoint_dir, regional):
    """Regions too (`ember serve` compiles in the background by default, and the default
    model compiles by regions): the eager steps run the layers through the region calls."""
    d = checkpoint_dir("tiny-llama")
    prompts = [{"prompt_token_ids": p} for p in make_prompts(2, seed=5, low=4, high=12)]
    with LLM(model=d, compile=False, **KW) as eager:
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model=d, background_compile=True, regional_compile=regional, **KW) as llm:
        engine = llm.llm_engine
        runner = engine.runner
        assert runner.regions is regional
        step = runner.forwards.step
        assert runner.background is not None and not step.graphs  # nothing compiled yet
        engine.add_request("spans", prompts[0], GREEDY)
        got: list[int] = []
        for _ in range(4):  # the prefill and 3 decodes, eagerly
            for out in engine.step():
                got = list(out.outputs[0].token_ids)
        assert not step.graphs and 0 < len(got) < 24
        runner.wait_for_graphs()  # between two steps of the request: the switch
        assert runner.background is None and set(step.graphs) == {"tokens1", "dynamic"}
        compiled = runner.graphs_compiled
        while engine.has_unfinished_requests():
            for out in engine.step():
                got = list(out.outputs[0].token_ids)
        assert got == want[0]
        # After the switch: compiled graphs serve every step, and nothing compiles again.
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert runner.graphs_compiled == compiled
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks


def test_closing_an_engine_while_it_compiles_stops_the_workers(checkpoint_dir):
    from tests.compiler.test_compile_workers import _children

    before = _children()
    llm = LLM(model=checkpoint_dir("tiny-llama"), background_compile=True, **KW)
    workers = _children() - before
    assert workers  # compiling in forked workers
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # eagerly
    llm.close()
    assert not (_children() - before)


def test_background_compile_needs_compile(checkpoint_dir):
    from ember.runtime.config import EngineArgs

    d = checkpoint_dir("tiny-llama")
    for bad in (dict(compile=False), dict(freeze_weights=True, compile_cache_dir=None)):
        args = EngineArgs(model=d, background_compile=True, **bad)
        with pytest.raises(ValueError, match="background_compile=True needs compile=True"):
            args.create_engine_config()
