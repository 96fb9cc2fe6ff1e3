"""The dtype rules, each stated once: the dtype linear weights are kept in (`resolve_dtype`),
the dtype of the math (`compute_dtype`: bf16 only with native bf16 math), the KV cache's
(`resolve_kv_cache_dtype`), and that quantized weights compute in fp32 on every CPU
(`quantized_dtypes`)."""

from __future__ import annotations

import warnings

import torch

from ember.host.isa import cpu_has_native_bf16

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "int8")

KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "int8")

# vLLM's 8-bit float cache names: not kept (see resolve_kv_cache_dtype).
_FP8_KV_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def resolve_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None) -> torch.dtype:
    """Map a user dtype ("auto", "float32", "bfloat16", "float16", torch.dtype) to the dtype the
    linear weights are stored in.

    "auto" keeps a 16-bit checkpoint's weights in 16 bits (a batch-1 decode step reads every
    weight once) and an fp32 checkpoint's in fp32. float16 is cast to bfloat16 with a warning.
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = torch.float32 if config_dtype in (None, torch.float32) else torch.bfloat16
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


def resolve_kv_cache_dtype(
    kv_cache_dtype: str | torch.dtype, auto: torch.dtype, run_dtype: torch.dtype
) -> torch.dtype:
    """The KV cache's dtype under activations of `run_dtype`; "auto" gives `auto`, the dtype
    the weights are kept in for a model that decodes. As vLLM's "auto" takes the model's
    dtype, a bf16 checkpoint's cache is bf16 also where the math is fp32 (no native bf16
    math); the attention kernels widen it as they read. Decode attention reads the whole cache
    every step, so this halves what it streams (AVX2 forced, AMD EPYC Zen 5, llama-160m: 8
    decodes at ~1,950 tokens, 16.6-17.0 -> 14.9-15.2 ms a step; W-THRU's 32 x 256 tokens,
    decode attention 0.50 -> 0.36 s of the run, about 1% end to end) and holds twice the
    tokens in `kv_cache_gib`. A bf16 cache under fp32 math is not bit-identical to HF in fp32;
    "float32" is.

    Where the linear weights are quantized, the caller passes int8 as `auto`
    (`ember.attention.ops.quantize_kv_rows`: a scale per token and K/V head), as OpenVINO
    keeps u8 on CPU. Measured (AMD EPYC, AVX-512 with bf16): teacher-forced top-5 agreement
    with HF fp32 on the real Gemma 3 270M Q4_K_M and SmolLM2-135M Q4_1 files was 100% for
    float32, bfloat16 and int8 caches alike, as for llama.cpp on the same files (argmax
    95.3-97.3% for all, 256 tokens each); llama-160m Q4_K_M at a 4,000-token depth decoded at
    5.65 ms a token with int8 against 7.08 with bfloat16 and 9.26 with float32 (the GGUF
    default before), and 1 GiB holds 164k tokens against 87k and 44k."""
    if isinstance(kv_cache_dtype, torch.dtype):
        resolved = kv_cache_dtype
    elif kv_cache_dtype == "auto":
        resolved = auto
    elif isinstance(kv_cache_dtype, str) and kv_cache_dtype in _DTYPES:
        resolved = _DTYPES[kv_cache_dtype]
    elif kv_cache_dtype == "int8":
        resolved = torch.int8
    elif kv_cache_dtype in _FP8_KV_NAMES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported on CPU; kv_cache_dtype='int8' "
            "is ember's 8-bit cache (a scale per token and head, 7 bits of precision against "
            "fp8's 2-3)"
        )
    else:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}; "
            f"got {kv_cache_dtype!r}"
        )
    if resolved not in (torch.float32, torch.bfloat16, torch.int8):
        raise ValueError(f"kv_cache_dtype must be float32, bfloat16 or int8, got {resolved}")
    if run_dtype == torch.bfloat16 and resolved == torch.float32:
        raise ValueError(
            f"kv_cache_dtype={str(resolved).removeprefix('torch.')!r}: this engine computes "
            "in bfloat16 (native bf16 math), which needs a bfloat16 or int8 KV cache; use "
            "dtype='float32' for a float32 cache"
        )
    return resolved


def compute_dtype(weight_dtype: torch.dtype, cpu_isa: str) -> torch.dtype:
    """The dtype of activations for weights stored in `weight_dtype`: bf16 only
    where the CPU has native bf16 math (AVX512-BF16 / AMX); elsewhere bf16 weights are widened
    to fp32 inside ember's kernels and all math runs in fp32 (ATen's bf16 GEMM on AVX2 ran at
    ~11 GFLOP/s against ~80 for fp32)."""
    if weight_dtype == torch.bfloat16 and cpu_has_native_bf16(cpu_isa):
        return torch.bfloat16
    return torch.float32


def quantized_dtypes(
    dtype: str | torch.dtype, quantization: str | None, gguf_file: str | None
) -> tuple[str | torch.dtype, str | None]:
    """(dtype, quantization) as the user's `dtype` and `quantization` ask, for a checkpoint or
    the GGUF file `gguf_file`: dtype "int8" is `quantization="int8"`, and quantized weights (by
    `quantization`, or a GGUF file's) compute in float32 on every CPU, so a config valid on
    one machine is valid on all (bf16 means fp32 math on AVX2)."""
    if dtype == "int8":
        dtype, quantization = "float32", "int8"
    if quantization is not None:
        if dtype not in ("auto", "float32", torch.float32):
            raise ValueError(
                f"quantization={quantization!r} computes in float32; dtype must be "
                f"float32 (or auto), got {dtype!r}"
            )
        dtype = "float32"
    if gguf_file is not None:
        if quantization is not None:
            raise ValueError(
                f"quantization={quantization!r} cannot apply to a GGUF file: its tensors "
                "are already quantized (Q8_0/Q4_0/Q4_1 run as they are)"
            )
        if dtype not in ("auto", "float32", torch.float32):
            raise ValueError(
                f"dtype={dtype!r}: a GGUF model runs with float32 activations (its "
                "quantized weights are multiplied in int8, the others in fp32); use auto "
                "or float32"
            )
        dtype = "float32"
    return dtype, quantization
