"""Scores, reranking and classification over HTTP, as vLLM serves them: `/score` (text pairs),
`/rerank` (a query against documents, in Jina's and Cohere's request shape, answered as both
read it) and `/classify`.

A cross-encoder (a `*ForSequenceClassification` with one label) scores each pair as its
tokenizer joins them, through sigmoid; an embedding model scores the cosine similarity of the
two texts' embeddings; a classifier answers each text's class probabilities (`LLM.score` and
`LLM.classify` compute the same).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from ember.runtime.pooling import (
    activate,
    classifier_activation,
    pair_scores,
    score_pairs,
    score_prompts,
)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True

    def texts(self) -> list[str]:
        """The documents' texts (Cohere's and Jina's: strings, or objects with `text`)."""
        out = []
        for i, doc in enumerate(self.documents):
            text = doc if isinstance(doc, str) else doc.get("text")
            if not isinstance(text, str):
                raise ValueError(f"documents[{i}] must be a string or an object with a 'text'")
            out.append(text)
        return out


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]


async def scores(engine: Any, rid: str, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """(each pair's score, the prompt tokens read); ValueError for a model that does not
    score or a bad text."""
    spec = engine.engine.config.model_spec
    prompts = score_prompts(engine.engine.tokenizer, spec, pairs)
    outs = await asyncio.gather(*(engine.embed(f"{rid}-{i}", p) for i, p in enumerate(prompts)))
    values = pair_scores(spec, pairs, prompts, [o.outputs.embedding for o in outs])
    return values, sum(len(o.prompt_token_ids) for o in outs)


def pairs_of(body: ScoreRequest) -> list[tuple[str, str]]:
    return score_pairs(body.text_1, body.text_2)


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def score_response(
    rid: str, created: int, model: str, values: list[float], tokens: int
) -> dict[str, Any]:
    data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)]
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data,
            "usage": _usage(tokens)}  # fmt: skip


def rerank_response(
    rid: str, model: str, body: RerankRequest, texts: list[str], values: list[float], tokens: int
) -> dict[str, Any]:
    """The documents by relevance, the top `top_n` (Jina's and Cohere's shape: `results` of
    `index`, `relevance_score` and, with `return_documents`, `document.text`)."""
    order = sorted(range(len(texts)), key=lambda i: -values[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": values[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {"id": rid, "model": model, "usage": {"total_tokens": tokens},
            "results": results}  # fmt: skip


def classify_response(
    rid: str, created: int, model: str, config: Any, logits: list[list[float]], tokens: int
) -> dict[str, Any]:
    activation = classifier_activation(config)
    labels = getattr(config, "id2label", None) or {}
    data = []
    for i, row in enumerate(logits):
        probs = activate(torch.tensor(row), activation).tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        label = labels.get(best, labels.get(str(best), f"LABEL_{best}"))
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data,
            "usage": _usage(tokens)}  # fmt: skip
