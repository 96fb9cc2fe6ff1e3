"""ember's linears: packed weights and fp32 math (`PackedLinear`, `Int8Linear`), or the GEMV over
the checkpoint's own layout (`GemvLinear`).

- fp32 activations (every CPU without native bf16 math, and fp32 / int8 models everywhere):
  each nn.Linear becomes a `PackedLinear`. Its weight (fp32, bf16, or int8 with one fp32 scale
  per output channel) is re-laid once, at load, into panels of output channels
  (`ember_cpu::pack_linear_weight`) and every step runs one kernel for every size
  (`ember_cpu::packed_linear`): an outer-product register block that widens the narrow weight
  to fp32 in registers. A decode reads each weight byte once; a prefill chunk or batched decode
  reuses each widened weight vector for up to 12 rows of x (llama-160m's projections, AMD EPYC
  2 cores: bf16 M=32 434 GFLOP/s, M=128 427, against ~200 for ATen's fp32 GEMM; see the
  kernel's comment). No widened copy of a weight is ever written.
- bf16 activations on CPUs with AVX512-BF16 but no AMX: `PackedLinear` too, with the weight
  re-laid in pairs of k (`ember_cpu::pack_bf16_pairs`) that vdpbf16ps multiplies: bf16
  products, fp32 sums, y rounded to bf16 once. llama-160m's projections, AMD EPYC 2 cores, ms
  per 12-layer pass against the [N, K] GEMV / oneDNN: M=1 1.85 vs 1.81, M=8 2.81 vs 10.56,
  M=32 8.46 vs 17.30, M=128 29.7 vs 41.1, M=2048 508 vs 566 (914 GFLOP/s).
- bf16 activations on AMX CPUs: `GemvLinear` keeps the checkpoint's [N, K] bf16 weight: the
  dot-product GEMV for decode-sized steps, ATen's bf16 GEMM above (oneDNN's AMX kernels, which
  need that layout; not measured against the pairs here, where there is no AMX).
- An LM head tied to the input embedding is packed too, and the embedding lookup gathers its
  rows from the packed head (`PackedEmbedding`, times the scale for Gemma's scaled tables): the
  table is held once. (A table with more users, as BART's, keeps a `GemvLinear` head over the
  shared [vocab, d] table.)

A batch-1 decode step reads every weight once, so its floor is weight bytes / memory bandwidth;
int8 storage reads a quarter of fp32's bytes (half of bf16's).

int8 weights (`quantization="int8"`): every `nn.Linear` of the model, including an LM head
tied to the input embedding (the head gets its own int8 copy; the embedding table stays in the
run dtype, since a lookup reads one row of it). Symmetric per-output-channel scales,
`scale = max|w_row| / 127`. By default (`quantize_activations`) `Int8Linear` quantizes x to
int8 per group of 32 and multiplies in integers, as the group-quantized linears do; 2048- and
8192-wide projections, 2-core Intel Xeon (AVX512-VNNI), ms against widening the codes to fp32:
M=1 0.70 vs 0.74, M=4 0.84 vs 1.33, M=32 3.42 vs 7.38, M=128 12.2 vs 28.6 (AVX2 forced, no
VNNI: 0.85 vs 1.00, 1.76 vs 1.94, 12.5 vs 13.7, 50.1 vs 52.5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ember import kernels
from ember.host.isa import cpu_has_int8_dot
from ember.host.memory import weight_zeros
from ember.model.layers.panels import (
    GROUP_SIZE,
    _from_panels,
    _pack_panels_into,
    _quad_panels,
    _row_panels,
    row_chunk,
)


class PackedLinear(nn.Module):
    """`y = (x @ w.T) * scales + bias`, the weight packed into panels (see the module doc); a
    drop-in for nn.Linear. `quantize=True`: int8 weights with per-channel scales; `pairs=True`:
    a bf16 weight in pairs of k, for bf16 activations."""

    packed: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, quantize: bool = False, pairs: bool = False) -> None:
        kernels.load()
        w = linear.weight.detach()
        scales = None
        if quantize:
            w, scales = _quantize_int8_rows(w)
        # pairs: bf16 weights for bf16 activations (vdpbf16ps); else fp32 math panels.
        pack = (
            torch.ops.ember_cpu.pack_bf16_pairs if pairs else torch.ops.ember_cpu.pack_linear_weight
        )
        self._init_from(linear, pack(w), scales, pairs)

    def _init_from(
        self, linear: nn.Linear, packed: torch.Tensor, scales: torch.Tensor | None, pairs: bool
    ) -> None:
        """Module state for `linear`'s sizes and bias (fp32), holding `packed` and `scales`."""
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.pairs = pairs
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_weights(
        cls,
        parts: list[tuple[torch.Tensor, torch.Tensor | None]],
        orders: list[torch.Tensor | None] | None = None,
        done: Callable[[int, int, int], None] | None = None,
    ) -> PackedLinear:
        """One `PackedLinear` (fp32 math) computing the weights of `parts` ((weight [n, K],
        bias or None) of one dtype and K; each weight but the last fills whole panels) side by
        side, each packed straight into its panels of one `weight_zeros` tensor: from a GGUF
        file's map into the load's weight arena, with no copy in between (the whole-weight
        copy, then `fuse_projections_`' concatenation, then the packer's own output and
        `move_to_huge_pages` each wrote the weight again). `orders[i]`, when given, lists the
        rows of part i in the order they are packed (a row permutation). Rows go a
        `row_chunk` at a time; `done(i, start, end)` is called once rows [start, end) of part
        i are read (a GGUF load drops their file pages: an F16 table tied to the head, packed
        last, no longer sits whole in RSS beside the packed weights)."""
        panel = kernels.panel_width()
        weights = [w for w, _ in parts]
        k, dtype = weights[0].shape[1], weights[0].dtype
        if any(w.shape[1] != k or w.dtype != dtype for w in weights):
            raise ValueError("PackedLinear.from_weights: parts differ in dtype or input size")
        if any(w.shape[0] % panel for w in weights[:-1]):
            raise ValueError(
                f"PackedLinear.from_weights: each part but the last needs a multiple of {panel}"
                " rows"
            )
        n = sum(w.shape[0] for w in weights)
        packed = weight_zeros((-(-n // panel), k, panel), dtype)
        start = 0
        with torch.no_grad():
            step, orders = row_chunk(k), orders or [None] * len(parts)
            for i, (w, order) in enumerate(zip(weights, orders, strict=True)):
                for r in range(0, w.shape[0], step):
                    rows = w[r : r + step] if order is None else w[order[r : r + step]]
                    _pack_panels_into(rows, packed[start + r // panel :])
                    if done is not None and order is None:
                        done(i, r, r + rows.shape[0])
                if done is not None and order is not None:
                    done(i, 0, w.shape[0])  # a permutation reads rows from all over
                start += w.shape[0] // panel
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.pairs = k, n, False
        self.register_buffer("packed", packed)
        self.register_buffer("scales", None)
        self.register_buffer("bias", cat_biases([b for _, b in parts], [len(w) for w in weights]))
        return self

    @property
    def weight(self) -> torch.Tensor:
        """HF code reads `proj.weight.dtype`/`.device`; the packed tensor answers both."""
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ember_cpu.packed_linear(
            x, self.packed, self.scales, self.bias, self.out_features
        )

    def extra_repr(self) -> str:
        dtype = str(self.packed.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, {dtype} packed"


class Int8Linear(PackedLinear):
    """int8 weights with one fp32 scale per output channel (scale = max|w| / 127), packed.

    `int8_activations` (where the input size is a multiple of 32): the codes are laid out for
    integer dot products (`packed` [P, K / 4, panel, 4] uint8 holding q + 128, `scales` fp32
    [P * panel]) and `ember_cpu::packed_linear` quantizes x to int8 per group of 32 as the
    group kernels do (vpdpbusd / vpmaddubsw, one fp32 FMA per group, the channel's scale
    once). Else the codes stay int8 [P, K, panel] and are widened to fp32 for fp32 FMAs:
    fp32 activations, the exactness reference.

    `per_token` (with `int8_activations`; any input size; CPUs with int8 dot products only,
    `cpu_has_int8_dot`, else ignored): x is quantized per token (one scale per row) and
    multiplied by oneDNN's int8 GEMM (`torch._int_mm`: AMX-INT8 or VNNI kernels by CPU), the
    int32 sums scaled once; `packed` holds the codes int8 [N, K]. For
    encoder (embedding) models, whose every step is a compute-bound batch of whole texts, as
    ONNX Runtime's dynamic int8 quantization of BERT scales activations per tensor:
    all-MiniLM-L6-v2's projections at 2,048 tokens ran at 1.0-4.1 TOP/s there against
    0.6-0.8 for the group kernel (Intel Xeon, AMX). Without VNNI oneDNN's int8 sums saturate
    (`cpu_has_int8_dot`)."""

    def __init__(
        self, linear: nn.Linear, int8_activations: bool = True, per_token: bool = False
    ) -> None:
        kernels.load()  # its ISA, and the panel width `_quad_panels` packs for
        per_token = per_token and cpu_has_int8_dot(kernels.loaded_isa() or "native")
        if not int8_activations or (linear.in_features % GROUP_SIZE and not per_token):
            super().__init__(linear, quantize=True)
            return
        codes, scales = _quantize_int8_rows(linear.weight.detach())
        if not per_token:
            stored = (codes.to(torch.int16) + 128).to(torch.uint8)
            codes, scales = _quad_panels(stored), _row_panels(scales[:, None]).flatten()
        self._init_from(linear, codes, scales, pairs=False)

    @property
    def int8_activations(self) -> bool:
        return self.packed.dim() in (2, 4)

    @property
    def per_token(self) -> bool:
        return self.packed.dim() == 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.per_token:
            return super().forward(x)
        assert self.scales is not None
        rows = x.reshape(-1, self.in_features).float()
        amax = rows.abs().amax(dim=-1, keepdim=True)
        xq = torch.round(rows * (127.0 / amax.clamp(min=1e-30))).to(torch.int8)
        y = torch._int_mm(xq, self.packed.t()).float() * (amax / 127.0) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes [N, K], fp32 scales [N]) as quantized, from any layout."""
        n = self.out_features
        assert self.scales is not None
        if self.per_token:
            return self.packed, self.scales
        if self.int8_activations:
            rows = _from_panels(self.packed, torch.arange(n)).flatten(-2)
            return (rows.to(torch.int16) - 128).to(torch.int8), self.scales[:n]
        return self.packed.transpose(1, 2).reshape(-1, self.in_features)[:n], self.scales

    def extra_repr(self) -> str:
        path = (
            "int8 activations per token"
            if self.per_token
            else "int8 activations per group of 32"
            if self.int8_activations
            else "fp32 activations"
        )
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, {path}"


class PackedEmbedding(nn.Module):
    """The input embedding of a model whose LM head is tied to it and packed: each token's row
    is gathered from the head's packed weight (a row of panels, or of bf16 pairs), so the
    table is held once, in the layout the head's GEMM wants. A scaled table (Gemma's
    `scalar_embed_scale`) multiplies the rows by its scale in their own dtype, as HF does, or
    in fp32 for fp16 rows (widened exactly first: fp16 is a storage type here)."""

    packed: torch.Tensor

    def __init__(
        self, embedding: nn.Embedding, head: PackedLinear, scale: float | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.pairs = head.pairs
        self.scale = scale
        self.register_buffer("packed", head.packed)  # the head's tensor, not a copy

    @property
    def weight(self) -> torch.Tensor:
        return self.packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._rows(ids)
        if self.scale is None:
            return rows
        if rows.dtype == torch.float16:
            rows = rows.float()
        return rows * torch.tensor(self.scale, dtype=rows.dtype)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        num_panels, depth, width = self.packed.shape
        if not self.pairs:  # [P, K, panel][p, :, c] -> [..., K]
            return self.packed[ids // width, :, ids % width]
        panel = width // 2  # [P, K/2, panel, 2][p, :, c] -> [..., K/2, 2] -> [..., K]
        pairs = self.packed.view(num_panels, depth, panel, 2)
        return pairs[ids // panel, :, ids % panel].flatten(-2)[..., : self.embedding_dim]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the tied head's packed weight"


class GemvLinear(nn.Module):
    """nn.Linear with a bf16 or fp32 weight through ember's kernels (`ember_cpu::bf16_linear` /
    `fp32_linear`): the fused GEMV for decode-sized steps; see the module doc for larger ones.
    Holds the same weight Parameter, so tied weights stay tied."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        kernels.load()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.op = self._op(self.weight.dtype)

    @staticmethod
    def _op(dtype: torch.dtype) -> Any:
        if dtype == torch.bfloat16:
            return torch.ops.ember_cpu.bf16_linear.default
        if dtype == torch.float32:
            return torch.ops.ember_cpu.fp32_linear.default
        raise ValueError(f"GemvLinear needs a bf16 or fp32 weight, got {dtype}")

    def __getstate__(self) -> dict[str, Any]:  # the op is looked up again (`packed_cache`)
        return {k: v for k, v in self.__dict__.items() if k != "op"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        kernels.load()
        self.op = self._op(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        dtype = str(self.weight.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, {dtype} GEMV"


def gathers_rows(module: nn.Module | None) -> bool:
    """An embedding whose lookup is a plain row gather, or one times a constant scale (Gemma's
    `scalar_embed_scale`): its table can be read from a packed or quantized weight."""
    if not isinstance(module, nn.Embedding) or module.max_norm is not None:
        return False
    return type(module) is nn.Embedding or hasattr(module, "scalar_embed_scale")


def _quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K], scales fp32 [N]) of w per output channel (scale = max|w| / 127),
    `row_chunk` rows at a time: a 16-bit weight is widened to fp32 a chunk at a time, never
    as a whole (Qwen2-0.5B's 136M-value LM head in fp32 is 545 MB, and each step of the
    rounding held another such temporary)."""
    n, k = w.shape
    codes = torch.empty((n, k), dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.float32)
    step = row_chunk(k)
    for i in range(0, n, step):
        rows = w[i : i + step].float()
        s = rows.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        codes[i : i + step] = torch.round(rows / s[:, None]).clamp(-127, 127)
        scales[i : i + step] = s
    return codes, scales


def cat_biases(biases: list[torch.Tensor | None], sizes: list[int]) -> torch.Tensor | None:
    """The fp32 bias of projections of `sizes` outputs computed side by side: theirs, zeros
    for those without one; None where none has one."""
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.detach().float() if b is not None else torch.zeros(n)
            for b, n in zip(biases, sizes, strict=True)
        ]
    )
