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

import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from ember import kernels
from ember.host import HeapTrimmer, cpu_has_amx, cpu_has_int8_dot, weight_zeros

# Weight-only quantization schemes (`EngineArgs.quantization`).
QUANTIZATIONS = ("int8", "int4")
# k values per scale of the group-quantized layout (GGUF's Q8_0 / Q4_0 / Q4_1 blocks).
GROUP_SIZE = 32


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


# Called with a weight the model no longer holds once it has been re-laid out (packed,
# quantized or fused into a new tensor): `ember.compiler.loader`'s gives its pages of the
# checkpoint's file mapping back.
Consumed = Callable[[torch.Tensor], None]


def _replace_linears(
    model: nn.Module, make: Callable[[nn.Linear], nn.Module], consumed: Consumed | None = None
) -> int:
    """Replace every nn.Linear of `model` with `make(linear)`, in place, under every name it
    has (the fused linear of a `FusedSlice` group has one per slice); returns how many
    linears. `consumed` gets each replaced weight the new module does not hold."""
    # Names, not modules: each old linear is freed as soon as its last name is replaced.
    names = [
        name
        for name, module in model.named_modules(remove_duplicate=False)
        if type(module) is nn.Linear
    ]
    made: dict[int, nn.Module] = {}  # id of a replaced linear still named -> its replacement
    heap = HeapTrimmer()  # the old weights' heap pages go back to the OS as it goes
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if type(linear) is not nn.Linear:
            continue  # replaced through a shared parent's other name
        if id(linear) not in made:
            made[id(linear)] = module = make(linear)
            weight = linear.weight
            if consumed is not None and not _holds(module, weight):
                consumed(weight)
            heap.freed(weight.nbytes)
            del weight
        setattr(parent, child, made[id(linear)])
        del linear
    return len(made)


def _holds(module: nn.Module, t: torch.Tensor) -> bool:
    """Whether a tensor of `module` shares `t`'s storage."""
    ptr = t.untyped_storage().data_ptr()
    tensors = [*module.parameters(), *module.buffers()]
    return any(x.untyped_storage().data_ptr() == ptr for x in tensors)


def use_kernel_linears_(
    model: nn.Module, activations: torch.dtype, consumed: Consumed | None = None
) -> int:
    """Route every bf16/fp32 nn.Linear of `model` through ember's kernels, in place, for
    `activations` (the run dtype): `PackedLinear` for fp32 activations, and for bf16 ones with
    bf16 weights where the kernels have bf16 pairs and the CPU no AMX; else `GemvLinear`.

    An LM head tied to a plain `nn.Embedding`, or to a scaled one (Gemma's, with its
    `scalar_embed_scale`), is packed like the others and the embedding becomes a
    `PackedEmbedding` reading rows from the head's packed weight (the table is held once).
    Where the table has other users (BART's encoder and decoder share it) or the embedding is
    another subclass, the head stays a `GemvLinear` over the shared [vocab, d] table. Returns
    how many linears were replaced; `consumed` as `_replace_linears`."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    shared = getattr(embed, "weight", None)
    pairs = activations == torch.bfloat16 and kernels.bf16_pairs() and not cpu_has_amx()
    users = sum(p is shared for m in model.modules() for p in m.parameters(recurse=False))
    scale = getattr(embed, "scalar_embed_scale", None)
    pack_tied = gathers_rows(embed) and users == 2
    tied: list[PackedLinear] = []

    def make(linear: nn.Linear) -> nn.Module:
        if linear.weight is shared and not pack_tied:
            return GemvLinear(linear)
        if activations == torch.float32:
            module = PackedLinear(linear)
        elif pairs and linear.weight.dtype == torch.bfloat16:
            module = PackedLinear(linear, pairs=True)
        else:
            return GemvLinear(linear)
        if linear.weight is shared:
            tied.append(module)
        return module

    count = _replace_linears(model, make, consumed)
    if tied:
        assert isinstance(embed, nn.Embedding)
        packed = PackedEmbedding(embed, tied[0], None if scale is None else float(scale))
        model.set_input_embeddings(packed)  # type: ignore[operator]
    return count


def quantize_int8_(
    model: nn.Module,
    consumed: Consumed | None = None,
    int8_activations: bool = True,
    per_token: bool = False,
) -> int:
    """Replace every nn.Linear in `model` with an Int8Linear (`int8_activations`, `per_token`
    as there), in place; returns how many; `consumed` as `_replace_linears`."""
    make = functools.partial(Int8Linear, int8_activations=int8_activations, per_token=per_token)
    return _replace_linears(model, make, consumed)


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


def row_chunk(in_features: int) -> int:
    """Rows of a weight with `in_features` columns to convert at a time (a multiple of the
    panel width, about 1 Mi values): `GroupLinear.from_row_chunks`' unit."""
    panel = kernels.panel_width()
    return max(1, (1 << 20) // max(in_features, 1) // panel) * panel


def _row_panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / panel), panel, C]: rows grouped by panel, zeros past N."""
    panel = kernels.panel_width()
    rows, cols = t.shape
    padded = t.new_zeros(-(-rows // panel) * panel, cols)
    padded[:rows] = t
    return padded.view(-1, panel, cols)


def _pack_panels_into(w: torch.Tensor, out: torch.Tensor) -> None:
    """Write w [n, K] into the first panels of `out` [P, K, panel] (zeros past n), as
    `ember_cpu::pack_linear_weight` lays it out, without a temporary: whole panels as one
    strided copy, then the rows of a last, partial one."""
    n, k = w.shape
    panel = out.shape[2]
    full = n // panel
    if full:
        out[:full].copy_(w[: full * panel].view(full, panel, k).transpose(1, 2))
    if n % panel:
        out[full, :, : n % panel].copy_(w[full * panel :].t())


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / panel), C, panel], zeros past N: pack_linear_weight's layout."""
    return _row_panels(t).transpose(1, 2).contiguous()


