"""AttentionMetadata: the tensors every paged-attention call of one step shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Block 0 of every layer's cache: the null block. Padding tokens write into it and padded
# block-table entries point at it; the block manager never hands it out.
NULL_BLOCK = 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Flattened-batch attention inputs.

    slot_mapping     [num_tokens]      cache slot (block_id * block_size + offset) per token
    query_start_loc  [num_seqs + 1]    start of each sequence's tokens in the stream
    seq_lens         [num_seqs]        context length of each sequence after this step
    block_tables     [num_seqs, max_blocks]  block ids per sequence, padded with the null block
    Padding tokens map to slots of the null block; padding sequences have no tokens and
    seq_len 0.

    Encoder-decoder models also carry the cross-attention context of each sequence (the
    encoder output's K/V, written once per request):
    cross_seq_lens    [num_seqs]        encoder length per sequence (0 for padding)
    cross_block_tables [num_seqs, max_cross_blocks]

    Vision-language models (Mllama) attend a range of the image K/V per token:
    cross_token_ranges [num_tokens, 2]  [start, end) of the token's sequence's cross tokens
                                        (start == end: no cross-attention, output zero)
    cross_row_mask     [num_tokens]     1.0 where the token attends an image, else 0.0 (HF's
                                        `full_text_row_masked_out_mask`)
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    cross_seq_lens: torch.Tensor | None = None
    cross_block_tables: torch.Tensor | None = None
    cross_token_ranges: torch.Tensor | None = None
    cross_row_mask: torch.Tensor | None = None


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token at `position`, through its block table."""
    return block_table[position // block_size] * block_size + position % block_size


def padding_slots(count: int, block_size: int) -> list[int]:
    """Slots for `count` padding tokens: round-robin through the null block."""
    return [NULL_BLOCK * block_size + j % block_size for j in range(count)]


def build_attention_metadata(
    num_computed: list[int],
    num_new: list[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    max_blocks: int,
    num_tokens_padded: int,
    num_seqs_padded: int,
    cross_lens: list[int] | None = None,
    cross_tables: Sequence[Sequence[int]] | None = None,
    max_cross_blocks: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Build metadata and `positions [num_tokens_padded]` for sequences laid end to end
    (with `cross_lens`/`cross_tables`: the encoder context of each sequence)."""
    num_seqs = len(num_new)
    num_tokens = sum(num_new)
    positions = np.zeros(num_tokens_padded, dtype=np.int64)
    slots = np.zeros(num_tokens_padded, dtype=np.int64)
    tables = np.zeros((num_seqs_padded, max_blocks), dtype=np.int32)
    qsl = np.full(num_seqs_padded + 1, num_tokens, dtype=np.int32)
    seq_lens = np.zeros(num_seqs_padded, dtype=np.int32)
    start = 0
    for i in range(num_seqs):
        n, c, table = num_new[i], num_computed[i], block_tables[i]
        if n == 1:  # a decode: plain ints (this runs cache-cold after each step's weights)
            positions[start] = c
            slots[start] = slot_of(table, c, block_size)
        else:
            pos = np.arange(c, c + n, dtype=np.int64)
            blocks = np.asarray(table, dtype=np.int64)
            positions[start : start + n] = pos
            slots[start : start + n] = blocks[pos // block_size] * block_size + pos % block_size
        tables[i, : len(table)] = table
        qsl[i] = start
        seq_lens[i] = c + n
        start += n
    slots[num_tokens:] = padding_slots(num_tokens_padded - num_tokens, block_size)
    cross_seq_lens = cross_block_tables = None
    if cross_lens is not None and cross_tables is not None:
        cross_seq_lens = torch.zeros(num_seqs_padded, dtype=torch.int32)
        cross_seq_lens[:num_seqs] = torch.tensor(cross_lens, dtype=torch.int32)
        cross_block_tables = torch.zeros(num_seqs_padded, max_cross_blocks, dtype=torch.int32)
        for i, table in enumerate(cross_tables):
            cross_block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=torch.from_numpy(tables),
        cross_seq_lens=cross_seq_lens,
        cross_block_tables=cross_block_tables,
    )
    return meta, torch.from_numpy(positions)
