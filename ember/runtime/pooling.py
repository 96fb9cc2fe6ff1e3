"""Pooling of per-token hidden states into one embedding per sequence (vLLM's `embed` task),
and a sequence classifier's head over them (the `classify` task: `ClassifierHead`).

The pooling mode and normalisation come from the sentence-transformers files of the checkpoint
when present (`modules.json`, `<pooling dir>/config.json`, a `Normalize` module), as
sentence-transformers itself would apply them; otherwise mean pooling for encoder models and
last-token pooling for causal LMs, L2-normalised (vLLM's defaults for `embed`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

POOLING_MODES = ("mean", "cls", "last", "max")

_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True)
class PoolingConfig:
    mode: str
    normalize: bool

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, got {self.mode!r}")


def _read_json(path: str) -> object | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_pooling_config(model_dir: str, task: str) -> PoolingConfig:
    """The checkpoint's sentence-transformers pooling, else the default for `task`."""
    default = PoolingConfig("last" if task == "generate" else "mean", normalize=True)
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return default
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = types.get("Pooling")
    if pooling is None:
        return PoolingConfig(default.mode, normalize="Normalize" in types)
    cfg = _read_json(os.path.join(model_dir, pooling.get("path", ""), "config.json"))
    if not isinstance(cfg, dict):
        cfg = {}
    chosen = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    if len(chosen) != 1:
        raise ValueError(
            f"{model_dir}: sentence-transformers pooling must select exactly one of "
            f"{sorted(_ST_MODES)}, got {chosen or 'none'}"
        )
    return PoolingConfig(chosen[0], normalize="Normalize" in types)


def max_seq_length(model_dir: str) -> int | None:
    """sentence-transformers' input limit (`sentence_bert_config.json`), if the model has one."""
    cfg = _read_json(os.path.join(model_dir, "sentence_bert_config.json"))
    value = cfg.get("max_seq_length") if isinstance(cfg, dict) else None
    return int(value) if value else None


def pool(hidden: torch.Tensor, lengths: list[int], config: PoolingConfig) -> torch.Tensor:
    """hidden [num_tokens, H] of sequences laid end to end with `lengths` -> [num_seqs, H]
    float32 embeddings."""
    hidden = hidden[: sum(lengths)].float()
    lens = torch.tensor(lengths)
    ends = lens.cumsum(0)
    starts = ends - lens
    if config.mode == "cls":
        out = hidden[starts]
    elif config.mode == "last":
        out = hidden[ends - 1]
    else:
        seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)
        if config.mode == "mean":
            out = torch.zeros(len(lengths), hidden.shape[1]).index_add_(0, seq, hidden)
            out = out / lens[:, None]
        else:  # max: scatter rows into a [num_seqs, longest, H] grid padded with -inf
            col = torch.arange(hidden.shape[0]) - starts[seq]
            grid = torch.full((len(lengths), max(lengths), hidden.shape[1]), float("-inf"))
            grid[seq, col] = hidden
            out = grid.amax(dim=1)
    return F.normalize(out, dim=-1) if config.normalize else out


class _Replay(torch.nn.Module):
    """Stands in for a classifier's base model: returns hidden states already computed (and
    the base's own pooler of them, as BERT's classifiers read it)."""

    def __init__(self, base: torch.nn.Module, hidden: torch.Tensor) -> None:
        super().__init__()
        self.base_pooler = getattr(base, "pooler", None)
        self.hidden = hidden

    def forward(
        self, *args: object, **kwargs: object
    ) -> BaseModelOutputWithPoolingAndCrossAttentions:
        pooled = self.base_pooler(self.hidden) if self.base_pooler is not None else None
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=self.hidden, pooler_output=pooled
        )


