"""GGUF tensors converted to ember's layers: quantized blocks to `GroupLinear` codes (Q8_0, Q4_0,
Q4_1, Q5_0, Q4_K, Q6_K kept exactly; other types requantized), dense tensors as they are, and
llama.cpp's Q/K row permutation undone."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ember import kernels
from ember.host.memory import weight_zeros
from ember.model.gguf.reader import KEPT_TYPES, _block_size
from ember.model.layers.group import (
    BLOCK_TYPES,
    Blocks,
    GroupLinear,
    Rows,
    SuperRows,
    quantize_groups,
)
from ember.model.layers.packed import cat_biases
from ember.model.layers.panels import GROUP_SIZE, row_chunk


def _blocks(raw: np.ndarray, rows: int, block_bytes: int) -> torch.Tensor:
    """A quantized tensor's bytes [rows, row bytes] as [rows, blocks, block_bytes] (a copy)."""
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1, block_bytes).copy())


Release = Callable[[np.ndarray], None] | None


def panel_layout(qtype: Any) -> tuple[int, bool, bool]:
    """(bits, offsets, super-blocks) of the panels a quantized GGUF type is packed into: its
    blocks' own where it is kept (`BLOCK_TYPES`), else 8-bit plain groups."""
    bits, _ = _converter(qtype)
    return BLOCK_TYPES.get(qtype.name, (bits, False, False))


def _converter(qtype: Any) -> tuple[int, Callable[[np.ndarray], Rows | SuperRows]]:
    """The code width of a quantized GGUF type in a `GroupLinear`, and its rows' converter."""
    name = qtype.name
    if name in KEPT_TYPES:
        return (8 if name == "Q8_0" else 4), functools.partial(_block_rows, qtype=name)
    if name == "Q4_K":
        return 4, _q4_k_rows
    if name == "Q6_K":
        return 6, _q6_k_rows
    if name == "Q5_0":
        return 5, _q5_0_rows
    return 8, functools.partial(_values_rows, tensor_type=qtype)


def _row_chunks(
    raw: np.ndarray, qtype: Any, release: Release
) -> Iterator[Rows | SuperRows | Blocks]:
    """(codes, scales, mins) of `raw` (a `qtype` tensor's bytes, one row of blocks per output
    channel) a `row_chunk()` of rows at a time, for `GroupLinear.from_row_chunks`: a
    conversion's temporaries (codes one byte a value, widened copies) exist for one chunk at a
    time; over a whole embedding at once they took ~7x its bytes (qwen2-0.5b Q4_0: +1,000 MB
    of peak RSS for a 350 MB file). Chunks of `BLOCK_TYPES` go to the kernels' packer as
    they are (`Blocks`) once the kernels are built (qwen2-0.5b Q4_0 loads in ~1 s instead of
    3.3; the converters here are its reference and serve while a first build compiles).
    `release(part)`, when given, is called with each chunk's bytes once they are packed (the
    loader drops their file pages and trims the heap)."""
    _, convert = _converter(qtype)
    values, nbytes = _block_size(qtype)
    k = raw.shape[1] // nbytes * values
    step = row_chunk(k)
    packer = qtype.name in BLOCK_TYPES and kernels.ready()
    for r in range(0, raw.shape[0], step):
        part = raw[r : r + step]
        yield Blocks(_bytes(part), k, qtype.name) if packer else convert(part)
        if release is not None:  # the chunk is packed
            release(part)