def _quad_panels(t: torch.Tensor) -> torch.Tensor:
    """Bytes [N, C] -> [ceil(N / panel), C / 4, panel, 4], zeros past N: each channel's 4
    consecutive bytes in one 32-bit lane, the layout integer dot products read."""
    grouped = _row_panels(t)
    return grouped.unflatten(2, (-1, 4)).permute(0, 2, 1, 3).contiguous()


def _from_panels(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows (output channels) of a panel-packed [P, C, panel, ...] tensor, as [..., C, ...]."""
    panel = t.shape[2]
    return t[rows // panel, :, rows % panel]


# Rows of a group-quantized weight: codes [n, K] (int8 for 8 bits, else uint8), scales
# [n, K / 32] (6 bits: [n, K / 16]) and offsets shaped as scales, or None.
Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

# Super-blocks of 256 values (8 groups of 32): GGUF's Q4_K and Q6_K kept as the file holds them.
SUPER_BLOCK = 256


class SuperRows(NamedTuple):
    """Rows of a weight in super-blocks of 256 values (GGUF's k-quants, kept as they are):
    `codes` [n, K] uint8 (4-bit q in [0, 15], or 6-bit q in [0, 63]); `sub` the sub-blocks'
    scales, [n, K / 32] uint8 (Q4_K's 6-bit sc) or [n, K / 16] int8 (Q6_K's); `sub_mins`
    [n, K / 32] uint8 (Q4_K's 6-bit m) or None; `d` [n, K / 256] fp16 and `dm` (Q4_K: the
    offsets' scale, -dmin) or None. The value is d sc q + dm m (4-bit) or d sc (q - 32)
    (6-bit)."""

    codes: torch.Tensor
    sub: torch.Tensor
    sub_mins: torch.Tensor | None
    d: torch.Tensor
    dm: torch.Tensor | None


class Blocks(NamedTuple):
    """Rows of a weight as a GGUF file holds them: `data`, the bytes [n, row bytes] of blocks
    of `type` (one of `BLOCK_TYPES`), each row `in_features` values. `GroupLinear.
    from_row_chunks` packs them straight into its panels with `ember_cpu::group_pack_blocks`
    (the kernels must be `ready`)."""

    data: torch.Tensor
    in_features: int
    type: str


# GGUF types the kernels pack from the file's blocks, all exactly: their code bits, whether
# they have offsets, and whether they are laid out in super-blocks (Q4_K, Q6_K).
BLOCK_TYPES = {
    "Q8_0": (8, False, False),
    "Q4_0": (4, False, False),
    "Q4_1": (4, True, False),
    "Q4_K": (4, True, True),
    "Q6_K": (6, False, True),
    "Q5_0": (5, False, False),
}


class GroupLinear(nn.Module):
    """`y = x @ w.T + bias` with w in groups of 32 consecutive k of one output channel, each
    with an fp16 scale d (and an fp16 offset m for asymmetric 4-bit codes): w = d q (`bits=8`,
    q in [-127, 127]: GGUF's Q8_0), d (q - 8) (`bits=4` without offsets, q in [0, 15]: Q4_0),
    d q + m (`bits=4` with offsets: Q4_1 and `quantization="int4"`) or d (q - 32) with a
    scale per 16 k (`bits=6`, q in [0, 63]; Q6_K's values, which GGUF files now load as
    super-blocks) or d (q - 16) (`bits=5`, q in [0, 31]:
    Q5_0); or, for GGUF's Q4_K and Q6_K, in super-blocks of 256 (`SuperRows`): w = d sc q +
    dm m or d sc (q - 32) with fp16 d (and dm) per 256 and an 8-bit sc (and m) per 32 (16),
    as the file holds them: 4.5 and 6.5 bits a weight plus 32 (16) per 256, where fp16
    scales per group took 5 and 7. Packed once into panels with each channel's
    codes for 4 (8-bit, stored as q + 128) or 8 (4-bit, k = 8i + j in the low nibble of byte j,
    8i + 4 + j in the high one) consecutive k in one 32-bit lane; 6-bit codes per half of
    16 k of a group as the high pairs of its 16 k in a lane (k = 16h + 4c + j in bits 2c of
    byte j), then its low nibbles the 4-bit way (two lanes); 5-bit codes per group as their
    high bits in one lane (k = 8i + j in bit 2i of byte j, 8i + 4 + j in bit 2i + 1), then
    their low nibbles: the order the kernel reads them in. Plain groups (not super-blocks)
    carry their scales as GGUF's blocks do: per group of a panel, its channels' fp16 d (with
    offsets, then their m; 6-bit, d of each half of 16 k), then its lanes, groups back to
    back, so `scales` (and `mins`, present for offsets) are empty [P, 0, panel] (one stream:
    a decode reads its weights in address order). Super-blocks as 4 lanes
    of sub-block scales per channel (Q4_K: sc, then m, group j in byte j % 4 of lane j / 4;
    Q6_K: the 16 int8 sc), then their 8 groups' codes, with d (and dm) in `scales` (`mins`)
    [P, K / 256, panel]. Every step runs
    `ember_cpu::group_linear`, which quantizes x to int8 per group of 32 and sums the products
    in int32 (llama.cpp's scheme; see the kernel).
    `codes [N, K]`, `scales`/`mins [N, K / 32]` (`bits=6`: scales `[N, K / 16]`)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bits: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self._allocate(codes.shape[0], codes.shape[1], bits, mins is not None, bias)
        self._pack_rows(0, codes, scales, mins)

    @classmethod
    def from_row_chunks(
        cls,
        out_features: int,
        bits: int,
        chunks: Iterable[Rows | SuperRows | Blocks],
        bias: torch.Tensor | None = None,
    ) -> GroupLinear:
        """A `GroupLinear` built from consecutive row ranges of the weight, each packed into the
        panels as it arrives: `(codes, scales, mins)` as the constructor takes them, or
        `Blocks` of a GGUF file. A converter that yields `row_chunk()` rows at a time holds
        only those rows' temporaries, not several copies of a whole (embedding-sized) weight.
        Every chunk but the last has a multiple of the panel width of rows."""
        chunks = iter(chunks)
        first = next(chunks)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        if isinstance(first, Blocks):
            _, offsets, super_blocks = BLOCK_TYPES[first.type]
            self._allocate(out_features, first.in_features, bits, offsets, bias, super_blocks)
        elif isinstance(first, SuperRows):
            offsets = first.sub_mins is not None
            self._allocate(out_features, first.codes.shape[1], bits, offsets, bias, True)
        else:
            self._allocate(out_features, first[0].shape[1], bits, first[2] is not None, bias)
        row = self._pack(0, first)
        for chunk in chunks:
            row = self._pack(row, chunk)
        if row != out_features:
            raise ValueError(f"GroupLinear: chunks hold {row} rows, expected {out_features}")
        return self

    def _pack(self, row: int, chunk: Rows | SuperRows | Blocks) -> int:
        if isinstance(chunk, Blocks):
            return self._pack_blocks(row, chunk)
        if isinstance(chunk, SuperRows):
            return self._pack_super_rows(row, chunk)
        if self.super_blocks:
            raise ValueError("GroupLinear: super-block panels take SuperRows or Blocks")
        return self._pack_rows(row, *chunk)

    def _allocate(
        self,
        n: int,
        k: int,
        bits: int,
        offsets: bool,
        bias: torch.Tensor | None,
        super_blocks: bool = False,
    ) -> None:
        """Zeroed panels for an [n, k] weight of `bits`-bit codes (see the class doc)."""
        kernels.prebuild()  # laid out for the build's panel width; `forward` waits for it
        if bits not in (4, 5, 6, 8):
            raise ValueError(f"GroupLinear: bits must be 4, 5, 6 or 8, got {bits}")
        if k % GROUP_SIZE:
            raise ValueError(f"GroupLinear: K must be a multiple of {GROUP_SIZE}, got {k}")
        if offsets and bits != 4:
            raise ValueError("GroupLinear: offsets (mins) are for 4-bit codes, shaped as scales")
        if super_blocks and (k % SUPER_BLOCK or (bits, offsets) not in ((4, True), (6, False))):
            raise ValueError(
                f"GroupLinear: super-blocks are 4-bit codes with offsets or 6-bit codes, K a "
                f"multiple of {SUPER_BLOCK}; got {bits} bits, offsets {offsets}, K = {k}"
            )
        self.in_features, self.out_features, self.bits = k, n, bits
        self.super_blocks = super_blocks
        panels, code_bytes, scale_cols, panel = self._layout(n, k, bits, offsets, super_blocks)
        codes = weight_zeros((panels, code_bytes // 4, panel, 4), torch.uint8)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", weight_zeros((panels, scale_cols, panel), torch.half))
        mins = weight_zeros((panels, scale_cols, panel), torch.half) if offsets else None
        self.register_buffer("mins", mins)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @staticmethod
    def _layout(
        n: int, k: int, bits: int, offsets: bool, super_blocks: bool = False
    ) -> tuple[int, int, int, int]:
        """(panels, code bytes a row, scale columns, panel width) of an [n, k] weight."""
        panel = kernels.panel_width()
        if super_blocks:  # 16 bytes of sub-block scales, then the 8 groups' codes
            per_super = {4: 144, 6: 208}[bits]
            return -(-n // panel), k // SUPER_BLOCK * per_super, k // SUPER_BLOCK, panel
        # plain groups: each group's head of scales, then its codes, padded to a whole lane
        lanes = -(-(k // GROUP_SIZE) * _plain_group_bytes(bits, offsets) // 4)
        return -(-n // panel), 4 * lanes, 0, panel

    @classmethod
    def packed_nbytes(
        cls, n: int, k: int, bits: int, offsets: bool, super_blocks: bool = False
    ) -> int:
        """The bytes of the tensors an [n, k] weight of `bits`-bit codes is packed into."""
        panels, code_bytes, scale_cols, panel = cls._layout(n, k, bits, offsets, super_blocks)
        return panels * panel * (code_bytes + scale_cols * 2 * (2 if offsets else 1))

    def _pack_rows(
        self, row: int, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
    ) -> int:
        """Pack rows [row, row + len(codes)) into the panels; returns the next row."""
        n, k = codes.shape
        bits = self.bits
        per_scale = 16 if bits == 6 else GROUP_SIZE
        if k != self.in_features or scales.shape != (n, k // per_scale):
            raise ValueError(
                f"GroupLinear: codes [{n}, {k}] need K = {self.in_features} and scales "
                f"[{n}, {k // per_scale}], got {tuple(scales.shape)}"
            )
        if (mins is not None) != (self.mins is not None) or (
            mins is not None and mins.shape != scales.shape
        ):
            raise ValueError("GroupLinear: offsets (mins) are for 4-bit codes, shaped as scales")
        self._check_rows(row, n)
        scales = scales.to(torch.float16)
        mins = None if mins is None else mins.to(torch.float16)
        if kernels.ready():  # one pass in C++; the same bytes as the re-layout below
            kernels.load()
            codes = codes.to(torch.int8 if bits == 8 else torch.uint8)
            torch.ops.ember_cpu.group_pack_codes(
                self.codes, self.scales, self.mins, row, codes, scales, mins, bits
            )
            return row + n
        if bits == 8:
            stored = (codes.to(torch.int16) + 128).to(torch.uint8).view(n, -1, GROUP_SIZE)
        else:
            stored = _group_bytes(codes, bits)
        return self._write_plain_panels(row, stored, scales, mins)

    def _check_rows(self, row: int, n: int) -> None:
        panel = self.codes.shape[2]
        if row % panel or row + n > self.out_features:
            raise ValueError(
                f"GroupLinear: rows [{row}, {row + n}) do not start a panel of {panel} or pass "
                f"{self.out_features} rows"
            )

    def _write_plain_panels(
        self, row: int, stored: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
    ) -> int:
        """Rows [row, row + n) of plain groups into the panels (a PyTorch re-layout: the
        reference of `group_pack_codes`, which writes the same bytes): each group's stored
        code bytes `stored` [n, K / 32, bytes], its head of scales (6-bit: two a group) and
        offsets; returns the next row."""
        n, groups = stored.shape[:2]
        panels, panel = -(-n // self.codes.shape[2]), self.codes.shape[2]
        lanes = _quad_panels(stored.reshape(n, -1)).view(panels, groups, -1)
        heads = scales.reshape(n, groups, -1)  # [n, groups, 1 or 2]
        if mins is not None:
            heads = torch.stack((scales, mins), dim=2)
        rows = heads.shape[2]
        heads = _panels(heads.reshape(n, -1).to(torch.float16)).view(panels, groups, rows * panel)
        both = torch.cat((heads.view(torch.uint8), lanes), dim=2).view(panels, -1)
        p0 = row // panel
        self.codes[p0 : p0 + panels].view(panels, -1)[:, : both.shape[1]] = both
        return row + n

    def _write_panels(
        self, row: int, stored: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
    ) -> int:
        """Rows [row, row + n) of super-blocks' stored bytes [n, lanes * 4] and their d (and
        dm) rows into the panels; returns the next row."""
        n, panel = stored.shape[0], self.codes.shape[2]
        p0, p1 = row // panel, -(-(row + n) // panel)
        self.codes[p0:p1] = _quad_panels(stored)
        self.scales[p0:p1] = _panels(scales.to(torch.float16))
        if mins is not None:
            self.mins[p0:p1] = _panels(mins.to(torch.float16))
        return row + n

    def _pack_super_rows(self, row: int, rows: SuperRows) -> int:
        """Pack rows [row, row + n) of super-blocks (a PyTorch re-layout: the reference of
        `group_pack_blocks` for Q4_K and Q6_K, which writes the same bytes)."""
        n, k = rows.codes.shape
        bits = self.bits
        supers, per_sub = k // SUPER_BLOCK, 16 if bits == 6 else GROUP_SIZE
        shapes_ok = (
            self.super_blocks
            and k == self.in_features
            and rows.sub.shape == (n, k // per_sub)
            and rows.d.shape == (n, supers)
            and (rows.sub_mins is None) == (self.mins is None) == (rows.dm is None)
            and (rows.sub_mins is None or rows.sub_mins.shape == (n, k // GROUP_SIZE))
            and (rows.dm is None or rows.dm.shape == (n, supers))
        )
        if not shapes_ok:
            raise ValueError(
                f"GroupLinear: super-block rows [{n}, {k}] do not fit {bits}-bit super-block "
                f"panels of K = {self.in_features}"
            )
        self._check_rows(row, n)
        if bits == 6:
            subs = rows.sub.to(torch.int8).contiguous().view(torch.uint8).view(n, supers, 16)
        else:
            sc = rows.sub.to(torch.uint8).view(n, supers, 8)
            subs = torch.cat((sc, rows.sub_mins.to(torch.uint8).view(n, supers, 8)), dim=2)
        groups = _group_bytes(rows.codes, bits).view(n, supers, -1)
        stored = torch.cat((subs, groups), dim=2).view(n, -1)
        return self._write_panels(row, stored, rows.d, rows.dm)

    def _pack_blocks(self, row: int, blocks: Blocks) -> int:
        """Pack rows [row, row + len(blocks.data)) straight from a GGUF file's blocks."""
        if blocks.in_features != self.in_features or BLOCK_TYPES.get(blocks.type) != (
            self.bits,
            self.mins is not None,
            self.super_blocks,
        ):
            raise ValueError(
                f"GroupLinear: {blocks.type} blocks of {blocks.in_features} values a row do "
                f"not fit {self.bits}-bit groups of K = {self.in_features}"
            )
        kernels.load()
        torch.ops.ember_cpu.group_pack_blocks(
            self.codes, self.scales, self.mins, row, blocks.data, blocks.type
        )
        return row + blocks.data.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """HF code reads `proj.weight.dtype`/`.device`; the codes answer both."""
        return self.codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.loaded_isa() is None:
            kernels.load()
        return torch.ops.ember_cpu.group_linear(
            x, self.codes, self.scales, self.mins, self.bias, self.out_features, self.bits
        )

    def rows(self, ids: torch.Tensor | slice) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized to fp32: [..., K] (an embedding lookup, and
        the reference the kernel is tested against)."""
        if isinstance(ids, slice):
            ids = torch.arange(self.out_features)[ids]
        if self.super_blocks:
            return self._super_rows(_from_panels(self.codes, ids), ids)
        stored, heads = self._plain_rows(ids)  # [..., lanes, 4], [..., groups, 1 or 2]
        if self.bits == 6:
            codes = _six_bit_codes(stored.unflatten(-2, (-1, 6))) - 32
            scales = heads.flatten(-2)[..., None]  # a scale per 16 k
            return (codes.unflatten(-1, (-1, 16)).float() * scales).flatten(-2)
        if self.bits == 5:  # high bits (bit 2i (+1 for k % 8 >= 4) of byte k % 4), nibbles
            lanes = stored.unflatten(-2, (-1, 5))  # [..., groups, 5 lanes, 4]
            low = _nibbles(lanes[..., 1:, :])  # [..., groups, 32]
            k = torch.arange(GROUP_SIZE)
            high = lanes[..., 0, :][..., k % 4] >> (2 * (k // 8) + (k % 8) // 4) & 1
            codes = ((low | high << 4).to(torch.int16) - 16).flatten(-2)
        elif self.bits == 8:
            codes = stored.flatten(-2).to(torch.int16) - 128
        else:
            codes = _nibbles(stored)
        scales = heads[..., :1]
        groups = codes.unflatten(-1, (-1, GROUP_SIZE)).float()
        if self.mins is not None:
            w = groups * scales + heads[..., 1:]
        elif self.bits == 4:
            w = (groups - 8) * scales
        else:
            w = groups * scales
        return w.flatten(-2)

    def _plain_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `ids` of plain panels: their groups' code lanes [..., lanes, 4] and heads
        [..., K / 32, 1 or 2] in fp32 (d; with offsets d, m; 6-bit: d of each half)."""
        panels, _, panel, _ = self.codes.shape
        groups = self.in_features // GROUP_SIZE
        offsets = self.mins is not None
        rows = _plain_head_rows(self.bits, offsets)
        head, group = 2 * rows * panel, _plain_group_bytes(self.bits, offsets)
        flat = self.codes.view(panels, -1)[:, : groups * group * panel].view(panels, groups, -1)
        p, c = ids // panel, ids % panel
        # the rows' bytes gathered first, then read as fp16 (a bitcast of the whole table's
        # heads was a copy of them every step once compiled)
        heads = flat[..., :head].view(panels, groups, rows, panel, 2)[p, :, :, c]
        lanes = flat[..., head:].view(panels, groups, -1, panel, 4)[p, :, :, c]
        return lanes.flatten(-3, -2), heads.contiguous().view(torch.float16)[..., 0].float()

    def _super_rows(self, stored: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`rows` of super-block panels: stored [..., lanes, 4] of the rows `ids`."""
        per_super = self.codes.shape[1] * SUPER_BLOCK // self.in_features  # lanes
        lanes = stored.unflatten(-2, (-1, per_super))  # [..., supers, lanes, 4]
        subs, lanes = lanes[..., :4, :].flatten(-2), lanes[..., 4:, :]  # 16 bytes, codes
        d = _from_panels(self.scales, ids).float()[..., None]  # [..., supers, 1]
        if self.bits == 6:
            codes = _six_bit_codes(lanes.unflatten(-2, (8, 6))) - 32  # [..., supers, 256]
            sc = (subs.to(torch.int16) + 128) % 256 - 128  # the int8 scales
            w = codes.unflatten(-1, (16, 16)).float() * (d * sc.float())[..., None]
            return w.flatten(-3)
        codes = _nibbles(lanes[..., :32, :].unflatten(-2, (8, 4))).float()  # [.., supers, 8, 32]
        dm = _from_panels(self.mins, ids).float()[..., None]
        scale, offset = d * subs[..., :8].float(), dm * subs[..., 8:].float()
        return (codes * scale[..., None] + offset[..., None]).flatten(-3)

    def extra_repr(self) -> str:
        kind = {8: "q8_0", 6: "q6_k", 5: "q5_0", 4: "q4_1" if self.mins is not None else "q4_0"}
        kind = kind[self.bits]
        if self.super_blocks:
            kind = {4: "q4_k", 6: "q6_k"}[self.bits] + " super-block"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind} groups"


def _plain_head_rows(bits: int, offsets: bool) -> int:
    """fp16 values per channel in a plain group's head: d; two for 6-bit codes (d of each
    half), or d and m with offsets (`ember_cpu`'s plain_head_rows)."""
    return 2 if bits == 6 or offsets else 1


def _plain_group_bytes(bits: int, offsets: bool) -> int:
    """A plain group's bytes per channel in its panel: its head of fp16 scales, then its
    codes (`ember_cpu`'s plain_group_bytes)."""
    return 2 * _plain_head_rows(bits, offsets) + GROUP_SIZE * bits // 8


def _group_bytes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Each group's stored bytes [n, K / 32, 16, 20 or 24] of 4-, 5- or 6-bit codes [n, K]
    (see `GroupLinear`): the nibbles; 5-bit: the high bits, then the nibbles; 6-bit: per half
    of 16 k, its high pairs, then its nibbles."""
    n, k = codes.shape
    groups = k // GROUP_SIZE
    codes = codes.to(torch.uint8)
    octets = (codes & 15).view(n, k // 8, 2, 4)
    stored = (octets[:, :, 0] | (octets[:, :, 1] << 4)).view(n, groups, 16)
    if bits == 5:  # each group's 4 bytes of high bits, then its 16 nibble bytes
        high = (codes >> 4 & 1).view(n, groups, 4, 2, 4)  # [.., i, half, t]
        shift = (2 * torch.arange(4)[:, None] + torch.arange(2)[None, :])[..., None]
        bits_t = (high.to(torch.int32) << shift).sum(dim=(2, 3)).to(torch.uint8)  # [.., t]
        return torch.cat((bits_t, stored), dim=2)
    if bits == 6:  # per half: its 4 bytes of high pairs, then its 8 nibble bytes
        pairs = (codes >> 4).view(n, k // 16, 4, 4)
        high = pairs[:, :, 0] | pairs[:, :, 1] << 2 | pairs[:, :, 2] << 4 | pairs[:, :, 3] << 6
        halves = (high.view(n, groups, 2, 4), stored.view(n, groups, 2, 8))
        return torch.cat(halves, dim=3).view(n, groups, 24)
    return stored


def _six_bit_codes(lanes: torch.Tensor) -> torch.Tensor:
    """6-bit codes q [..., groups * 32] int16 from their groups' lanes [..., groups, 6, 4]:
    per half of 16 k, its high pairs (k = 16h + 4c + j in bits 2c of byte j), then its two
    lanes of nibbles."""
    halves = lanes.unflatten(-2, (2, 3))  # [..., groups, half, 3 lanes, 4]
    high = halves[..., 0, :].unsqueeze(-2) >> torch.tensor([0, 2, 4, 6])[:, None] & 3
    low = _nibbles(halves[..., 1:, :].flatten(-3, -2))
    return (low | high.flatten(-3) << 4).flatten(-2).to(torch.int16)


def _nibbles(stored: torch.Tensor) -> torch.Tensor:
    """[..., L, 4] bytes -> [..., L * 8] codes: each lane's 4 low nibbles, then its 4 high
    ones. One broadcast shift, so a compiled graph fuses it into the kernel that uses the
    codes (a stack of the two halves was a separate `aten.cat` call per step: ~4 us)."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=stored.device)[:, None]
    return ((stored.unsqueeze(-2) >> shifts) & 15).flatten(-3)


class GroupEmbedding(nn.Module):
    """An input embedding whose table is a `GroupLinear`'s weight (a quantized GGUF table, or
    the LM head tied to it): each token's row is gathered and dequantized (times `scale`, for
    a scaled embedding), and the table is held once, quantized."""

    def __init__(self, table: GroupLinear, scale: float | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.table = table
        self.scale = scale  # Gemma's scaled embeddings: rows times sqrt(hidden_size)

    @property
    def weight(self) -> torch.Tensor:
        return self.table.codes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(ids)
        return rows if self.scale is None else rows * self.scale

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of a group-quantized table"


def quantize_groups(
    w: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scales, mins) of w [N, K] in groups of 32, as llama.cpp quantizes: `bits=8`
    Q8_0 (d = max|w| / 127); `bits=4, symmetric=True` Q4_0 (d = the largest-magnitude value /
    -8, q = round(w / d) + 8 in [0, 15]); `bits=4, symmetric=False` Q4_1 (d = (max - min) / 15,
    m = min). Scales and offsets are rounded to fp16 before the codes are chosen."""
    groups = w.detach().float().unflatten(-1, (-1, GROUP_SIZE))
    mins = None
    if bits == 8:
        scales = (groups.abs().amax(-1) / 127).half()
        inv = torch.where(scales > 0, 1 / scales.float(), 0)
        codes = torch.round(groups * inv[..., None]).clamp(-127, 127).to(torch.int8)
    elif symmetric:
        idx = groups.abs().argmax(-1, keepdim=True)
        scales = (groups.gather(-1, idx)[..., 0] / -8).half()
        inv = torch.where(scales != 0, 1 / scales.float(), 0)
        codes = (torch.round(groups * inv[..., None]) + 8).clamp(0, 15).to(torch.uint8)
    else:
        lo, hi = groups.amin(-1), groups.amax(-1)
        scales, mins = ((hi - lo) / 15).half(), lo.half()
        inv = torch.where(scales > 0, 1 / scales.float(), 0)
        codes = torch.round((groups - mins.float()[..., None]) * inv[..., None]).clamp(0, 15)
        codes = codes.to(torch.uint8)
    return codes.flatten(-2), scales, mins


def quantize_int4_(
    model: nn.Module, symmetric: bool = False, consumed: Consumed | None = None
) -> int:
    """Replace every nn.Linear of `model` with a 4-bit `GroupLinear`, in place, one linear at
    a time and `row_chunk` rows at a time (a weight is widened to fp32 a chunk at a time
    while it is quantized); a linear whose input size is not a multiple of 32 becomes an
    `Int8Linear`. Returns how many were replaced; `consumed` as `_replace_linears`."""

    def make(linear: nn.Linear) -> nn.Module:
        if linear.in_features % GROUP_SIZE:
            return Int8Linear(linear)
        w = linear.weight.detach()
        step = row_chunk(linear.in_features)
        chunks = (quantize_groups(w[i : i + step], 4, symmetric) for i in range(0, len(w), step))
        return GroupLinear.from_row_chunks(linear.out_features, 4, chunks, linear.bias)

    return _replace_linears(model, make, consumed)


# Projections of one module that read the same input, fused into one linear each
# (`fuse_projections_`): attention's q/k/v and a gated MLP's gate/up.
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedSlice(nn.Module):
    """One projection of a fused group: `fused(x)[..., start:end]`, a drop-in for the linear it
    replaces (HF's modeling code still calls q_proj, k_proj and v_proj in turn).

    Compiled, each slice calls the fused op on its input and `dedupe_pure_ops` (a post-grad
    pass) keeps one call per input: one GEMV per group. Eager, the first slice called computes
    the group's output and its siblings take it while their input is the same tensor object;
    the last one to take it drops it (no step's activations outlive it). Either way a slice
    whose input differs from its siblings' still gets the right rows."""

    def __init__(
        self, fused: nn.Module, memo: dict[str, object], start: int, end: int, group: int
    ) -> None:
        super().__init__()
        self.fused = fused
        self.memo = memo  # shared by the group's slices: input, output, slices yet to read it
        self.group = group  # slices in the group
        self.start, self.end = start, end
        self.in_features, self.out_features = fused.in_features, end - start

    @property
    def weight(self) -> torch.Tensor:
        """HF code reads `proj.weight.dtype`/`.device`: the fused weight's."""
        return self.fused.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            y = self.fused(x)
        else:
            memo = self.memo
            if memo.get("x") is not x:
                memo.update(x=x, y=self.fused(x), left=self.group)
            y = memo["y"]  # type: ignore[assignment]
            memo["left"] = memo["left"] - 1  # type: ignore[operator]
            if memo["left"] == 0:
                memo.clear()
        return y[..., self.start : self.end]

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.end}) of a fused projection"


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


def _cat_bias(parts: list[nn.Module]) -> torch.Tensor | None:
    return cat_biases([getattr(p, "bias", None) for p in parts], [p.out_features for p in parts])


def _fuse(parts: list[nn.Module]) -> nn.Module | None:
    """One linear computing `parts`' outputs side by side, or None where they cannot be fused
    (different types, input sizes or formats; a packed part that does not fill its last
    panel, unless it is the last part)."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts) or len({p.in_features for p in parts}) != 1:
        return None
    if kind in (nn.Linear, GemvLinear):
        if len({p.weight.dtype for p in parts}) != 1:
            return None
        out_features = sum(p.out_features for p in parts)
        # On the meta device: no random init of a weight that is replaced at once.
        linear = nn.Linear(parts[0].in_features, out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), False)
        bias = _cat_bias(parts)
        if bias is not None:
            linear.bias = nn.Parameter(bias.to(parts[0].weight.dtype), False)
        return linear if kind is nn.Linear else GemvLinear(linear)
    if kind not in (PackedLinear, Int8Linear, GroupLinear):
        return None
    main = "codes" if kind is GroupLinear else "packed"
    panel = getattr(parts[0], main).shape[2]
    if kind is not GroupLinear and parts[0].pairs:
        panel //= 2
    if any(p.out_features % panel for p in parts[:-1]):
        return None
    flags = {
        (getattr(p, "bits", 0), getattr(p, "pairs", False), getattr(p, main).dtype)
        + tuple(getattr(p, n, None) is None for n in ("scales", "mins"))
        for p in parts
    }
    if len(flags) != 1:
        return None
    fused = kind.__new__(kind)
    nn.Module.__init__(fused)
    fused.__dict__.update(
        {k: v for k, v in parts[0].__dict__.items() if not k.startswith("_")},
        out_features=sum(p.out_features for p in parts),
    )
    for name in (main, "scales", "mins"):
        if name in parts[0]._buffers:
            tensors = [getattr(p, name) for p in parts]
            value = None
            if tensors[0] is not None:
                shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
                value = torch.cat(tensors, out=weight_zeros(shape, tensors[0].dtype))
            fused.register_buffer(name, value)
    fused.register_buffer("bias", _cat_bias(parts))
    return fused


def fuse_projections_(model: nn.Module, consumed: Consumed | None = None) -> int:
    """Fuse each module's q/k/v projections, and gate/up ones, into one linear (`FusedSlice`
    views of it), in place; returns how many groups were fused.

    A decode step's small GEMVs cost more than their bytes: measured on AMD EPYC (2 cores,
    AVX-512), compiled, the linears of a step, fused vs one call per projection:
    llama-160m Q4_0 1.86 vs 2.46 ms, Q8_0 2.09 vs 2.50; qwen2-0.5b Q4_0 6.03 vs 9.14,
    Q8_0 11.7 vs 14.3 (one parallel region per group instead of per projection, and qwen2's
    128-row K and V projections no longer run alone).

    Fusing plain `nn.Linear`s (a checkpoint's, before they are packed or quantized) copies
    each group once; `consumed` then gets the parts' weights, as `_replace_linears`."""
    count = 0
    heap = HeapTrimmer()  # the replaced parts' heap pages go back as the fusing goes on
    for module in list(model.modules()):
        for names in FUSED_PROJECTIONS:
            parts = [getattr(module, n, None) for n in names]
            if any(not isinstance(p, nn.Module) for p in parts):
                continue
            fused = _fuse(parts)  # type: ignore[arg-type]
            if fused is None:
                continue
            heap.freed(
                sum(b.nbytes for b in fused.buffers()) + sum(w.nbytes for w in fused.parameters())
            )
            place_fused(module, names, [p.out_features for p in parts], fused)  # type: ignore[misc]
            count += 1
            if consumed is not None:
                for part in parts:
                    for t in (*part.parameters(), *part.buffers()):  # type: ignore[union-attr]
                        if not _holds(fused, t):
                            consumed(t)
    return count


def place_fused(
    module: nn.Module, names: tuple[str, ...], sizes: list[int], fused: nn.Module
) -> None:
    """Set `module`'s projections `names` (of `sizes` output features, in order) to
    `FusedSlice` views of `fused`, which computes them side by side."""
    memo: dict[str, object] = {}
    start = 0
    for name, size in zip(names, sizes, strict=True):
        setattr(module, name, FusedSlice(fused, memo, start, start + size, len(names)))
        start += size
