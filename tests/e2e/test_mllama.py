"""Llama 3.2 Vision (Mllama) with images against HF transformers greedy `generate` (fp32,
token-identical): image+text, text-only, two images of different aspect ratios, consecutive
images, mixed batches with chunked prefill and preemption, compiled graphs with zero recompiles
after warm-up; each token's cross-attention range against HF's own mask; bad multimodal input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch._dynamo.utils import counters

from ember import LLM, SamplingParams
from ember.runtime.multimodal import VisionGeometry, build_image_inputs
from ember.tools.checkpoints import build_tiny_mllama
from tests.conftest import gib_for_blocks

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_mllama(tmp_path_factory) -> str:
    return build_tiny_mllama(str(tmp_path_factory.mktemp("tiny-mllama")))


def _image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (prompt, images): wide (2 tiles) and tall (3 tiles) and square (4 tiles after resize) images,
# two images in one prompt, consecutive image tokens, text before the first image, text only.
CASES = [
    ("<|image|>The quick brown fox", [_image(1, 30, 60)]),
    ("<|image|>The quick brown fox", [_image(2, 30, 60)]),  # same text, another image
    (
        "Once upon a time <|image|>there was<|image|> a small engine",
        [_image(3, 90, 30), _image(4, 40, 70)],
    ),
    ("<|image|><|image|>Knowledge is power.", [_image(5, 50, 50), _image(6, 20, 80)]),
    ("In the beginning was the word, and the word was with the machine.", []),
    ("<|image|>Hello, world! How are you today? I am fine, thank you.", [_image(7, 64, 64)]),
    ("Time flies like an arrow; fruit flies like a banana.", []),
]


def _prompt(text: str, images: list) -> dict:
    if not images:
        return {"prompt": text}
    return {"prompt": text, "multi_modal_data": {"image": images if len(images) > 1 else images[0]}}


def hf_mllama_greedy(model_dir: str, cases, max_new_tokens: int = MAX_NEW) -> list[list[int]]:
    """HF `generate(do_sample=False)` one prompt at a time, inputs from the checkpoint's own
    processor (text-only prompts too: it puts the BOS in); EOS ignored."""
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for text, images in cases:
        if images:
            inputs = dict(processor(images=[images], text=text, return_tensors="pt"))
        else:
            inputs = {"input_ids": torch.tensor(processor(text=[text])["input_ids"])}
        with torch.inference_mode():
            ids = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=2,
            )
        outs.append(ids[0, inputs["input_ids"].shape[1] :].tolist())
    return outs


@pytest.fixture(scope="module")
def want(tiny_mllama) -> list[list[int]]:
    outs = hf_mllama_greedy(tiny_mllama, CASES)
    assert outs[0] != outs[1]  # the image changes HF's output: the reference is not blind
    assert len({tuple(o) for o in outs}) == len(outs)
    return outs


def _run_staggered(llm: LLM, cases) -> tuple[list[list[int]], bool, dict[str, int]]:
    """Submit 2 requests every other step. Returns (token ids in order, whether a prompt was
    chunked, vision-tower passes per request)."""
    engine = llm.llm_engine
    schedule, encode = engine.scheduler.schedule, engine.runner._encode_images
    chunked = False
    passes: dict[str, int] = {}

    def spy():
        nonlocal chunked
        plan = schedule()
        for r in plan.requests:
            req = engine.scheduler.requests[r.request_id]
            chunked |= 1 < r.num_new_tokens < req.num_tokens - r.num_computed_tokens
        return plan

    def counting(request):
        passes[request.request_id] = passes.get(request.request_id, 0) + 1
        encode(request)

    engine.scheduler.schedule = spy
    engine.runner._encode_images = counting
    pending = list(enumerate(cases))
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            for _ in range(min(2, len(pending))):
                i, (text, images) = pending.pop(0)
                engine.add_request(f"m{i}", _prompt(text, images), GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [done[f"m{i}"] for i in range(len(cases))], chunked, passes


def test_mllama_compiled_matches_hf_in_mixed_chunked_batches_with_zero_recompiles(
    tiny_mllama, want, tmp_path
):
    knobs = dict(
        model=tiny_mllama,
        dtype="float32",
        kv_cache_gib=0.01,
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        compile_cache_dir=str(tmp_path / "cache"),
    )
    llm = LLM(**knobs)
    runner = llm.llm_engine.runner
    assert runner.forwards.vision is not None
    graphs = counters["stats"]["unique_graphs"]
    compiled = runner.graphs_compiled
    with torch.compiler.set_stance("fail_on_recompile"):
        got, chunked, passes = _run_staggered(llm, CASES)
    assert got == want
    assert chunked  # image prompts were split across steps, next to decodes
    # The vision tower ran once per request with images, and nothing compiled after warm-up.
    assert passes == {f"m{i}": 1 for i, (_, images) in enumerate(CASES) if images}
    assert counters["stats"]["unique_graphs"] == graphs
    # One vision graph, then per token bucket a step graph and a text-only one.
    assert runner.graphs_compiled == compiled == 1 + 2 * len(runner.graph_sizes)
    engine = llm.llm_engine
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks
    # One batch: every request in the first step (text-only and image requests together).
    outs = llm.generate([_prompt(t, i) for t, i in CASES], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    # A step with no image token runs the text-only graph (HF skips cross-attention layers
    # without images): same tokens.
    text_graph, used = runner.forwards.text, []

    def spy_text(*args):
        used.append(args[0].shape[0])
        return text_graph(*args)

    object.__setattr__(runner.forwards, "text", spy_text)
    text_only = [i for i, (_, images) in enumerate(CASES) if not images]
    outs = llm.generate([_prompt(*CASES[i]) for i in text_only], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in text_only]
    assert used
    llm.close()
    # A warm start loads every graph, the vision graph included, and compiles none.
    warm = LLM(**knobs)
    assert warm.llm_engine.compile_cache_hit
    assert warm.llm_engine.runner.graphs_compiled == 0
    assert warm.llm_engine.runner.graphs_loaded == compiled
    outs = warm.generate([_prompt(t, i) for t, i in CASES[:3]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:3]


def test_mllama_preemption_and_token_prompts_match_hf(tiny_mllama, want):
    # 60 blocks of 4 tokens: image requests hold 16-32 tokens of image K/V each, so the cache
    # runs out and requests are preempted (their images rerun on readmission).
    llm = LLM(
        model=tiny_mllama,
        compile=False,
        dtype="float32",
        kv_cache_gib=gib_for_blocks(tiny_mllama, 60, 4),
        block_size=4,
        max_num_batched_tokens=24,
        max_model_len=64,
    )
    got, _, _ = _run_staggered(llm, CASES)
    assert got == want
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks
    engine.block_manager.assert_invariants()
    # Token-id prompts with images: the ids the processor made, the same output.
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_mllama)
    text, images = CASES[2]
    ids = processor(images=[images], text=text)["input_ids"][0]
    out = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == want[2]
    assert out.prompt_token_ids == list(ids)
    # A text-only prompt goes through the same processor: its BOS, which this tokenizer does
    # not add by itself, is in the prompt, and the output is HF's on the processor's inputs.
    text = CASES[4][0]
    bos = processor.tokenizer.bos_token_id
    assert not CASES[4][1] and processor.tokenizer(text)["input_ids"][0] != bos
    ids = processor(text=[text])["input_ids"][0]
    assert ids[0] == bos
    out = llm.generate(text, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == list(ids)
    assert out.outputs[0].token_ids == want[4]


@pytest.mark.parametrize(
    "text,tiles",
    [
        ("<|image|>a b c", [2]),
        ("x y <|image|>a b<|image|> c d", [3, 1]),
        ("<|image|><|image|>a b c", [4, 2]),
        ("x <|image|><|image|>a<|image|>b c", [1, 4, 2]),
    ],
)
def test_each_tokens_image_range_is_hfs_cross_attention_mask(text, tiles):
    """The image tokens each position attends under ember's layout (real tiles first, then
    padding tiles) are exactly those HF's expanded cross-attention mask lets it attend (a row
    with no image attends every image token, padding tiles included)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    geometry = VisionGeometry(tiles=4, patches=5)
    words = text.replace("<|image|>", " IMG ").split()
    ids = [99 if w == "IMG" else 7 for w in words]
    n = len(tiles)
    mask = torch.zeros(1, n, 4, dtype=torch.long)
    for i, t in enumerate(tiles):
        mask[0, i, :t] = 1
    features = {
        "pixel_values": torch.zeros(1, n, 4, 3, 2, 2),
        "aspect_ratio_ids": torch.ones(1, n, dtype=torch.long),
        "aspect_ratio_mask": mask,
    }
    images = build_image_inputs(ids, 99, features, geometry)
    dense = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(ids, 99)], [tiles], 4, len(ids)
    )[0]
    hf = torch.from_numpy(dense).repeat_interleave(5, dim=2).reshape(len(ids), -1).bool()
    no_image = ~hf.any(dim=1)
    hf[no_image] = True  # HF's full-row rule: a row masked everywhere attends everything
    # ember's row of image token j in HF order: where image (j // 20)'s rows were written.
    order = torch.cat([images.slots(i, list(range(n * 5)), 4) for i in range(n)])
    starts, ends, row_mask = images.ranges(0, len(ids) + 2)
    for p in range(len(ids) + 2):
        row = min(p, len(ids) - 1)  # decoded tokens: the last prompt row (HF's generate)
        ours = (order >= int(starts[p])) & (order < int(ends[p]))
        assert torch.equal(ours, hf[row]), p
        assert row_mask[p] == float(not no_image[row])


