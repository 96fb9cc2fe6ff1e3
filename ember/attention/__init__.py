"""Attention backends: a registry of paged-attention implementations behind one op signature.

Every backend module defines a custom op with the contract of `ember.attention.ops`, and may
define `release()` to free per-process scratch memory; its registry entry gives the KV-cache
layout, an availability check and a feature check.
Backends whose libraries are optional ("ipex", "triton") are imported only when selected.
The model's attention features are checked at load time, so a model a backend cannot run fails
before any weights are touched, with a message naming the backend and the feature.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ember.attention.ops import kv_row_width

BACKEND_NAMES = ("auto", "torch", "ipex", "triton")


class BackendUnavailableError(ValueError):
    """The requested backend cannot run here, or cannot run this model."""


@dataclass(frozen=True)
class AttentionFeatures:
    """What a model needs from its attention backend."""

    kv_dtype: torch.dtype
    activation_dtype: torch.dtype | None = None  # the queries' (None: kv_dtype)
    sliding_window: bool = False
    softcap: bool = False
    bidirectional: bool = False
    kv_sharing: bool = False
    cross_attention: bool = False  # encoder-decoder: cross K/V written by ember::write_kv_cache
    sinks: bool = False  # a learned per-head softmax logit (ember::sink_scale, default layout)


@dataclass(frozen=True)
class AttentionBackend:
    """One backend. `load_op` imports the backend module and returns its op (lazily)."""

    name: str
    module: str
    op_name: str
    kv_dtypes: tuple[torch.dtype, ...]
    softcap: bool
    sliding_window: bool
    bidirectional: bool
    # [2, num_blocks, block_size, num_kv_heads, head_dim] unless a backend's kernels need
    # another layout; tensors are allocated by the runner from this shape.
    kv_layout: str = "blocks_slots_heads"
    unavailable: Callable[[], str | None] = lambda: None
    # attends a cache narrower than its queries (a bf16 cache under fp32 math)
    mixed_kv_dtype: bool = True

    def kv_cache_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
    ) -> tuple[int, ...]:
        """The shape of one layer's cache; an int8 cache's rows carry their scale
        (`ember.attention.ops.kv_row_width`)."""
        row = head_dim if dtype is None else kv_row_width(head_dim, dtype)
        if self.kv_layout == "blocks_heads_slots":
            return (2, num_blocks, num_kv_heads, block_size, row)
        return (2, num_blocks, block_size, num_kv_heads, row)

    def load_op(self, cpu_isa: str | None = None) -> Callable[..., torch.Tensor]:
        """The op (a backend module may choose it by what loads here: `load_op(cpu_isa)`)."""
        module = importlib.import_module(self.module)  # registers torch.ops.ember.<op_name>
        if hasattr(module, "load_op"):
            return module.load_op(cpu_isa)
        return getattr(torch.ops.ember, self.op_name)

    def load_opaque_op(self, cpu_isa: str | None = None) -> Callable[..., torch.Tensor] | None:
        """The op with the cache write left out of its schema, for compiled regions
        (`ember.compile.regions`), or None where the backend has none (no regions)."""
        module = importlib.import_module(self.module)
        load = getattr(module, "load_opaque_op", None)
        return load(cpu_isa) if load is not None else None

    def release(self) -> None:
        """Free the backend's per-process scratch memory (an engine closed), if it keeps any."""
        release = getattr(importlib.import_module(self.module), "release", None)
        if release is not None:
            release()

    def unsupported(self, features: AttentionFeatures) -> str | None:
        """Why this backend cannot run a model with `features`, or None."""
        if features.kv_sharing:
            return "cross-layer KV sharing"
        if features.kv_dtype not in self.kv_dtypes:
            return f"KV cache dtype {features.kv_dtype}"
        activation = features.activation_dtype or features.kv_dtype
        if activation != features.kv_dtype and not self.mixed_kv_dtype:
            return f"a {features.kv_dtype} KV cache under {activation} activations"
        if features.softcap and not self.softcap:
            return "attention logit soft-capping"
        if features.sliding_window and not self.sliding_window:
            return "sliding-window attention"
        if features.bidirectional and not self.bidirectional:
            return "bidirectional (encoder) attention"
        if features.cross_attention and self.kv_layout != "blocks_slots_heads":
            return "encoder-decoder cross-attention (its K/V writer uses the default layout)"
        if features.sinks and self.kv_layout != "blocks_slots_heads":
            return "attention sinks (ember::sink_scale reads the default layout)"
        return None


