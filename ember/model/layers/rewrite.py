"""The rewrites that install ember's layers in an HF model: linears to the kernels' layers
(`use_kernel_linears_`), weight-only int8 and int4 (`quantize_int8_`, `quantize_int4_`), and a
causal LM's q/k/v and gate/up projections fused into one linear each (`fuse_projections_`,
`FusedSlice`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ember import kernels
from ember.host.isa import cpu_has_amx
from ember.host.memory import HeapTrimmer, weight_zeros
from ember.model.layers.group import GroupLinear, quantize_groups
from ember.model.layers.packed import (
    GemvLinear,
    Int8Linear,
    PackedEmbedding,
    PackedLinear,
    cat_biases,
    gathers_rows,
)
from ember.model.layers.panels import GROUP_SIZE, row_chunk

# Weight-only quantization schemes (`EngineArgs.quantization`).
QUANTIZATIONS = ("int8", "int4")


# Called with a weight the model no longer holds once it has been re-laid out (packed,
# quantized or fused into a new tensor): `ember.model.loader`'s gives its pages of the
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