class ClassifierHead:
    """A sequence classifier's own head (`BertForSequenceClassification`'s pooler and
    classifier, XLM-R's classification head, a causal LM's score head on its last non-padding
    token) over one request's last hidden states: the HF model's forward runs with its base
    model replaced by the states the step computed, so each family's head is HF's own code."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.prefix = model.base_model_prefix
        self.base = model.base_model
        self.num_labels = int(model.config.num_labels)
        self.dtype = next(model.parameters()).dtype  # the head's: the states are cast to it

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, ids: list[int], types: list[int]) -> torch.Tensor:
        """hidden [len(ids), H] -> [num_labels] float32 logits."""
        replay = _Replay(self.base, hidden[None].to(self.dtype))
        setattr(self.model, self.prefix, replay)
        try:
            out = self.model(
                input_ids=torch.tensor([ids]),
                token_type_ids=torch.tensor([types]) if types else None,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        finally:
            setattr(self.model, self.prefix, self.base)
        return out.logits[0].float()


def classifier_activation(config: object) -> str:
    """How a classifier's logits become scores and probabilities: "sigmoid" for one label
    (a cross-encoder's relevance, as sentence-transformers' CrossEncoder and vLLM score it),
    "softmax" for several, unless the checkpoint's sentence-transformers config names an
    activation ("identity": raw logits)."""
    named = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn")
    if isinstance(named, str):
        name = named.rsplit(".", 1)[-1].lower()
        if name in ("identity", "sigmoid", "softmax"):
            return name
    if getattr(config, "problem_type", None) == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if int(getattr(config, "num_labels", 2)) == 1 else "softmax"


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing for scores: one text with each of the others (1:N), or lists of one
    length (N:N); ValueError otherwise."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side")
    if any(not isinstance(t, str) for t in first + second):
        raise ValueError("score takes texts (strings)")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"score pairs text_1[i] with text_2[i]: give one text_1 or as many as text_2 "
            f"({len(second)}), got {len(first)}"
        )
    return list(zip(first, second, strict=True))


def pair_prompt(tokenizer: Any, spec: Any, a: str, b: str) -> dict[str, Any]:
    """A text pair as a cross-encoder reads it: the tokenizer's pair encoding (BERT's
    [CLS] a [SEP] b [SEP] with segment ids 0 and 1, XLM-R's <s> a </s></s> b </s>)."""
    if tokenizer is None:
        raise ValueError("scoring a text pair needs the model's tokenizer")
    enc = tokenizer(a, b)
    prompt: dict[str, Any] = {"prompt_token_ids": list(enc["input_ids"])}
    types = enc.get("token_type_ids")
    if types is not None and getattr(spec.hf_config, "type_vocab_size", 0):
        prompt["token_type_ids"] = list(types)
    return prompt


def score_prompts(tokenizer: Any, spec: Any, pairs: list[tuple[str, str]]) -> list[Any]:
    """What to pool to score `pairs`: each pair as a cross-encoder reads it, or each distinct
    text once for an embedding model. ValueError for a model that does not score."""
    check_scorer(spec)
    if spec.task == "classify":
        return [pair_prompt(tokenizer, spec, a, b) for a, b in pairs]
    return list(dict.fromkeys(t for pair in pairs for t in pair))


def pair_scores(
    spec: Any, pairs: list[tuple[str, str]], prompts: list[Any], pooled: list[list[float]]
) -> list[float]:
    """Each pair's score from `score_prompts`' pooled outputs: a cross-encoder's activated
    logit, or the cosine of the two texts' embeddings."""
    if spec.task == "classify":
        activation = classifier_activation(spec.hf_config)
        return [float(activate(torch.tensor(row), activation)[0]) for row in pooled]
    vectors = {t: torch.tensor(v) for t, v in zip(prompts, pooled, strict=True)}
    return [float(F.cosine_similarity(vectors[a], vectors[b], dim=0)) for a, b in pairs]


def check_scorer(spec: Any) -> None:
    """ValueError unless the model scores pairs: a one-label classifier or an embedding
    model."""
    if spec.task == "classify":
        labels = int(spec.hf_config.num_labels)
        if labels != 1:
            raise ValueError(f"scores need a cross-encoder with one label; this classifier has "
                             f"{labels}: classify its texts instead")  # fmt: skip
    elif spec.task != "embed":
        raise ValueError(f"scores need a cross-encoder or an embedding model; this model's "
                         f"task is {spec.task}")  # fmt: skip