def test_bad_multimodal_input_is_a_value_error_and_leaks_nothing(tiny_mllama, checkpoint_dir):
    llm = LLM(
        model=tiny_mllama,
        compile=False,
        kv_cache_gib=0.01,
        max_model_len=128,
        limit_mm_per_prompt={"image": 2},
    )
    img = _image(0, 30, 30)
    bad = [
        ({"prompt": "<|image|>a", "multi_modal_data": {"video": img}}, "multi_modal_data must be"),
        ({"prompt": "a b", "multi_modal_data": {"image": img}}, "0 image tokens"),
        ({"prompt": "<|image|>a<|image|>", "multi_modal_data": {"image": img}}, "2 image tokens"),
        (
            {"prompt": "<|image|>" * 3, "multi_modal_data": {"image": [img] * 3}},
            r"limit_mm_per_prompt\['image'\]=2",
        ),
        ({"prompt": "<|image|>a", "multi_modal_data": {"image": "cat.png"}}, "takes PIL images"),
        ({"prompt": "<|image|>a", "multi_modal_data": {"image": []}}, "has 0 images"),
    ]
    for prompt, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no multi_modal_data"):
        llm.embed({"prompt": "<|image|>a", "multi_modal_data": {"image": img}})
    # The engine is intact: a good request runs, no block is held.
    out = llm.generate(_prompt(*CASES[0]), GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_NEW
    engine = llm.llm_engine
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks
    # A text-only model never drops images silently.
    text_llm = LLM(model=checkpoint_dir("tiny-llama"), compile=False, kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="takes no images"):
        text_llm.generate({"prompt": "a", "multi_modal_data": {"image": img}}, GREEDY)
    with pytest.raises(ValueError, match="takes no multimodal inputs"):
        LLM(model=checkpoint_dir("tiny-llama"), compile=False, limit_mm_per_prompt={"image": 1})


def _hf_greedy_from_ids(model_dir: str, ids: list[int], images: list) -> list[int]:
    """HF greedy for prompt ids made elsewhere (a chat template): pixels from the image
    processor, the cross-attention mask from HF's own functions, as its processor makes them."""
    from transformers import AutoProcessor, MllamaForConditionalGeneration
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    processor = AutoProcessor.from_pretrained(model_dir)
    model = MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    features = processor.image_processor(images=[images], return_tensors="pt")
    tiles = features["aspect_ratio_mask"][0].sum(dim=1).tolist()
    mask = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(ids, processor.image_token_id)], [tiles], 4, len(ids)
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=features["pixel_values"],
            aspect_ratio_ids=features["aspect_ratio_ids"],
            aspect_ratio_mask=features["aspect_ratio_mask"],
            cross_attention_mask=torch.from_numpy(mask),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            eos_token_id=None,
            pad_token_id=2,
        )
    return out[0, len(ids) :].tolist()


