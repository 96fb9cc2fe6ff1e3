"""Pooling of per-token hidden states into one embedding per sequence (vLLM's `embed` task).

The pooling mode and normalisation come from the sentence-transformers files of the checkpoint
when present (`modules.json`, `<pooling dir>/config.json`, a `Normalize` module), as
sentence-transformers itself would apply them; otherwise mean pooling for encoder models and
last-token pooling for causal LMs, L2-normalised (vLLM's defaults for `embed`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
