"""vLLM's request semantics on tiny seeded checkpoints, each against a reference: HF `generate`
(stopping on every EOS id of the generation config, BART decoder prompts), or a naive
per-token oracle that runs the HF model on the whole sequence at every step and applies the
request's logits controls to its last row (allowed_token_ids, bad_words, logit_bias,
min_tokens, logits_processors), HF's log-softmax for prompt_logprobs, the tokenizer's own
`apply_chat_template` for `LLM.chat`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember import LLM, SamplingParams
from tests.conftest import build_tiny_bart, hf_bart_greedy, make_prompts
from tests.e2e.servers import CHAT_TEMPLATE

MAX_NEW = 16


def _llm(d: str, **kw) -> LLM:
    kw = {"compile": False, "dtype": "float32", "kv_cache_gib": 0.01, "max_model_len": 128} | kw
    return LLM(model=d, **kw)


def _greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _copy_with(d: str, dest: str, generation: dict | None = None, eos_token: str | None = None):
    """Copy a checkpoint, writing `generation` as its generation_config.json and/or making
    `eos_token` the tokenizer's EOS."""
    shutil.copytree(d, dest)
    if generation is not None:
        with open(os.path.join(dest, "generation_config.json"), "w") as f:
            json.dump(generation, f)
    if eos_token is not None:
        path = os.path.join(dest, "tokenizer_config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["eos_token"] = eos_token
        with open(path, "w") as f:
            json.dump(cfg, f)
    return dest


def oracle_greedy(d, prompt, n, transform=None, stop_ids=()):
    """Greedy decoding by the HF model re-run over the whole sequence at each token, with
    `transform(row, output_ids)` applied to the last logits row; stops after a `stop_ids`
    token."""
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            if transform is not None:
                row = transform(row.clone(), list(out))
            token = int(row.argmax())
            out.append(token)
            ids.append(token)
            if token in stop_ids:
                break
    return out


@pytest.fixture(scope="module")
def tiny(checkpoint_dir):
    return checkpoint_dir("tiny-llama")


@pytest.fixture(scope="module")
def free_run(tiny):
    """A prompt and its greedy output with EOS ignored (the oracle's)."""
    prompt = make_prompts(1, seed=11, low=12, high=13)[0]
    return prompt, oracle_greedy(tiny, prompt, MAX_NEW)


# ---- stopping ---------------------------------------------------------------------------------


def test_every_eos_id_of_the_generation_config_stops_as_hf_generate(tiny, free_run, tmp_path):
    prompt, free = free_run
    first = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    later = next(t for i, t in enumerate(free) if i > free.index(first) and t not in free[:i])
    d = _copy_with(tiny, str(tmp_path / "m"), {"eos_token_id": [1, later, first]})
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert hf.generation_config.eos_token_id == [1, later, first]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
    want = ref[0, len(prompt) :].tolist()
    assert want[-1] == first and len(want) < MAX_NEW  # HF stopped on the config's EOS
    llm = _llm(d)
    assert llm.llm_engine.eos_token_id == 1  # the tokenizer's
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want
    assert out.finish_reason == "stop" and out.stop_reason == first  # as vLLM reports it
    ignored = llm.generate({"prompt_token_ids": prompt}, _greedy(ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_the_tokenizers_eos_stops_with_no_stop_reason(tiny, free_run, tmp_path):
    prompt, free = free_run
    eos = free[4]
    tok = AutoTokenizer.from_pretrained(tiny)
    d = _copy_with(tiny, str(tmp_path / "m"), eos_token=tok.convert_ids_to_tokens(eos))
    llm = _llm(d)
    assert llm.llm_engine.eos_token_id == eos
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: free.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None


def _texts(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    """(token ids, text, the text of DELTA outputs joined) of one request."""
    from ember import RequestOutputKind

    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    engine = llm.llm_engine
    delta = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta", {"prompt_token_ids": prompt}, delta)
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0].text for o in engine.step() if o.request_id == "delta"]
    return list(out.token_ids), out.text, "".join(pieces)


@pytest.mark.parametrize("how", ["generation-config", "stop_token_ids", "tokenizer-eos"])
def test_a_stop_tokens_text_is_left_out_unless_include_stop_str_in_output(
    tiny, free_run, tmp_path, how
):
    """vLLM's V1 detokenizer: a request that stops on a token (another EOS id of the generation
    config, a stop_token_ids entry, or the tokenizer's EOS with skip_special_tokens=False)
    keeps that token's id in token_ids but not its text in `text`, unless
    include_stop_str_in_output; streamed deltas join to the same text. The reference texts
    are the same request cut by max_tokens just before the stop token, and ended by length on
    it."""
    prompt, free = free_run
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    n = free.index(stop) + 1
    extra: dict = {}
    if how == "generation-config":
        d = _copy_with(tiny, str(tmp_path / "m"), {"eos_token_id": [1, stop]})
    elif how == "stop_token_ids":
        d, extra = tiny, {"stop_token_ids": [stop]}
    else:
        tok = AutoTokenizer.from_pretrained(tiny)
        d = _copy_with(tiny, str(tmp_path / "m"), eos_token=tok.convert_ids_to_tokens(stop))
        extra = {"skip_special_tokens": False}
    llm = _llm(d)
    plain = {k: v for k, v in extra.items() if k != "stop_token_ids"}
    cut = [_greedy(m, ignore_eos=True, **plain) for m in (n - 1, n)]
    before, through = (o.outputs[0] for o in llm.generate([{"prompt_token_ids": prompt}] * 2,
                                                          cut, use_tqdm=False))  # fmt: skip
    assert through.text != before.text  # the stop token has text of its own
    ids, text, streamed = _texts(llm, prompt, _greedy(**extra))
    assert ids == free[:n] and ids[-1] == stop
    assert text == streamed == before.text
    ids, text, streamed = _texts(llm, prompt, _greedy(include_stop_str_in_output=True, **extra))
    assert ids == free[:n]
    assert text == streamed == through.text


def test_min_tokens_masks_every_eos_and_stop_token_until_reached(tiny, free_run, tmp_path):
    prompt, free = free_run
    eos = free[2]
    d = _copy_with(tiny, str(tmp_path / "m"), {"eos_token_id": [1, eos]})
    llm = _llm(d)
    stop_tok = free[1]
    params = _greedy(min_tokens=6, stop_token_ids=[stop_tok])
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    masked = {1, eos, stop_tok}

    def transform(row, output):
        if len(output) < 6:
            row[list(masked)] = float("-inf")
        return row

    want = oracle_greedy(d, prompt, MAX_NEW, transform, stop_ids=masked)
    assert out.token_ids == want
    assert len(out.token_ids) > 6 and not masked & set(out.token_ids[:6])
    assert out.finish_reason == ("stop" if want[-1] in masked else "length")


def test_min_tokens_holds_back_stop_strings(tiny, free_run):
    prompt, _ = free_run
    llm = _llm(tiny)
    base = llm.generate({"prompt_token_ids": prompt}, _greedy(ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    stop = text[:2] if text[:2].strip() else text[2:4]
    early = llm.generate(
        {"prompt_token_ids": prompt}, _greedy(stop=[stop], ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3
    held = llm.generate(
        {"prompt_token_ids": prompt},
        _greedy(stop=[stop], ignore_eos=True, min_tokens=len(early.token_ids) + 2),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(held.token_ids) >= len(early.token_ids) + 2


# ---- default sampling params from the generation config -----------------------------------------


def test_generation_config_sets_the_default_sampling_params(tiny, tmp_path):
    gen = {"temperature": 0.5, "top_k": 7, "top_p": 0.8, "repetition_penalty": 1.2,
           "max_new_tokens": 5, "do_sample": True}  # fmt: skip
    d = _copy_with(tiny, str(tmp_path / "m"), gen)
    llm = _llm(d)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == (
        0.5, 7, 0.8, 1.2, 5,
    )  # fmt: skip
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    plain = _llm(d, generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()
    other = _copy_with(tiny, str(tmp_path / "other"), {"temperature": 0.25})
    assert _llm(tiny, generation_config=other).get_default_sampling_params().temperature == 0.25
    assert _llm(tiny).get_default_sampling_params() == SamplingParams()  # no generation config
    with pytest.raises(ValueError, match="generation_config"):
        _llm(tiny, generation_config="nowhere")


# ---- encoder-decoder prompts ---------------------------------------------------------------------


def test_a_decoder_prompt_that_starts_with_the_start_token_gets_no_second_one(tmp_path):
    d = build_tiny_bart(str(tmp_path / "bart"), 200)
    llm = _llm(d)
    start = llm.llm_engine.model_config.decoder_start_token_id
    enc, dec = [5, 17, 42, 9, 77, 31], [12, 150]
    want = hf_bart_greedy(d, [(enc, dec)], 8)[0]  # HF: decoder_input_ids = [start, *dec]
    params = _greedy(8, ignore_eos=True)
    for decoder in ([start, *dec], dec):
        prompt = {
            "encoder_prompt": {"prompt_token_ids": enc},
            "decoder_prompt": {"prompt_token_ids": decoder},
        }
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == [start, *dec]
        assert out.outputs[0].token_ids == want
    only_start = {"encoder_prompt": {"prompt_token_ids": enc},
                  "decoder_prompt": {"prompt_token_ids": [start]}}  # fmt: skip
    out = llm.generate(only_start, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_bart_greedy(d, [(enc, [])], 8)[0]


# ---- logits controls ----------------------------------------------------------------------------


def test_allowed_token_ids_logit_bias_and_processors_match_the_oracle(tiny, free_run):
    prompt, free = free_run
    llm = _llm(tiny)
    allowed = sorted(set(free[::2]) | {9, 10, 11})
    bias = {free[0]: -100.0, 33: 7.5, "44": 3.0}

    def proc_two(output_ids, row):
        row = row.clone()
        row[50 + len(output_ids)] += 20.0
        return row

    def proc_three(prompt_ids, output_ids, row):
        assert prompt_ids == prompt
        return row - 0.5 * (torch.arange(row.shape[0]) % 3 == 0).float()

    cases = [
        (_greedy(allowed_token_ids=allowed, ignore_eos=True),
         lambda row, out: torch.full_like(row, float("-inf")).index_copy_(
             0, torch.tensor(allowed), row[allowed])),
        (_greedy(logit_bias=bias, ignore_eos=True),
         lambda row, out: row.index_add(0, torch.tensor([free[0], 33, 44]),
                                        torch.tensor([-100.0, 7.5, 3.0]))),
        (_greedy(logits_processors=[proc_two, proc_three], ignore_eos=True),
         lambda row, out: proc_three(prompt, out, proc_two(out, row))),
    ]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(cases), [c[0] for c in cases],
                        use_tqdm=False)  # fmt: skip
    for (_, transform), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == oracle_greedy(tiny, prompt, MAX_NEW, transform)
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    # Logprobs stay those of the model's own distribution (vLLM's raw logprobs).
    lp = llm.generate(
        {"prompt_token_ids": prompt},
        _greedy(4, allowed_token_ids=[9], logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert lp.token_ids == [9] * 4
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.inference_mode():
        first = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)[9]
    assert lp.logprobs[0][9].logprob == pytest.approx(float(first), abs=1e-4)


def test_bad_words_match_the_oracle(tiny, free_run):
    """Each bad word is banned as it tokenizes at the start of the text and after a space
    (vLLM's rule, from `bad_words_token_ids`); the oracle bans a sequence's last token
    wherever the output ends with the rest of it."""
    from ember.runtime.logits import bad_words_token_ids

    prompt, free = free_run
    llm = _llm(tiny)
    tok = llm.get_tokenizer()
    word = tok.decode([free[1]]).strip() or tok.decode([free[2]]).strip()
    pair = tok.decode(free[3:5])
    banned = bad_words_token_ids([word, pair], tok)
    assert banned[0] == tok.encode(word, add_special_tokens=False)

    def transform(row, out):
        for seq in banned:
            tail = out[len(out) - len(seq) + 1 :] if len(seq) > 1 else []
            if len(seq) == 1 or (len(out) >= len(seq) - 1 and tail == seq[:-1]):
                row[seq[-1]] = float("-inf")
        return row

    params = _greedy(bad_words=[word, pair], ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == oracle_greedy(tiny, prompt, MAX_NEW, transform)
    assert out.token_ids != free


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny, free_run):
    prompt, _ = free_run
    llm = _llm(tiny)
    out = llm.generate(
        {"prompt_token_ids": prompt}, _greedy(truncate_prompt_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )[0]  # fmt: skip
    assert out.prompt_token_ids == prompt[-5:]
    assert out.outputs[0].token_ids == oracle_greedy(tiny, prompt[-5:], MAX_NEW)
    whole = llm.generate(
        {"prompt_token_ids": prompt}, _greedy(truncate_prompt_tokens=-1), use_tqdm=False
    )[0]
    assert whole.prompt_token_ids == prompt


def test_a_failing_logits_processor_fails_only_its_request(tiny, free_run):
    prompt, free = free_run
    llm = _llm(tiny)

    def broken(output_ids, row):
        raise RuntimeError("boom")

    outs = llm.generate(
        [{"prompt_token_ids": prompt}] * 2,
        [_greedy(logits_processors=[broken], ignore_eos=True), _greedy(ignore_eos=True)],
        use_tqdm=False,
    )
    assert outs[0].error and "boom" in outs[0].error and outs[0].outputs[0].token_ids == []
    assert outs[1].error is None and outs[1].outputs[0].token_ids == free
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {100000: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [5, 100000]}, "allowed_token_ids"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"bad_words": [""]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
        ({"logits_processors": [3]}, "logits_processors"),
    ],
)
def test_bad_logits_controls_raise_value_errors_naming_the_field(tiny, kwargs, field):
    llm = _llm(tiny)
    with pytest.raises(ValueError, match=field):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(**kwargs), use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


# ---- prompt logprobs ----------------------------------------------------------------------------


def _hf_prompt_logprobs(d, prompt):
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


@pytest.mark.parametrize("compile", [False, True])
def test_prompt_logprobs_match_hf_across_chunks_and_prefix_hits(tiny, compile):
    prompt = make_prompts(1, seed=12, low=37, high=38)[0]
    ref = _hf_prompt_logprobs(tiny, prompt)
    llm = _llm(tiny, compile=compile, block_size=4, max_num_batched_tokens=16)
    plain = llm.generate({"prompt_token_ids": prompt}, _greedy(2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    params = _greedy(2, prompt_logprobs=3, n=1)
    for _ in range(2):  # the second run's prompt is all in the prefix cache: still computed
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        for pos in range(1, len(prompt)):
            entry, row = plp[pos], ref[pos - 1]
            token = prompt[pos]
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(3)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert entry[t].logprob == pytest.approx(v, abs=1e-4)
            assert len(entry) in (3, 4)
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_logprobs_beside_other_requests(tiny):
    prompts = make_prompts(3, seed=13, low=10, high=30)
    llm = _llm(tiny, max_num_batched_tokens=24)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [_greedy(3), _greedy(3, prompt_logprobs=0), _greedy(3)],
        use_tqdm=False,
    )
    ref = _hf_prompt_logprobs(tiny, prompts[1])
    plp = outs[1].prompt_logprobs
    assert [list(e) for e in plp[1:]] == [[t] for t in prompts[1][1:]]
    got = torch.tensor([plp[i][prompts[1][i]].logprob for i in range(1, len(prompts[1]))])
    want = ref[torch.arange(len(prompts[1]) - 1), torch.tensor(prompts[1][1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None


# ---- chat ---------------------------------------------------------------------------------------


def test_chat_renders_the_template_as_the_tokenizer_does(tiny, tmp_path):
    d = str(tmp_path / "chat")
    shutil.copytree(tiny, d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    llm = _llm(d)
    convs = [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "system", "content": "be brief"},
         {"role": "user", "content": [{"type": "text", "text": "one"},
                                      {"type": "text", "text": "two"}]}],
    ]  # fmt: skip
    outs = llm.chat(convs, _greedy(6, ignore_eos=True), use_tqdm=False)
    flat = [convs[0], [convs[1][0], {"role": "user", "content": "one\ntwo"}]]
    for conv, out in zip(flat, outs, strict=True):
        text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        assert out.prompt == text and out.prompt_token_ids == ids
        ref = llm.generate({"prompt_token_ids": ids}, _greedy(6, ignore_eos=True),
                           use_tqdm=False)[0]  # fmt: skip
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    one = llm.chat(convs[0], _greedy(6, ignore_eos=True), use_tqdm=False)
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    cont = llm.chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}],
        _greedy(2), use_tqdm=False, add_generation_prompt=False, continue_final_message=True,
    )[0]  # fmt: skip
    assert cont.prompt.endswith("Sure")


def test_chat_without_a_template_is_a_value_error(tiny):
    llm = _llm(tiny)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}], _greedy(2))
    out = llm.chat([{"role": "user", "content": "hi"}], _greedy(2, ignore_eos=True),
                   chat_template=CHAT_TEMPLATE, use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="image"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 chat_template=CHAT_TEMPLATE)  # fmt: skip


# ---- hub ids ------------------------------------------------------------------------------------


def test_hub_ids_resolve_through_the_local_hf_cache(tiny, free_run, tmp_path, monkeypatch):
    """A hub id loads from the HF cache layout (`models--org--name/snapshots/<commit>`) with
    HF_HUB_OFFLINE=1, at `main` or at a named commit; an id that is not cached is a ValueError
    naming it."""
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub"
    repo = cache / "models--ember-test--tiny-llama"
    commits = {"main": "a" * 40, "old": "b" * 40}
    for name, commit in commits.items():
        shutil.copytree(tiny, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompt, free = free_run
    params = _greedy(ignore_eos=True)
    for revision in (None, commits["old"]):
        llm = _llm("ember-test/tiny-llama", revision=revision)
        want = str(repo / "snapshots" / (commits["old"] if revision else commits["main"]))
        assert os.path.realpath(llm.config.model) == os.path.realpath(want)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == free
    with pytest.raises(ValueError, match="ember-test/not-cached"):
        _llm("ember-test/not-cached")
    with pytest.raises(ValueError, match="revision"):
        _llm(tiny, revision="main")


def test_max_logprobs_is_an_llm_argument(tiny):
    llm = _llm(tiny, max_logprobs=2)
    assert llm.config.max_logprobs == 2
    out = llm.generate({"prompt_token_ids": [5, 6]}, _greedy(2, logprobs=2), use_tqdm=False)
    assert all(len(e) in (2, 3) for e in out[0].outputs[0].logprobs)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be <= max_logprobs=2"):
            llm.generate({"prompt_token_ids": [5, 6]}, _greedy(2, **{field: 3}))
