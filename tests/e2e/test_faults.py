"""Faults in the middle of a step: a failed step leaves nothing in the prefix cache that was
not written, holds no blocks and leaves the engine usable; a request whose logits are NaN/inf
fails alone; calls from two threads never mix. Every later output is compared with a clean
run of the same engine configuration (fp32 greedy, token-identical)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember import LLM, LoRARequest, SamplingParams
from tests.conftest import build_tiny_bart, make_prompts
from tests.lora.test_lora_e2e import make_adapter

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHARED = list(range(10, 42))  # a 32-token prefix: eight 4-token blocks


class Fault(RuntimeError):
    pass


def _eager(base: str, **kw) -> LLM:
    args = dict(compile=False, dtype="float32", kv_cache_gib=0.02, block_size=4, use_tqdm=False)
    return LLM(model=base, **(args | kw))


def _inject(llm: LLM, should_fail, exc: type[BaseException] = Fault) -> list[int]:
    """Make the runner raise `exc` whenever `should_fail()` is True: before the forward, or
    (every other failure) from inside it after its first decoder layer wrote its K/V. Returns
    a list that counts the failures."""
    runner = llm.llm_engine.runner
    failures: list[int] = []
    run = type(runner)._run.__get__(runner)  # the unpatched method: injections never nest

    def faulty_run(batch, forward):
        if should_fail():
            failures.append(1)
            if len(failures) % 2:
                raise exc("injected fault before the forward")
            layer = runner.model.model.layers[1]
            handle = layer.register_forward_pre_hook(
                lambda *_: (_ for _ in ()).throw(exc("injected fault inside the forward"))
            )
            try:
                return run(batch, forward)
            finally:
                handle.remove()
        return run(batch, forward)

    runner._run = faulty_run
    return failures


def _assert_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks, "leaked blocks"
    engine.block_manager.assert_invariants()


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_failed_step_leaves_no_unwritten_blocks_in_the_prefix_cache(checkpoint_dir):
    """Before the fix, the prompt's blocks stayed cached although the step that was to fill
    them raised: the same prompt then read zeros as its K/V."""
    base = checkpoint_dir("tiny-llama")
    prompts = [{"prompt_token_ids": SHARED + [7, 8, 9]}, {"prompt_token_ids": SHARED + [5]}]
    llm = _eager(base)
    want = _tokens(llm.generate(prompts, GREEDY))
    llm.llm_engine.block_manager.reset_prefix_cache()
    for exc in (Fault, KeyboardInterrupt, MemoryError):
        fail = [True, True]  # one failure before the forward, one from inside it
        _inject(llm, lambda f=fail: bool(f) and f.pop(), exc)
        for _ in range(2):
            with pytest.raises(exc):
                llm.generate(prompts, GREEDY)
            _assert_clean(llm)
        again = llm.generate(prompts, GREEDY)
        assert _tokens(again) == want
        assert again[1].num_cached_tokens == 32  # hits the blocks the first prompt wrote
        llm.llm_engine.block_manager.reset_prefix_cache()


def test_random_faults_in_a_mixed_workload(checkpoint_dir, tmp_path):
    """Prefix sharing, three LoRA adapters and the base model, chunked prefill: faults at
    random steps fail the call's unfinished requests (raise_on_error=False) and nothing else;
    every output that finishes, and every later run, equals a clean engine's."""
    base = checkpoint_dir("tiny-llama")
    loras = [
        LoRARequest(f"a{i}", i, make_adapter(base, str(tmp_path / f"a{i}"), i, 8, ["q_proj"]))
        for i in (1, 2, 3)
    ]
    tails = make_prompts(12, seed=5, low=1, high=20)
    prompts = [
        {"prompt_token_ids": (SHARED if i % 2 else [])[: 4 * i] + t} for i, t in enumerate(tails)
    ]
    chosen = [None if i % 4 == 0 else loras[i % 3] for i in range(len(prompts))]
    kw = dict(enable_lora=True, max_lora_rank=8, max_loras=2, max_num_batched_tokens=24)
    clean = _eager(base, **kw)
    want = _tokens(clean.generate(prompts, GREEDY, lora_request=chosen))
    clean.close()

    llm = _eager(base, **kw)
    rng = random.Random(0)
    on = [True]
    failures = _inject(llm, lambda: on[0] and rng.random() < 0.3)
    num_errors = 0
    for _ in range(4):
        outs = llm.generate(prompts, GREEDY, lora_request=chosen, raise_on_error=False)
        for out, w in zip(outs, want, strict=True):
            if out.error is None:
                assert out.outputs[0].token_ids == w
            else:
                num_errors += 1
                assert "injected fault" in out.error
                assert out.outputs[0].finish_reason == "error"
                assert out.outputs[0].token_ids == w[: len(out.outputs[0].token_ids)]
        _assert_clean(llm)
    assert failures and num_errors, "the workload must have met faults"
    on[0] = False  # no more faults: the cached prefixes must all be sound
    assert _tokens(llm.generate(prompts, GREEDY, lora_request=chosen)) == want
    _assert_clean(llm)


