"""Tiny random checkpoints of every architecture in transformers' causal-LM mapping.

`tiny_config(model_type)` shrinks the architecture's default config to a few thousand
parameters: the same field names the config class takes (aliases through its
`attribute_map`), so a new architecture needs no entry here unless its defaults cannot be
shrunk generically.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 256
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
LAYERS = 4
WINDOW = 8  # crossed by every prompt the enumeration decodes

# Field name -> tiny value, set wherever the default config has the field (or its alias).
_SHRINK: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "sliding_window": WINDOW,
    "initializer_range": 0.1,
    # mixture of experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # linear attention and state-space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 8,  # x mamba_d_head = mamba_expand (2) x hidden_size
    "mamba_d_head": 16,
    "mamba_d_state": 8,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 8,
    "ssm_state_size": 8,
    "state_size": 8,
    "chunk_size": 8,
    "n_groups": 1,
    "time_step_rank": 8,
    # others
    "global_head_dim": HEAD_DIM,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    "rotary_dim": 8,
    # where the attention layers of a hybrid sit
    "attn_layer_indices": [1, 3],
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# MLA models rotate qk_rope_head_dim channels: their head_dim follows it.
_NOT_WITH = {"head_dim": "qk_rope_head_dim"}
# Nested sub-configs shrunk with the same table (vision towers and the like).
_SUB_CONFIGS = ("vision_config", "audio_config", "attn_config", "ffn_config")


def causal_model_types() -> list[str]:
    """Every model_type transformers maps to a causal-LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _has(config: PretrainedConfig, name: str) -> bool:
    if name in getattr(config, "attribute_map", {}):
        return True
    if isinstance(getattr(type(config), name, None), property):
        return False  # derived (FalconConfig.head_dim): set its sources instead
    try:
        return hasattr(config, name)
    except RuntimeError:  # a per-layer field (Gemma 4): read from the per-layer configs
        return name in config.to_dict()


def _shrunk(config: PretrainedConfig) -> dict[str, Any]:
    """`config`'s fields that the table shrinks, with their tiny values."""
    kw = {name: value for name, value in _SHRINK.items() if _has(config, name)}
    for name, unless in _NOT_WITH.items():
        if unless in kw:
            kw.pop(name, None)
    for sub in _SUB_CONFIGS:
        nested = getattr(config, sub, None)
        if isinstance(nested, PretrainedConfig):
            kw[sub] = {**_fields(nested), **_shrunk(nested)}
    return kw


def _fields(config: PretrainedConfig) -> dict[str, Any]:
    """`config` as constructor keywords, less what the constructor derives from the layer
    count (a per-layer list of the default depth)."""
    d = config.to_dict()
    depth = d.get("num_hidden_layers")
    for name, value in list(d.items()):
        per_layer = isinstance(value, list) and depth and len(value) == depth
        if per_layer or name in ("layer_types", "per_layer_config", "mlp_layer_types"):
            d.pop(name)
    return d


def tiny_config(model_type: str) -> PretrainedConfig:
    """The architecture's default config, shrunk; raises whatever the config class raises for
    an architecture that cannot be shrunk generically."""
    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    text = default.get_text_config()
    architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    kw = {**_shrunk(text), "tie_word_embeddings": False}
    if text is not default:
        outer = {k: v for k, v in _shrunk(default).items() if k in _SUB_CONFIGS}
        return config_cls(text_config={**_fields(text), **kw}, architectures=architectures, **outer)
    return config_cls(**kw, architectures=architectures)


def build(model_type: str, path: str, seed: int = 0) -> str:
    """A seeded random checkpoint of `model_type` saved (fp32) at `path`."""
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path
