"""Group-quantized weights: `GroupLinear` (8-, 6-, 5- and 4-bit codes in groups of 32 with fp16
scales, and super-blocks of 256 as in GGUF's K-quants), `GroupEmbedding`, the block types and the
one group-weight layout (`quantize_groups`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from ember import kernels
from ember.host.memory import weight_zeros
from ember.model.layers.panels import GROUP_SIZE, _from_panels, _panels, _quad_panels

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


# A `GroupLinear`'s packed tensors: (codes, scales, mins or None).
Panels = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


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
        into: Panels | None = None,
    ) -> GroupLinear:
        """A `GroupLinear` built from consecutive row ranges of the weight, each packed into the
        panels as it arrives: `(codes, scales, mins)` as the constructor takes them, or
        `Blocks` of a GGUF file. A converter that yields `row_chunk()` rows at a time holds
        only those rows' temporaries, not several copies of a whole (embedding-sized) weight.
        Every chunk but the last has a multiple of the panel width of rows. `into`: zeroed
        (codes, scales, mins) of the layout's shapes (`layout_shapes`) to pack into, such as
        one expert's slices of a stacked MoE weight, instead of newly allocated ones."""
        chunks = iter(chunks)
        first = next(chunks)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        if isinstance(first, Blocks):
            _, offsets, super_blocks = BLOCK_TYPES[first.type]
            self._allocate(out_features, first.in_features, bits, offsets, bias, super_blocks, into)
        elif isinstance(first, SuperRows):
            offsets = first.sub_mins is not None
            self._allocate(out_features, first.codes.shape[1], bits, offsets, bias, True, into)
        else:
            offsets = first[2] is not None
            self._allocate(out_features, first[0].shape[1], bits, offsets, bias, False, into)
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
        into: Panels | None = None,
    ) -> None:
        """Zeroed panels for an [n, k] weight of `bits`-bit codes (see the class doc), or
        `into`'s, checked against the layout."""
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
        shapes = self.layout_shapes(n, k, bits, offsets, super_blocks)
        if into is None:
            codes = weight_zeros(shapes[0], torch.uint8)
            scales = weight_zeros(shapes[1], torch.half)
            mins = weight_zeros(shapes[1], torch.half) if offsets else None
        else:
            codes, scales, mins = into
            got = (codes.shape, codes.dtype, scales.shape, scales.dtype, mins is not None)
            want = (shapes[0], torch.uint8, shapes[1], torch.half, offsets)
            if got != want or (mins is not None and mins.shape != scales.shape):
                raise ValueError(f"GroupLinear: panels {got} given, the layout is {want}")
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
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
    def layout_shapes(
        cls, n: int, k: int, bits: int, offsets: bool, super_blocks: bool = False
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of the codes (uint8) and of the scales (and mins, fp16) of an [n, k]
        weight of `bits`-bit codes."""
        panels, code_bytes, scale_cols, panel = cls._layout(n, k, bits, offsets, super_blocks)
        return (panels, code_bytes // 4, panel, 4), (panels, scale_cols, panel)

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
