"""Image-request throughput (output tokens/s) of a vision-language model (Mllama): ember
(compiled) vs HF transformers eager `generate`, same run, same seeded random checkpoint.

Run: python -m pytest benchmarks/bench_vision.py --benchmark-columns=median -s
Model: `small-mllama` (ember.tools.checkpoints: 4 tiles of 65 patches per image, an 8-layer
512-wide LM with 2 cross-attention layers). Workload: 16 requests, each one image of its own
size and aspect ratio plus a ~30-token prompt, 32 greedy output tokens, EOS ignored. HF runs
batches of 8 (its processor pads the prompts), ember schedules all 16 at once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

NUM_REQUESTS, OUTPUT_LEN, HF_BATCH = 16, 32, 8
WORDS = "the a cat dog runs over under market bank rate movie great science paper model".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image

    from ember.tools.checkpoints import build_tiny_mllama

    path = build_tiny_mllama(str(tmp_path_factory.mktemp("mllama")), shape="small-mllama")
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(NUM_REQUESTS):
        height, width = (int(x) for x in rng.integers(60, 400, 2))
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        text = "<|image|>" + " ".join(rng.choice(WORDS, 30))
        requests.append((text, image))
    return path, requests


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return {}


def bench_vision_ember(benchmark, setup, results):
    from ember import LLM, SamplingParams

    path, requests = setup
    llm = LLM(model=path, dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in requests]
    benchmark.pedantic(llm.generate, args=(prompts, params), kwargs={"use_tqdm": False}, rounds=3)
    llm.close()
    if benchmark.stats is None:  # --benchmark-disable
        return
    results["ember"] = NUM_REQUESTS * OUTPUT_LEN / benchmark.stats.stats.median
    benchmark.extra_info["output_tokens_per_s"] = round(results["ember"], 1)


def bench_vision_hf(benchmark, setup, results):
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    path, requests = setup
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"
    processor.tokenizer.pad_token = processor.tokenizer.convert_ids_to_tokens(2)
    model = MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def run() -> None:
        for i in range(0, NUM_REQUESTS, HF_BATCH):
            batch = requests[i : i + HF_BATCH]
            inputs = processor(
                images=[[im] for _, im in batch],
                text=[t for t, _ in batch],
                padding=True,
                return_tensors="pt",
            )
            model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=OUTPUT_LEN,
                min_new_tokens=OUTPUT_LEN,
                eos_token_id=None,
                pad_token_id=2,
            )

    benchmark.pedantic(run, rounds=3)
    if benchmark.stats is None:  # --benchmark-disable
        return
    results["hf"] = NUM_REQUESTS * OUTPUT_LEN / benchmark.stats.stats.median
    benchmark.extra_info["output_tokens_per_s"] = round(results["hf"], 1)
    if "ember" in results:
        ratio = results["ember"] / results["hf"]
        print(
            f"\nimage requests, output tok/s: ember {results['ember']:.1f}, "
            f"HF eager {results['hf']:.1f} (batches of {HF_BATCH}): {ratio:.2f}x"
        )
