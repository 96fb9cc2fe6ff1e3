"""Load an HF causal LM with its attention routed to ember's paged-attention op.

The HF modeling code is used unmodified: only `attn_implementation` is set to ember's function
in transformers' attention registry. This module is also the one place that will call
`torch.compile` (see `capture_forward`).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
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
    """ "generate" for a causal LM, "encdec" for an encoder-decoder LM (`BartForConditional
    Generation`), "embed" for an encoder-only base model (`BertModel`); raises naming the
    architecture for anything else."""
    declared = getattr(config, "architectures", None)
    arch = (declared or [config.model_type])[0]
    causal_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    base_name = MODEL_MAPPING_NAMES.get(config.model_type)
    seq2seq_name = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    auto_cls: Any
    if getattr(config, "is_encoder_decoder", False):
        if seq2seq_name is None or (declared and seq2seq_name not in declared):
            raise UnsupportedModelError(
                f"architecture {arch!r} is encoder-decoder but not a conditional-generation LM"
            )
        enc_heads = getattr(config, "encoder_attention_heads", None)
        if enc_heads != getattr(config, "decoder_attention_heads", enc_heads):
            raise UnsupportedModelError(
                f"architecture {arch!r}: encoder and decoder head counts differ; ember keeps both "
                "in one KV cache and needs them equal"
            )
        task, auto_cls = "encdec", AutoModelForSeq2SeqLM
    elif causal_name is not None and (not declared or causal_name in declared):
        task, auto_cls = "generate", AutoModelForCausalLM
    elif base_name is not None and declared and base_name in declared:
        task, auto_cls = "embed", AutoModel
    else:
        raise UnsupportedModelError(
            f"architecture {arch!r} (model_type {config.model_type!r}) is neither a causal LM "
            "nor an encoder base model that ember can capture"
        )
    model_cls = auto_cls._model_mapping[type(config)]
    # HF flags models tested with custom attention functions; BART-family models do not carry
    # the flag but dispatch every attention call through the same registry.
    routes = "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[model_cls.__module__])
    if not (getattr(model_cls, "_supports_attention_backend", False) or routes):
        raise UnsupportedModelError(
            f"architecture {arch!r} does not route attention through transformers' attention "
            "interface, so ember cannot capture it"
        )
    return task


def attention_features(config: PretrainedConfig, kv_dtype: torch.dtype) -> AttentionFeatures:
    """What the model's attention layers need from a backend, read from its config."""
    _, _, head_dim = kv_geometry(config)
    task = model_task(config)
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
        bidirectional=task in ("embed", "encdec"),
        cross_attention=task == "encdec",
        kv_sharing=bool(getattr(config, "num_kv_shared_layers", 0)),
    )


def load_model(model_dir: str, dtype: torch.dtype, backend: str = "torch") -> PreTrainedModel:
    """Load weights (safetensors, offline) in `dtype`, eval mode, attention routed to `backend`'s
    paged-attention op: the causal LM, or the encoder base model of an embedding model."""
    config = load_hf_config(model_dir)
    task = model_task(config)
    auto_cls = {"generate": AutoModelForCausalLM, "embed": AutoModel}.get(
        task, AutoModelForSeq2SeqLM
    )
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
    if task == "encdec":
        _prepare_encoder_decoder(model)
    return model