def test_failed_embedding_and_encoder_steps_are_rolled_back(checkpoint_dir, tmp_path):
    base = checkpoint_dir("tiny-llama")
    prompts = [{"prompt_token_ids": SHARED + [i]} for i in range(3)]
    llm = _eager(base)
    want = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    fail = [True]
    _inject(llm, lambda: bool(fail) and fail.pop())
    with pytest.raises(Fault):
        llm.embed(prompts, use_tqdm=False)
    _assert_clean(llm)
    got = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))

    bart = build_tiny_bart(str(tmp_path / "bart"), 200)
    llm = _eager(bart, max_num_batched_tokens=16)
    cases = [
        {
            "encoder_prompt": {"prompt_token_ids": list(range(3, 3 + n))},
            "decoder_prompt": {"prompt_token_ids": [5, 6, 7, 8, 9, 10][:k]},
        }
        for n, k in ((20, 6), (7, 0), (30, 3))
    ]
    want = _tokens(llm.generate(cases, GREEDY))
    for calls in ([0], [1], [2, 3]):  # the encoder pass, the decoder pass, later steps
        seen = [0]

        def should_fail(calls=calls, seen=seen) -> bool:
            seen[0] += 1
            return seen[0] - 1 in calls

        _inject(llm, should_fail)
        outs = llm.generate(cases, GREEDY, raise_on_error=False)
        assert any(o.error for o in outs)
        _assert_clean(llm)
        _inject(llm, lambda: False)
        assert _tokens(llm.generate(cases, GREEDY)) == want


def test_nan_logits_fail_only_their_request(checkpoint_dir, tmp_path):
    """An adapter with a NaN weight poisons its own request's logits: that request finishes
    with finish_reason "error" and `error` set, the others (same step) go on."""
    base = checkpoint_dir("tiny-llama")
    good = LoRARequest("good", 1, make_adapter(base, str(tmp_path / "good"), 1, 8, ["q_proj"]))
    bad_dir = make_adapter(base, str(tmp_path / "bad"), 2, 8, ["q_proj", "v_proj"])
    file = f"{bad_dir}/adapter_model.safetensors"
    tensors = load_file(file)
    name = next(k for k in tensors if "v_proj.lora_B" in k)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, file)
    bad = LoRARequest("bad", 2, bad_dir)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(4, seed=3)]
    chosen = [good, bad, None, good]
    llm = _eager(base, enable_lora=True, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, lora_request=chosen)
    assert outs[1].error is not None and "NaN or inf" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    others = [0, 2, 3]
    want = _tokens(
        llm.generate([prompts[i] for i in others], GREEDY, lora_request=[good, None, good])
    )
    assert [outs[i].outputs[0].token_ids for i in others] == want
    assert all(outs[i].error is None and len(outs[i].outputs[0].token_ids) == 6 for i in others)
    _assert_clean(llm)


def test_calls_from_two_threads_get_their_own_outputs(checkpoint_dir):
    base = checkpoint_dir("tiny-llama")
    llm = _eager(base)
    batches = [[{"prompt_token_ids": p} for p in make_prompts(3, seed=s)] for s in (1, 2)]
    want = [_tokens(llm.generate(b, GREEDY)) for b in batches]
    got: dict[int, list[list[int]]] = {}
    # What a thread raises only reaches pytest as a warning: each pass's outcome is kept here.
    passes: dict[int, list[str]] = {0: [], 1: []}

    def worker(i: int) -> None:
        for _ in range(3):
            try:
                got[i] = _tokens(llm.generate(batches[i], GREEDY))
                passes[i].append("ok" if got[i] == want[i] else f"wrong tokens: {got[i]}")
            except BaseException as e:  # noqa: BLE001  (reported below, in the test's thread)
                passes[i].append(f"raised {e!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert passes == {0: ["ok"] * 3, 1: ["ok"] * 3}
    assert got == {0: want[0], 1: want[1]}
    _assert_clean(llm)

    # The engine itself is not thread-safe: a second thread entering it is refused clearly.
    engine = llm.llm_engine
    inside, release = threading.Event(), threading.Event()
    step = engine.runner.execute

    def slow_execute(plan):
        inside.set()
        release.wait(10)
        return step(plan)

    engine.runner.execute = slow_execute
    engine.add_request("a", batches[0][0], GREEDY)
    stepped: list[BaseException | None] = []

    def run_step() -> None:
        try:
            engine.step()
            stepped.append(None)
        except BaseException as e:  # noqa: BLE001  (reported below)
            stepped.append(e)

    stepper = threading.Thread(target=run_step)
    stepper.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match="not thread-safe"):
        engine.add_request("b", batches[0][1], GREEDY)
    release.set()
    stepper.join()
    assert stepped == [None], stepped  # the step it refused to enter ran to its end
    engine.runner.execute = step
    engine.abort_request("a")
    _assert_clean(llm)


def test_a_failing_detokenizer_fails_only_its_request(checkpoint_dir):
    """An exception while processing one request's new token (its detokenizer here; logits
    processors and grammars later) finishes that request with the error; the step's other
    requests keep their tokens."""
    base = checkpoint_dir("tiny-llama")
    llm = _eager(base)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, seed=8)]
    want = _tokens(llm.generate(prompts, GREEDY))
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    detok = engine.scheduler.requests["1"].detokenizer

    calls = []

    def broken(token: int) -> int:
        calls.append(token)
        if len(calls) > 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return type(detok).append(detok, token)

    detok.append = broken
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    failed = outs["1"]
    assert "UnicodeDecodeError" in failed.error and failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].token_ids == want[1][:3]
    assert [outs[str(i)].outputs[0].token_ids for i in (0, 2)] == [want[0], want[2]]
    _assert_clean(llm)
