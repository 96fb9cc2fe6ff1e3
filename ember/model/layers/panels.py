"""The kernels' weight layouts: panels of output channels (fp16/fp32 scales, bf16 pairs, int8
codes in quads), the group width they quantize by, and the row chunks x is streamed in."""

from __future__ import annotations

import torch

from ember import kernels

# k values per scale of the group-quantized layout (GGUF's Q8_0 / Q4_0 / Q4_1 blocks).
GROUP_SIZE = 32


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
