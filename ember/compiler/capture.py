"""Load an HF causal LM with its attention routed to ember's paged-attention op.

The HF modeling code is used unmodified: only `attn_implementation` is set to ember's function
in transformers' attention registry. This module is also the one place that will call
`torch.compile` (see `capture_forward`).
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

from ember.attention import AttentionFeatures, get_backend
from ember.compiler.hf_bridge import register_attention


class UnsupportedModelError(ValueError):
    """The checkpoint cannot be served by ember; the message names the reason."""


def load_hf_config(model_dir: str) -> PretrainedConfig:
    """Read `config.json` of a local checkpoint directory, offline."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model must be a local checkpoint directory, got {model_dir!r}")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UnsupportedModelError(f"model directory {model_dir!r} has no config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (ValueError, OSError) as e:
        raise UnsupportedModelError(f"config.json of {model_dir!r} is not valid JSON: {e}") from e
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        arch = (raw.get("architectures") or [raw.get("model_type")])[0]
        raise UnsupportedModelError(
            f"architecture {arch!r} of {model_dir!r} is not known to transformers: {e}"
        ) from e


def model_task(config: PretrainedConfig) -> str:
    """ "generate" for a causal LM, "embed" for an encoder-only base model (`BertModel`);
    raises naming the architecture for anything else."""
    declared = getattr(config, "architectures", None)
    arch = (declared or [config.model_type])[0]
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"architecture {arch!r} is encoder-decoder; not supported yet")
    causal_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    base_name = MODEL_MAPPING_NAMES.get(config.model_type)
    if causal_name is not None and (not declared or causal_name in declared):
        task, auto_cls = "generate", AutoModelForCausalLM
    elif base_name is not None and declared and base_name in declared:
        task, auto_cls = "embed", AutoModel
    else:
        raise UnsupportedModelError(
            f"architecture {arch!r} (model_type {config.model_type!r}) is neither a causal LM "
            "nor an encoder base model that ember can capture"
        )
    model_cls = auto_cls._model_mapping[type(config)]
    if not getattr(model_cls, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"architecture {arch!r} does not route attention through transformers' attention "
            "interface, so ember cannot capture it"
        )
    return task


def attention_features(config: PretrainedConfig, kv_dtype: torch.dtype) -> AttentionFeatures:
    """What the model's attention layers need from a backend, read from its config."""
    _, _, head_dim = kv_geometry(config)
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in layer_types or bool(
        window and getattr(config, "use_sliding_window", True)
    )
    return AttentionFeatures(
        head_dims=(head_dim,),
        kv_dtype=kv_dtype,
        sliding_window=sliding,
        softcap=bool(getattr(config, "attn_logit_softcapping", None)),
        bidirectional=model_task(config) == "embed",
        kv_sharing=bool(getattr(config, "num_kv_shared_layers", 0)),
    )


def load_model(model_dir: str, dtype: torch.dtype, backend: str = "torch") -> PreTrainedModel:
    """Load weights (safetensors, offline) in `dtype`, eval mode, attention routed to `backend`'s
    paged-attention op: the causal LM, or the encoder base model of an embedding model."""
    config = load_hf_config(model_dir)
    auto_cls = AutoModelForCausalLM if model_task(config) == "generate" else AutoModel
    try:
        model = auto_cls.from_pretrained(
            model_dir,
            dtype=dtype,
            attn_implementation=register_attention(get_backend(backend)),
            local_files_only=True,
            use_safetensors=None,
        )
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise UnsupportedModelError(f"cannot load weights of {model_dir!r}: {e}") from e
    model.eval().requires_grad_(False)
    return model


def kv_geometry(config: PretrainedConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the text model."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def capture_hidden_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """The forward for pooling: same arguments as `capture_forward`'s, returns the last hidden
    states [num_tokens, hidden] (after the final norm) of the encoder or the causal LM's base
    model. `logits_indices` is unused (pooling needs every row)."""
    base = model.get_decoder() if model_task(model.config) == "generate" else model
    extra: dict[str, Any] = {}
    if "token_type_ids" in inspect.signature(base.forward).parameters:
        extra["token_type_ids"] = 0

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        types = {k: torch.zeros_like(input_ids)[None] for k in extra}
        out = base(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
            **types,
        )
        return out.last_hidden_state[0]

    return forward


def capture_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """The forward the runner calls: `(input_ids, positions, logits_indices, meta, kv_caches)`.

    Returns logits [num_logits, vocab] for the rows at `logits_indices`.
    """

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        out = model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            logits_to_keep=logits_indices,
            use_cache=False,
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
        )
        return out.logits[0]

    return forward


def compile_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The one `torch.compile` call site; no graph breaks allowed.

    Dynamo makes one graph per static token bucket and one with a dynamic token count (see
    `ember.runtime.buckets`). Compilation happens on the first call of each; the runner warms
    them all inside `ember.compiler.inductor.compile_settings()` before serving.
    """
    return torch.compile(forward, fullgraph=True)
