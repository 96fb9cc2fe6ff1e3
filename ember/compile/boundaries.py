"""The one list of ops that stay opaque to torch.compile (graph split points), and where each is
defined. Everything else in a captured step is inductor-generated code.

Each op is registered one way: ember's Python ops with `ember.kernels.library.define_op`, the C++
ops by `TORCH_LIBRARY` in `ember/kernels/csrc/ember_cpu.cpp`, the Triton kernel with
`torch.library.triton_op` (the only way inductor sees a Triton kernel); each has its fake
(shape) implementation beside it, and `tests/compiler/test_boundaries.py` opchecks them all.
"""

from __future__ import annotations

import importlib

# op -> the module that registers it (importing it registers the op).
OPAQUE_OPS: dict[str, str] = {
    "ember::paged_attention": "ember.attention.torch_cpu",
    "ember::paged_attention_rest": "ember.attention.torch_cpu",
    "ember_cpu::paged_attention": "ember.attention.torch_cpu",
    # the same ops with the cache write out of their schemas, for compiled regions
    # (`ember.compile.regions`)
    "ember::paged_attention_opaque": "ember.attention.torch_cpu",
    "ember_cpu::paged_attention_opaque": "ember.attention.torch_cpu",
    "ember::paged_attention_ipex": "ember.attention.ipex_cpu",
    "ember::paged_attention_triton": "ember.attention.triton_paged",
    "ember::write_kv_cache": "ember.attention.ops",
    "ember::cross_attention_ranges": "ember.attention.ops",
    "ember::sink_scale": "ember.attention.ops",
    "ember_cpu::moe_experts": "ember.kernels",  # a MoE layer over its quantized experts
    "ember::lora_shrink": "ember.lora.ops",
    "ember::lora_expand": "ember.lora.ops",
    "ember_cpu::packed_linear": "ember.kernels",
    "ember_cpu::group_linear": "ember.kernels",
    "ember_cpu::pack_linear_weight": "ember.kernels",
    "ember_cpu::pack_bf16_pairs": "ember.kernels",
    "ember_cpu::group_pack_codes": "ember.kernels",  # load time only, never in a graph
    "ember_cpu::group_pack_blocks": "ember.kernels",
    "ember_cpu::apply_token_bitmask": "ember.kernels",
    "ember_cpu::row_max": "ember.kernels",
    "ember_cpu::bf16_linear": "ember.kernels",
    "ember_cpu::fp32_linear": "ember.kernels",
}


def register(op: str) -> None:
    """Import the module that defines `op` (the C++ ops: build and load the kernels)."""
    importlib.import_module(OPAQUE_OPS[op])
    if op.startswith("ember_cpu::"):
        importlib.import_module("ember.kernels").load()
