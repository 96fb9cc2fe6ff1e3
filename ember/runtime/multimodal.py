"""Images of a request to a vision-language model (Mllama): preprocessing with the checkpoint's
own HF processor, and where each text token looks in the request's image K/V.

HF's Mllama runs every image as `max_num_tiles` tiles of `patches` tokens (tiles beyond the
image's own are padding, which the image's real tiles attend in the vision tower), and each text
token's cross-attention sees the real tiles of the images its `cross_attention_mask` row names;
a row that names none (text before the first image) sees every image token, padding tiles
included, and its MLP output is zeroed (`full_text_row_masked_out_mask`). ember stores a
request's image K/V with every image's real tiles first, in image order, then the padding
tiles, so each row's tokens are one contiguous range `[start, end)`:
- images i..j (HF only ever gives a row consecutive images): from the first real tile of i to
  the last real tile of j;
- no image: everything (`[0, images * tiles * patches)`), row mask 0.
Decoded tokens use the last prompt token's row, as HF `generate` extends the mask.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class VisionGeometry:
    """What the vision tower makes of one image: `tiles` tiles of `patches` tokens each."""

    tiles: int
    patches: int

    @classmethod
    def of(cls, hf_config: Any) -> VisionGeometry:
        vision = hf_config.vision_config
        return cls(vision.max_num_tiles, (vision.image_size // vision.patch_size) ** 2 + 1)

    @property
    def tokens_per_image(self) -> int:
        return self.tiles * self.patches


@dataclass(frozen=True)
class ImageInputs:
    """A request's preprocessed images and each prompt position's cross-attention range.

    pixel_values [images, tiles, C, H, W], aspect_ratio_ids [images], aspect_ratio_mask
    [images, tiles]; `num_tiles[i]`: image i's real tiles. `starts`/`ends`/`attends`
    [prompt_len]: each prompt position's range in the request's image tokens and whether it
    attends any image. `digest`: a hash of the pixels (prefix-cache salt).
    """

    pixel_values: torch.Tensor
    aspect_ratio_ids: torch.Tensor
    aspect_ratio_mask: torch.Tensor
    num_tiles: tuple[int, ...]
    geometry: VisionGeometry
    starts: np.ndarray
    ends: np.ndarray
    attends: np.ndarray
    digest: bytes

    @property
    def num_images(self) -> int:
        return len(self.num_tiles)

    @property
    def num_tokens(self) -> int:
        """Image tokens of the request (its cross-attention K/V rows)."""
        return self.num_images * self.geometry.tokens_per_image

    def ranges(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(starts, ends, row mask) of positions start..start+count (past the prompt: the last
        prompt position's)."""
        pos = np.minimum(np.arange(start, start + count), len(self.starts) - 1)
        return self.starts[pos], self.ends[pos], self.attends[pos].astype(np.float32)

    def slots(self, image: int, cross_blocks: list[int] | tuple[int, ...], block_size: int):
        """Cache slots [tiles * patches] of image `image`'s vision-tower rows (HF order: tile by
        tile), real tiles first across images, then padding tiles (see the module docstring)."""
        g = self.geometry
        real = sum(self.num_tiles) * g.patches
        index = np.empty(g.tokens_per_image, dtype=np.int64)
        for t in range(g.tiles):
            rows = slice(t * g.patches, (t + 1) * g.patches)
            if t < self.num_tiles[image]:
                first = (sum(self.num_tiles[:image]) + t) * g.patches
            else:
                pad_before = sum(g.tiles - n for n in self.num_tiles[:image])
                first = real + (pad_before + t - self.num_tiles[image]) * g.patches
            index[rows] = np.arange(first, first + g.patches)
        blocks = np.asarray(cross_blocks, dtype=np.int64)
        return torch.from_numpy(blocks[index // block_size] * block_size + index % block_size)


def as_image_list(images: Any) -> list[Any]:
    """`multi_modal_data["image"]`: one image or a list of them."""
    if isinstance(images, (list, tuple)):
        return list(images)
    return [images]


def is_image(item: Any) -> bool:
    """A PIL image, or an image array/tensor (never a path or URL: nothing is fetched)."""
    if isinstance(item, (np.ndarray, torch.Tensor)):
        return item.ndim == 3
    try:
        from PIL import Image  # noqa: PLC0415
    except ImportError:
        return False
    return isinstance(item, Image.Image)


def build_image_inputs(
    token_ids: list[int],
    image_token_id: int,
    image_features: dict[str, Any],
    geometry: VisionGeometry,
) -> ImageInputs:
    """`ImageInputs` of a prompt's ids and its images' processor output (`pixel_values [1, n,
    tiles, C, H, W]`, `aspect_ratio_ids [1, n]`, `aspect_ratio_mask [1, n, tiles]`, whose ones
    are each image's real tiles); the prompt's `<|image|>` tokens must match the images in
    number (checked by the caller)."""
    from transformers.models.mllama.processing_mllama import (  # noqa: PLC0415
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    tile_mask = torch.as_tensor(np.asarray(image_features["aspect_ratio_mask"]))[0]
    num_tiles = [int(n) for n in tile_mask.sum(dim=1)]
    # HF's own mask [len, images, tiles] (the processor's), turned into ranges.
    dense = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(token_ids, image_token_id)],
        [num_tiles],
        geometry.tiles,
        len(token_ids),
    )[0]
    seen = dense[:, :, 0] > 0  # [len, images]: the images each position attends
    offsets = np.concatenate([[0], np.cumsum(num_tiles)]) * geometry.patches
    attends = seen.any(axis=1)
    first = np.where(attends, seen.argmax(axis=1), 0)
    last = np.where(attends, len(num_tiles) - 1 - seen[:, ::-1].argmax(axis=1), 0)
    if not np.array_equal(seen.sum(axis=1), np.where(attends, last - first + 1, 0)):
        raise ValueError("each token must attend consecutive images")  # never from HF's mask
    total = len(num_tiles) * geometry.tokens_per_image
    starts = np.where(attends, offsets[first], 0).astype(np.int32)
    ends = np.where(attends, offsets[last + 1], total).astype(np.int32)
    pixels = torch.as_tensor(np.asarray(image_features["pixel_values"]))[0].float().contiguous()
    return ImageInputs(
        pixel_values=pixels,
        aspect_ratio_ids=torch.as_tensor(np.asarray(image_features["aspect_ratio_ids"]))[0],
        aspect_ratio_mask=tile_mask,
        num_tiles=tuple(num_tiles),
        geometry=geometry,
        starts=starts,
        ends=ends,
        attends=attends,
        digest=hashlib.sha256(pixels.numpy().tobytes()).digest(),
    )