def test_chat_with_image_parts_matches_hf(tiny_mllama):
    import base64
    import io

    llm = LLM(model=tiny_mllama, compile=False, kv_cache_gib=0.01, max_model_len=128)
    image = _image(11, 40, 90)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    template = "<s>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    parts = [
        [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "Describe it."}],
        [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe it."},
        ],
    ]
    outs = [
        llm.chat([{"role": "user", "content": p}], GREEDY, use_tqdm=False, chat_template=template)[
            0
        ]
        for p in parts
    ]
    # The image token goes before the message's text (vLLM's placement for string templates).
    assert outs[0].prompt == "<s>user: <|image|>\nDescribe it.\n"
    assert outs[1].prompt_token_ids == outs[0].prompt_token_ids
    want = _hf_greedy_from_ids(tiny_mllama, outs[0].prompt_token_ids, [image])
    assert [o.outputs[0].token_ids for o in outs] == [want, want]
    with pytest.raises(ValueError, match="data:image"):
        llm.chat(
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                }
            ],
            GREEDY,
            chat_template=template,
        )


def test_mllama_with_an_int8_kv_cache_stays_with_fp32(tiny_mllama, want):
    """kv_cache_dtype="int8": the text model's self-attention K/V and the image K/V that
    cross-attention reads (`ember::cross_attention_ranges`, dequantized as gathered) are int8
    rows with a scale per token and head. Greedy output equals HF fp32's for most prompts, and
    where it leaves it, it leaves at a near tie of fp32's (this random model's top two logits
    lie 0.03 apart at one step of one prompt) for a token in HF's top 5 there."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=5)
    got = {}
    for kv in ("float32", "int8"):
        llm = LLM(
            model=tiny_mllama, compile=False, kv_cache_gib=0.01, max_model_len=128,
            kv_cache_dtype=kv,
        )  # fmt: skip
        assert {c.dtype for c in llm.llm_engine.runner.kv_caches} == {getattr(torch, kv)}
        got[kv] = [o.outputs[0] for o in llm.generate([_prompt(t, i) for t, i in CASES], params)]
        pool = llm.llm_engine.block_manager
        assert pool.num_free_blocks == pool.num_blocks - 1
        llm.close()
    assert [o.token_ids for o in got["float32"]] == want
    same = 0
    for wide, narrow in zip(got["float32"], got["int8"]):
        step = next(
            (i for i, (a, b) in enumerate(zip(wide.token_ids, narrow.token_ids)) if a != b), None
        )
        if step is None:
            same += 1
            continue
        top = wide.logprobs[step]
        chosen = narrow.token_ids[step]
        assert chosen in top, (step, chosen, top)
        assert top[wide.token_ids[step]].logprob - top[chosen].logprob < 0.1
    assert same >= len(CASES) - 2
