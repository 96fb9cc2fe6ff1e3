"""Load an HF causal LM with its attention routed to ember's paged-attention op.

The HF modeling code is used unmodified: only `attn_implementation` is set to ember's function
in transformers' attention registry. This module is also the one place that will call
`torch.compile` (see `capture_forward`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

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


def check_supported(config: PretrainedConfig) -> type[PreTrainedModel]:
    """Return the causal-LM class for `config`, or raise naming the architecture."""
    archs = getattr(config, "architectures", None) or [config.model_type]
    arch = archs[0]
    causal_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    declared = getattr(config, "architectures", None)
    if causal_name is None or (declared and causal_name not in declared):
        raise UnsupportedModelError(
            f"architecture {arch!r} (model_type {config.model_type!r}) is not a causal LM "
            "that ember can capture"
        )
    model_cls: type[PreTrainedModel] = AutoModelForCausalLM._model_mapping[type(config)]  # type: ignore[assignment]
    if not getattr(model_cls, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"architecture {arch!r} does not route attention through transformers' attention "
            "interface, so ember cannot capture it"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"architecture {arch!r} is encoder-decoder; not supported yet")
    return model_cls


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
        bidirectional=bool(getattr(config, "is_encoder_decoder", False)),
        kv_sharing=bool(getattr(config, "num_kv_shared_layers", 0)),
    )


def load_causal_lm(model_dir: str, dtype: torch.dtype, backend: str = "torch") -> PreTrainedModel:
    """Load weights (safetensors, offline) in `dtype`, eval mode, attention routed to `backend`'s
    paged-attention op."""
    config = load_hf_config(model_dir)
    check_supported(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(
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
