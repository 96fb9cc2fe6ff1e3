"""Frozen engine configuration, validated on construction.

"auto" values (dtype, max_model_len) are resolved by `resolve_engine_config` before the frozen
`EngineConfig` is built; nothing patches a config afterwards.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch

from ember.attention import BACKEND_NAMES
from ember.cpu import cpu_has_native_bf16

logger = logging.getLogger("ember")

# Weight-only quantization schemes (`ember.quant`).
QUANTIZATIONS = ("int8",)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def user_cache_dir(*parts: str) -> str:
    """`$XDG_CACHE_HOME/ember/...` (default `~/.cache/ember/...`): checkpoints ember builds and
    compile caches."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ember", *parts)


def _check_range(name: str, value: int | float, low: int | float, high: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def resolve_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None) -> torch.dtype:
    """Map a user dtype ("auto", "float32", "bfloat16", "float16", torch.dtype) to the run dtype.

    "auto" is float32 on CPUs without native bf16 math, where bf16 GEMMs are several times
    slower; else the checkpoint's dtype. float16 is cast to bfloat16 with a warning.
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if not cpu_has_native_bf16() or config_dtype in (None, torch.float32):
            resolved = torch.float32
        else:
            resolved = torch.bfloat16
    elif isinstance(dtype, str) and dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(
            f"dtype must be one of auto, float32, bfloat16, float16, int8; got {dtype!r}"
        )
    if resolved == torch.float16:
        warnings.warn("float16 is not supported on CPU; casting to bfloat16", stacklevel=3)
        resolved = torch.bfloat16
    if resolved not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, got {resolved}")
    return resolved


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, fixed for the engine's lifetime.

    Units: `kv_cache_gib` in GiB for all layers' K and V together; `block_size` in tokens;
    `max_model_len` in tokens (prompt + output of one request).
    """

    model: str
    dtype: torch.dtype
    kv_cache_gib: float
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    seed: int
    compile: bool
    compile_cache_dir: str | None = None
    freeze_weights: bool = False
    token_buckets: tuple[int, ...] = (1,)
    max_logprobs: int = 20
    attention_backend: str = "torch"
    # "generate" (causal LM), "encdec" (encoder-decoder LM) or "embed" (encoder-only model:
    # `LLM.embed` only)
    task: str = "generate"
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # Weight-only quantization of every linear layer: None or "int8" (per-output-channel
    # scales; activations, KV cache and math stay in `dtype`, which must be float32).
    quantization: str | None = None

    def __post_init__(self) -> None:
        _check_range("kv_cache_gib", self.kv_cache_gib, 1e-6, 1024)
        _check_range("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size must be a power of two in [1, 1024], got {self.block_size}"
            )
        _check_range("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        _check_range("max_model_len", self.max_model_len, 1, 1 << 24)
        _check_range("max_logprobs", self.max_logprobs, 0, 1 << 20)
        if (
            not self.token_buckets
            or list(self.token_buckets) != sorted(set(self.token_buckets))
            or self.token_buckets[0] < 1
            or self.token_buckets[-1] > self.max_num_batched_tokens
        ):
            raise ValueError(
                "token_buckets must be increasing sizes in [1, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}], got {self.token_buckets}"
            )
        if self.freeze_weights and self.compile_cache_dir is not None:
            raise ValueError(
                "freeze_weights=True cannot be combined with compile_cache_dir: inductor cannot "
                "cache graphs with frozen (prepacked) weights"
            )
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype}")
        _check_range("max_loras", self.max_loras, 1, 64)
        _check_range("max_lora_rank", self.max_lora_rank, 1, 512)
        if self.enable_lora and self.task != "generate":
            raise ValueError(f"enable_lora=True needs a decoder-only LM; this model is {self.task}")
        if self.enable_lora and self.freeze_weights:
            raise ValueError(
                "enable_lora=True cannot be combined with freeze_weights=True: adapter slots "
                "change between steps and must not be folded into the graph"
            )
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(
                    f"quantization must be None or one of {QUANTIZATIONS}, "
                    f"got {self.quantization!r}"
                )
            if self.dtype != torch.float32:
                raise ValueError(
                    f"quantization={self.quantization!r} computes in float32; dtype must be "
                    f"float32, got {self.dtype}"
                )
            if self.enable_lora or self.task != "generate":
                raise ValueError(
                    f"quantization={self.quantization!r} supports decoder-only LMs without "
                    "LoRA (enable_lora=False)"
                )
        if self.attention_backend not in BACKEND_NAMES[1:]:
            raise ValueError(
                f"attention_backend must be one of {BACKEND_NAMES[1:]} once resolved, "
                f"got {self.attention_backend!r}"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache, derived from the model and `EngineConfig.kv_cache_gib`."""

    layer_shapes: tuple[tuple[int, int], ...]  # (num_kv_heads, head_dim) of each layer's cache
    block_size: int
    num_blocks: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * elem * sum(h * d for h, d in self.layer_shapes)

    @staticmethod
    def num_blocks_for(
        kv_cache_gib: float,
        layer_shapes: tuple[tuple[int, int], ...],
        block_size: int,
        dtype: torch.dtype,
    ) -> int:
        """How many blocks of this geometry fit in `kv_cache_gib`."""
        one = KVCacheSpec(layer_shapes, block_size, 1, dtype)
        return int(kv_cache_gib * (1 << 30)) // one.bytes_per_block
