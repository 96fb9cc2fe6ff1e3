"""Write an HF Llama / Mistral / Qwen2 / Qwen2-MoE / Qwen3-MoE checkpoint as a GGUF file, as
llama.cpp's `convert_hf_to_gguf.py` lays it out (tensor names, Q/K row permutation for
Llama-family files, GPT-2-style BPE vocabulary), with the `gguf` package's writer and quantizers.

Tests and benchmarks use it to build GGUF files of ember's random checkpoints offline, in every
type the `gguf` package can quantize to (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; K-quants
it only dequantizes). Norms, other 1-D tensors and MoE routers are always F32, as llama.cpp
writes them; experts are 3-D tensors `blk.N.ffn_{gate,up,down}_exps` [E, rows, K].

usage: python -m ember.tools.gguf_writer CHECKPOINT_DIR OUT.gguf [TYPE]
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

# model_type -> GGUF architecture (llama.cpp writes Mistral checkpoints as "llama").
_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
}

# An HF experts module's stacked weights -> the GGUF expert tensors (gate_up_proj [E, 2I, H] is
# written as gate [E, I, H] and up, as llama.cpp's converter splits it).
_EXPERTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for Llama-family GGUF files (rotary pairs interleaved)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _vocab(model_dir: str) -> tuple[list[str], list[str], list[int]]:
    """Tokens (by id), BPE merges and token types of a byte-level BPE `tokenizer.json`."""
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = [""] * (max(vocab.values()) + 1)
    for token, idx in vocab.items():
        tokens[idx] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    types = [3 if t in special else 1 for t in tokens]  # 3: control, 1: normal
    return tokens, merges, types


def write_gguf(
    model_dir: str,
    path: str,
    qtype: str = "F16",
    types: dict[str, str] | None = None,
    name: str | None = None,
) -> str:
    """Write the checkpoint in `model_dir` to `path`: 2-D weights in `qtype` (a
    `GGMLQuantizationType` name), those named in `types` (GGUF tensor name -> type) in theirs;
    1-D tensors F32. Returns `path`."""
    import gguf

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    arch = _ARCH.get(config.model_type)
    if arch is None:
        raise ValueError(f"write_gguf: model_type {config.model_type!r} is not supported")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name or ("mistral" if config.model_type == "mistral" else config.model_type))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        shared = getattr(config, "shared_expert_intermediate_size", None)
        if shared:
            writer.add_expert_shared_feed_forward_length(shared)
    tokens, merges, token_types = _vocab(model_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    eos = config.eos_token_id
    if eos is not None:
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    # transformers 5 saves a template as chat_template.jinja, older ones in tokenizer_config.json:
    # the tokenizer reads either.
    template = AutoTokenizer.from_pretrained(model_dir, local_files_only=True).chat_template
    if isinstance(template, str) and template:
        writer.add_chat_template(template)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers
    )
    types = types or {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    del head_dim
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        if suffix in _EXPERTS and ".experts" in base:
            block = base.split(".layers.")[1].split(".")[0]
            parts = _EXPERTS[suffix]
            for gguf_part, data in zip(parts, tensor.float().chunk(len(parts), dim=1), strict=True):
                _add(writer, f"blk.{block}.{gguf_part}.weight", data.numpy(), types, qtype)
            continue
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"write_gguf: no GGUF name for {hf_name}")
        gguf_name = f"{gguf_name}.{suffix}"
        data = tensor.float().numpy()
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads
            if "attn_k" in gguf_name:
                heads = config.num_key_value_heads
            data = _permute(data, heads)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # [1, H] in HF, a vector in llama.cpp's files
        _add(writer, gguf_name, data, types, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: Any, gguf_name: str, data: np.ndarray, types: dict[str, str], qtype: str) -> None:
    """One tensor: 1-D ones (norms, biases) and MoE routers F32, as llama.cpp keeps them; the
    rest in `types[gguf_name]` or `qtype`."""
    import gguf

    router = gguf_name.endswith("ffn_gate_inp.weight")
    kind = "F32" if data.ndim == 1 or router else types.get(gguf_name, qtype)
    ggml_type = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    elif kind == "F16":
        writer.add_tensor(gguf_name, data.astype(np.float16))
    else:
        quantized = gguf.quants.quantize(np.ascontiguousarray(data), ggml_type)
        writer.add_tensor(gguf_name, quantized, raw_dtype=ggml_type)


if __name__ == "__main__":
    write_gguf(sys.argv[1], sys.argv[2], *(sys.argv[3:4] or ["F16"]))