class _PositionsAddedByEmber(torch.nn.Module):
    """Stands in for an encoder-decoder model's learned position embedding.

    HF's BART-family encoder and decoder derive positions from the batch shape (0..T-1 plus the
    HF cache length), which is wrong for ember's flattened multi-sequence stream. ember adds
    each token's own position embedding to `inputs_embeds` (`_embed`), and this module adds
    zeros in its place: x + 0.0 == x, so the sum is bit-identical to HF's.
    """

    def __init__(self, original: torch.nn.Embedding) -> None:
        super().__init__()
        self.original = original

    def forward(
        self,
        input_ids: torch.Tensor | None,
        past_key_values_length: int = 0,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num = input_ids.shape[1] if input_ids is not None else position_ids.shape[-1]  # type: ignore[union-attr]
        weight = self.original.weight
        return weight.new_zeros(1, num, weight.shape[1])


def _prepare_encoder_decoder(model: PreTrainedModel) -> None:
    """Swap in `_PositionsAddedByEmber` and mark the decoder's cross-attention modules (the HF
    modeling code itself is untouched)."""
    arch = type(model).__name__
    for stack in (model.get_encoder(), model.get_decoder()):
        positions = getattr(stack, "embed_positions", None)
        if not isinstance(positions, torch.nn.Embedding) or not hasattr(positions, "offset"):
            raise UnsupportedModelError(
                f"{arch}: ember runs encoder-decoder models with learned absolute position "
                "embeddings (the BART family); this one has none it can place per sequence"
            )
        stack.embed_positions = _PositionsAddedByEmber(positions)
    for layer in model.get_decoder().layers:
        cross = getattr(layer, "encoder_attn", None)
        if cross is None:
            raise UnsupportedModelError(f"{arch}: decoder layers have no `encoder_attn`")
        cross._ember_cross_attention = True


def _embed(stack: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token embeddings plus each token's own position embedding: [1, num_tokens, d]."""
    learned = stack.embed_positions.original
    # nn.Embedding's lookup, not the module's own forward (which derives positions from shape).
    pos = torch.nn.functional.embedding(positions[None] + learned.offset, learned.weight)
    return stack.embed_tokens(input_ids[None]) + pos


def _global_value(config: PretrainedConfig, name: str) -> Any:
    """`config.<name>`, or its serialized global value for heterogeneous configs (Gemma 4),
    which refuse a global read of a per-layer field; per-layer values come from the modules
    (`kv_layer_shapes`)."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return config.to_dict().get(name)


def kv_geometry(config: PretrainedConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the text model. Encoder-decoder models keep
    encoder and decoder layers in the same per-layer caches: max of the two layer counts."""
    num_heads = config.num_attention_heads
    num_kv_heads = _global_value(config, "num_key_value_heads") or num_heads
    head_dim = _global_value(config, "head_dim") or config.hidden_size // num_heads
    num_layers = max(
        config.num_hidden_layers,
        getattr(config, "encoder_layers", 0) or 0,
        getattr(config, "decoder_layers", 0) or 0,
    )
    return num_layers, num_kv_heads, head_dim


def kv_layer_shapes(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """(num_kv_heads, head_dim) of each KV-cache layer, read from the loaded attention modules
    (models such as Gemma 4 give global-attention layers their own head_dim and K/V heads);
    layers whose modules do not say fall back to the config's geometry."""
    num_layers, num_kv_heads, head_dim = kv_geometry(model.config)  # type: ignore[arg-type]
    shapes = [(num_kv_heads, head_dim)] * num_layers
    for module in model.modules():
        idx, dim = getattr(module, "layer_idx", None), getattr(module, "head_dim", None)
        k_proj = getattr(module, "k_proj", None)
        out = getattr(k_proj, "out_features", None)
        if isinstance(idx, int) and isinstance(dim, int) and isinstance(out, int):
            if 0 <= idx < num_layers:
                shapes[idx] = (out // dim, dim)
    return tuple(shapes)


def capture_encoder_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """The encoder pass of an encoder-decoder model: `(input_ids, positions, attn_metadata,
    kv_caches)` -> encoder output [num_tokens, d].

    Runs the encoder over every request's input (bidirectional, its scratch K/V in the request's
    cross blocks), then writes each decoder layer's cross-attention K/V of that output into the
    same blocks, once per request (`ember::write_kv_cache`).
    """
    encoder, decoder = model.get_encoder(), model.get_decoder()

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        hidden = encoder(
            inputs_embeds=_embed(encoder, input_ids, positions),
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
        ).last_hidden_state[0]
        for i, layer in enumerate(decoder.layers):
            attn = layer.encoder_attn
            shape = (hidden.shape[0], -1, attn.head_dim)
            torch.ops.ember.write_kv_cache(
                kv_caches[i],
                attn.k_proj(hidden).view(shape),
                attn.v_proj(hidden).view(shape),
                attn_metadata.slot_mapping,
            )
        return hidden

    return forward


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


def _capture_decoder_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """An encoder-decoder model's decoder step, same signature and result as `capture_forward`.
    Cross-attention reads the K/V written by the encoder pass; HF's cross-attention modules get
    a one-row placeholder as `encoder_hidden_states` and their own K/V of it are ignored."""
    decoder = model.get_decoder()
    bias = getattr(model, "final_logits_bias", None)

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        embeds = _embed(decoder, input_ids, positions)
        hidden = decoder(
            inputs_embeds=embeds,
            encoder_hidden_states=embeds.new_zeros(1, 1, embeds.shape[-1]),
            use_cache=False,
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
        ).last_hidden_state[0]
        logits = model.get_output_embeddings()(hidden[logits_indices])
        return logits + bias[0] if bias is not None else logits

    return forward


def capture_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """The forward the runner calls: `(input_ids, positions, logits_indices, meta, kv_caches)`.

    Returns logits [num_logits, vocab] for the rows at `logits_indices`.
    """
    if model_task(model.config) == "encdec":
        return _capture_decoder_forward(model)

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