def _ipex_unavailable() -> str | None:
    try:
        version = importlib.metadata.version("intel_extension_for_pytorch")
    except importlib.metadata.PackageNotFoundError:
        return (
            "intel_extension_for_pytorch is not installed (pip install 'ember[ipex]'; its last "
            "release supports torch 2.8 only)"
        )
    # Checked before importing: IPEX aborts the process on a torch version mismatch.
    want = ".".join(torch.__version__.split(".")[:2])
    if ".".join(version.split(".")[:2]) != want:
        return (
            f"intel_extension_for_pytorch {version} needs torch "
            f"{'.'.join(version.split('.')[:2])}, this is torch {torch.__version__}"
        )
    try:
        import intel_extension_for_pytorch  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001
        return f"intel_extension_for_pytorch failed to import: {e}"
    return None


def _triton_unavailable() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'ember[triton]')"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton needs a CUDA/ROCm GPU (or TRITON_INTERPRET=1 to run its interpreter on CPU)"
    return None


_REGISTRY: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> None:
    _REGISTRY[backend.name] = backend


register_backend(
    AttentionBackend(
        name="torch",
        module="ember.attention.torch_cpu",
        op_name="paged_attention",
        kv_dtypes=(torch.float32, torch.bfloat16, torch.int8),
        softcap=True,
        sliding_window=True,
        bidirectional=True,
    )
)
register_backend(
    AttentionBackend(
        name="ipex",
        module="ember.attention.ipex_cpu",
        op_name="paged_attention_ipex",
        kv_dtypes=(torch.float32, torch.bfloat16),
        softcap=False,
        sliding_window=True,
        bidirectional=True,
        kv_layout="blocks_heads_slots",
        unavailable=_ipex_unavailable,
        mixed_kv_dtype=False,
    )
)
register_backend(
    AttentionBackend(
        name="triton",
        module="ember.attention.triton_paged",
        op_name="paged_attention_triton",
        kv_dtypes=(torch.float32, torch.bfloat16),
        softcap=True,
        sliding_window=True,
        bidirectional=True,
        unavailable=_triton_unavailable,
    )
)

# "auto": IPEX's kernels when they load, else the torch backend (ember runs on CPUs; the triton
# backend is chosen by name).
_AUTO_ORDER = ("ipex", "torch")


def get_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    return _REGISTRY[name]


def select_backend(name: str, features: AttentionFeatures | None = None) -> AttentionBackend:
    """The backend for `name` ("auto" picks the first usable one).

    Raises BackendUnavailableError naming the backend and why (library missing, or a model
    feature it lacks).
    """
    if name == "auto":
        reasons = []
        for candidate in _AUTO_ORDER:
            backend = _REGISTRY[candidate]
            why = backend.unavailable() or (features and backend.unsupported(features))
            if not why:
                return backend
            reasons.append(f"{candidate}: {why}")
        raise BackendUnavailableError(
            "no attention backend can run this model: " + "; ".join(reasons)
        )
    backend = get_backend(name)
    why = backend.unavailable()
    if why:
        raise BackendUnavailableError(f"attention backend {name!r} is unavailable: {why}")
    if features is not None:
        lacking = backend.unsupported(features)
        if lacking:
            raise BackendUnavailableError(
                f"{lacking} is not supported by attention backend {name!r}"
            )
    return backend