def group_linear_from_file(
    raw: np.ndarray, qtype: Any, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """A quantized GGUF weight (`raw`: its bytes, `qtype`: its `GGMLQuantizationType`) as a
    `GroupLinear`, converted a chunk of rows at a time (see `group_linear_from_blocks` and
    `group_linear_from_values` for what each type becomes)."""
    bits, _ = _converter(qtype)
    return GroupLinear.from_row_chunks(raw.shape[0], bits, _row_chunks(raw, qtype, release), bias)


def fused_group_linear(
    parts: list[tuple[np.ndarray, Any, torch.Tensor | None]], release: Release = None
) -> GroupLinear:
    """One `GroupLinear` computing the weights `parts` ((bytes, type, bias) of projections of
    one type and input size, each but the last filling whole panels) side by side, converted
    straight into the fused layout (`fuse_projections_` would copy every projection again)."""
    bits, _ = _converter(parts[0][1])
    rows = sum(raw.shape[0] for raw, _, _ in parts)
    chunks = itertools.chain.from_iterable(_row_chunks(raw, q, release) for raw, q, _ in parts)
    bias = cat_biases([b for _, _, b in parts], [len(raw) for raw, _, _ in parts])
    return GroupLinear.from_row_chunks(rows, bits, chunks, bias)


def _bytes(part: np.ndarray) -> torch.Tensor:
    """A chunk of a tensor's bytes as a uint8 tensor, without a copy (the packer only reads
    it; the file's map is read-only)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(part, dtype=np.uint8))


def _block_rows(raw: np.ndarray, qtype: str) -> Rows:
    """(codes, scales, mins) of rows of a Q8_0 / Q4_0 / Q4_1 tensor, exactly."""
    rows = raw.shape[0]
    if qtype == "Q8_0":
        blocks = _blocks(raw, rows, 2 + GROUP_SIZE)
        scales = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
        return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), scales, None
    head = {"Q4_0": 2, "Q4_1": 4}[qtype]
    blocks = _blocks(raw, rows, head + GROUP_SIZE // 2)
    scales = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    mins = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0] if head == 4 else None
    packed = blocks[..., head:]
    return torch.cat((packed & 15, packed >> 4), dim=-1).reshape(rows, -1), scales, mins


def group_linear_from_blocks(
    raw: np.ndarray, qtype: str, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """A `GroupLinear` holding a Q8_0 / Q4_0 / Q4_1 tensor's values exactly. `raw`: the tensor's
    bytes, one row of blocks per output channel (ggml's layout: Q8_0 blocks are fp16 d and 32
    int8 codes; Q4_0 fp16 d and 16 bytes whose low nibbles are codes 0-15 and high nibbles
    16-31; Q4_1 the same after fp16 d and m)."""
    from gguf import GGMLQuantizationType

    return group_linear_from_file(raw, GGMLQuantizationType[qtype], bias, release)


def _q4_k_rows(raw: np.ndarray) -> SuperRows:
    """Rows of a Q4_K tensor as they are (see `group_linear_from_q4_k`)."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 144)
    supers = blocks.shape[1]
    d = torch.from_numpy(blocks[..., 0:2].copy()).view(torch.float16)[..., 0]  # [rows, supers]
    dmin = torch.from_numpy(blocks[..., 2:4].copy()).view(torch.float16)[..., 0]
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    qs = blocks[..., 16:].reshape(rows, supers, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    codes = (qs & 15).reshape(rows, -1)
    return SuperRows(
        torch.from_numpy(codes),
        torch.from_numpy(sc.reshape(rows, -1).astype(np.uint8)),
        torch.from_numpy(m.reshape(rows, -1).astype(np.uint8)),
        d,
        -dmin,
    )


def group_linear_from_q4_k(
    raw: np.ndarray, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """A Q4_K weight as a 4-bit `GroupLinear` with offsets. A Q4_K super-block of 256 values is
    fp16 d and dmin, twelve bytes of 6-bit scales sc and offsets m (one pair per sub-block of
    32), then 128 bytes whose low nibbles are the codes of sub-block 2i and high nibbles of
    2i + 1 (bytes 32i to 32i + 31): w = d sc q - dmin m, kept as it is in super-block panels
    (4.5 bits a weight and 32 bits of d and -dmin per 256; see `GroupLinear`)."""
    from gguf import GGMLQuantizationType

    return group_linear_from_file(raw, GGMLQuantizationType.Q4_K, bias, release)


def _q6_k_rows(raw: np.ndarray) -> SuperRows:
    """Rows of a Q6_K tensor as they are (see `group_linear_from_q6_k`)."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 210)
    supers = blocks.shape[1]
    ql = blocks[..., :128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    qh = qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    codes = (ql & 15).reshape(rows, supers, 8, 32) | (qh & 3).reshape(rows, supers, 8, 32) << 4
    sc = blocks[..., 192:208].copy().view(np.int8)
    d = torch.from_numpy(blocks[..., 208:210].copy()).view(torch.float16)[..., 0]
    return SuperRows(
        torch.from_numpy(codes.reshape(rows, -1)),
        torch.from_numpy(sc.reshape(rows, -1)),
        None,
        d,
        None,
    )


def group_linear_from_q6_k(
    raw: np.ndarray, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """A Q6_K weight as a 6-bit `GroupLinear`. A Q6_K super-block of 256 values is 128 bytes
    of low nibbles, 64 bytes of high pairs, 16 int8 scales sc (one per 16 values) and fp16 d:
    w = d sc (q - 32), q in [0, 63], in the order of the `gguf` package's dequantizer; kept
    as it is in super-block panels (6.5 bits a weight and 16 bits of d per 256)."""
    from gguf import GGMLQuantizationType

    return group_linear_from_file(raw, GGMLQuantizationType.Q6_K, bias, release)


def _q5_0_rows(raw: np.ndarray) -> Rows:
    """(codes, scales, None) of rows of a Q5_0 tensor, exactly: a block is fp16 d, 32 high
    bits, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31; the value is
    d (q - 16), q = nibble | high bit << 4 in [0, 31]."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 2 + 4 + GROUP_SIZE // 2)
    scales = torch.from_numpy(blocks[..., :2].copy()).view(torch.float16)[..., 0]
    qh = blocks[..., 2:6].copy().view(np.uint32)  # [rows, blocks, 1]
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1
    packed = blocks[..., 6:]
    low = np.concatenate((packed & 15, packed >> 4), axis=-1)
    codes = (low | (high.astype(np.uint8) << 4)).reshape(rows, -1)
    return torch.from_numpy(codes), scales, None


def _values_rows(raw: np.ndarray, tensor_type: Any) -> Rows:
    from gguf import dequantize

    values = torch.from_numpy(dequantize(np.ascontiguousarray(raw), tensor_type))
    codes, scales, _ = quantize_groups(values, 8, symmetric=True)
    return codes, scales, None


def group_linear_from_values(
    raw: np.ndarray, tensor_type: Any, bias: torch.Tensor | None = None, release: Release = None
) -> GroupLinear:
    """Any other quantized weight as a `GroupLinear`: Q4_K as 4-bit groups with offsets
    (`group_linear_from_q4_k`), Q6_K as 6-bit codes (`group_linear_from_q6_k`), Q5_0 as 5-bit
    codes exactly (`_q5_0_rows`); every other type
    (Q5_K, Q5_1, IQ*) dequantized by the `gguf` package and requantized to 8-bit groups of 32
    (Q8_0's rule)."""
    return group_linear_from_file(raw, tensor_type, bias, release)


def _dense(tensor: Any, qtype: str, data: np.ndarray) -> torch.Tensor:
    """A tensor that is not kept quantized: F32/F16/BF16 as they are (a 2-D one in the load's
    weight arena, see `weights_arena`), anything else dequantized to bf16. `data` is already
    row-processed (Q/K permutation)."""
    view = _dense_view(qtype, data)
    if view is not None:
        out = weight_zeros(tuple(view.shape), view.dtype) if view.dim() == 2 else None
        return view.clone() if out is None else out.copy_(view)
    from gguf import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest dim first
    values = dequantize(np.ascontiguousarray(data), tensor.tensor_type)
    return torch.from_numpy(values).reshape(shape).to(torch.bfloat16)


def _dense_view(qtype: str, data: np.ndarray) -> torch.Tensor | None:
    """An F32/F16/BF16 tensor's values as a tensor over `data` (the file's map, read-only:
    for reading only), without a copy, shaped as `data` is (BF16's rows of bytes as rows of
    values; a tensor processor's reshape kept: Qwen2-MoE's shared-expert gate [1, H]); None
    for other types."""
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(qtype)
    if dtype is None:
        return None
    raw = np.ascontiguousarray(data)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        values = torch.from_numpy(raw.reshape(-1).view(np.uint8)).view(dtype)
    return values.reshape(*raw.shape[:-1], -1) if raw.ndim else values.reshape(())


def _permute_rows(processor: Any, name: str, data: np.ndarray) -> np.ndarray:
    """transformers' processing of a tensor whose rows are output channels: for the supported
    architectures a row permutation (Llama Q/K), or an offset on norms, which are never kept
    quantized."""
    return processor.process(weights=data, name=name).weights
