"""Model-family forwards: the closures the runner calls for each task (decoder LMs, encoders,
BART's cross-attention decoder, Mllama's vision encoder, hidden-state poolers).

Traced by torch.compile: no `.item()`, no branching on tensor values, no config or global reads."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from ember.model.loader import embed_with_positions


def capture_encoder_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """The encoder pass of an encoder-decoder model: `(input_ids, positions, logits_indices,
    attn_metadata, kv_caches)` -> encoder output [num_tokens, d] (`logits_indices` unused).

    Runs the encoder over every request's input (bidirectional, its scratch K/V in the request's
    cross blocks), then writes each decoder layer's cross-attention K/V of that output into the
    same blocks, once per request (`ember::write_kv_cache`).
    """
    encoder, decoder = model.get_encoder(), model.get_decoder()

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        hidden = encoder(
            inputs_embeds=embed_with_positions(encoder, input_ids, positions),
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
        ).last_hidden_state[0]
        for i, layer in enumerate(decoder.layers):
            attn = layer.encoder_attn
            shape = (hidden.shape[0], -1, attn.head_dim)
            torch.ops.ember.write_kv_cache(
                kv_caches[i],
                attn.k_proj(hidden).view(shape),
                attn.v_proj(hidden).view(shape),
                attn_metadata.slot_mapping,
            )
        return hidden

    return forward


def capture_vision_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """The vision pass of a vision-language model (Mllama), one image per call:
    `(pixel_values [1, 1, tiles, C, H, W], aspect_ratio_ids [1, 1], aspect_ratio_mask [1, 1,
    tiles], slot_mapping [tiles * patches], kv_caches)` -> the projected image states
    [tiles * patches, hidden].

    Runs HF's vision tower and projector unmodified (every tile, padding tiles included: HF's
    valid tiles attend them), then writes each cross-attention layer's K (after its k_norm)
    and V of the image states into the request's cross blocks at `slot_mapping`
    (`ember::write_kv_cache`), once per request.
    """
    inner = model.model
    vision, projector = inner.vision_model, inner.multi_modal_projector
    lm = model.get_decoder()
    layers = [lm.layers[i].cross_attn for i in lm.cross_attention_layers]
    hidden_size = lm.config.hidden_size

    def forward(
        pixel_values: torch.Tensor,
        aspect_ratio_ids: torch.Tensor,
        aspect_ratio_mask: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        states = vision(
            pixel_values=pixel_values,
            aspect_ratio_ids=aspect_ratio_ids,
            aspect_ratio_mask=aspect_ratio_mask,
        ).last_hidden_state
        states = projector(states).reshape(-1, hidden_size)
        for attn in layers:
            shape = (states.shape[0], -1, attn.head_dim)
            torch.ops.ember.write_kv_cache(
                kv_caches[attn.layer_idx],
                attn.k_norm(attn.k_proj(states).view(shape)),
                attn.v_proj(states).view(shape),
                slot_mapping,
            )
        return states

    return forward


def capture_cross_attention_lm_forward(
    model: PreTrainedModel, images: bool = True
) -> Callable[..., Any]:
    """A vision-language model's language-model step (Mllama), same signature and result as
    `capture_forward`'s.

    The HF text model runs unmodified with a one-row placeholder as `cross_attention_states`
    (so no cross-attention layer is skipped; its own K/V of it are ignored: each token attends
    its range of the request's image K/V, see `ember.attention.hf_bridge`) and the step's
    per-token `cross_row_mask` as `full_text_row_masked_out_mask`. A text-only token (empty
    range, row mask 0) leaves a cross-attention layer unchanged, as HF skipping it does.
    `images=False`: the step of a batch with no image tokens, in which HF's text model skips
    its cross-attention layers (no cross-attention states).
    """
    lm, head = model.get_decoder(), model.get_output_embeddings()

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        embeds = lm.embed_tokens(input_ids[None])
        cross: dict[str, Any] = {}
        if images:
            row_mask = attn_metadata.cross_row_mask.to(embeds.dtype)[None, None, :, None]
            cross = dict(
                cross_attention_states=embeds.new_zeros(1, 1, embeds.shape[-1]),
                full_text_row_masked_out_mask=row_mask,
            )
        hidden = lm(
            inputs_embeds=embeds,
            position_ids=positions[None],
            use_cache=False,
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
            **cross,
        ).last_hidden_state[0]
        return _head_rows(head, hidden, logits_indices)

    return forward


# A pooled request's token type ids (a cross-encoder's segment of each token: 0 for the query,
# 1 for the document) ride in the high bits of its input ids (as vLLM carries them), so the
# step's graphs keep their one signature.
TOKEN_TYPE_SHIFT = 32


def with_token_types(ids: list[int], types: list[int] | None) -> list[int]:
    if not types:
        return ids
    return [i | (t << TOKEN_TYPE_SHIFT) for i, t in zip(ids, types, strict=True)]


def capture_hidden_forward(
    model: PreTrainedModel, task: str, position_offset: int = 0
) -> Callable[..., Any]:
    """The forward for pooling: same arguments as `capture_forward`'s, returns the last hidden
    states [num_tokens, hidden] (after the final norm) of the encoder, a classifier's base
    model or the causal LM's base model. `logits_indices` is unused (pooling needs every row).
    Token type ids come from the input ids' high bits (`with_token_types`); positions start at
    `position_offset` (`ModelSpec.position_offset`)."""
    if task == "generate":
        base = model.get_decoder()
    else:
        base = model.base_model if task == "classify" else model
    extra: dict[str, Any] = {}
    if "token_type_ids" in inspect.signature(base.forward).parameters:
        extra["token_type_ids"] = 0

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        types = {}
        if extra:
            types["token_type_ids"] = (input_ids >> TOKEN_TYPE_SHIFT)[None]
            input_ids = input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        out = base(
            input_ids=input_ids[None],
            position_ids=(positions + position_offset)[None],
            use_cache=False,
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
            **types,
        )
        return out.last_hidden_state[0]

    return forward


def _capture_decoder_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """An encoder-decoder model's decoder step, same signature and result as `capture_forward`.
    Cross-attention reads the K/V written by the encoder pass; HF's cross-attention modules get
    a one-row placeholder as `encoder_hidden_states` and their own K/V of it are ignored."""
    decoder = model.get_decoder()
    bias = getattr(model, "final_logits_bias", None)

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        embeds = embed_with_positions(decoder, input_ids, positions)
        hidden = decoder(
            inputs_embeds=embeds,
            encoder_hidden_states=embeds.new_zeros(1, 1, embeds.shape[-1]),
            use_cache=False,
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
        ).last_hidden_state[0]
        logits = _head_rows(model.get_output_embeddings(), hidden, logits_indices)
        return logits + bias[0] if bias is not None else logits

    return forward


def _one_token(x: torch.Tensor) -> bool:
    """Whether `x` (the step's tokens or hidden rows) is of the graph of a one-token step (a
    batch-1 decode). Its `logits_indices` are padded to `MIN_DYNAMIC_SIZE` rows, all 0
    (`ember.runtime.buckets`), so the LM head runs on the one hidden row (`_rows_of_one`),
    rather than once per padded row (a 32k-vocab head is a fifth of a small model's decode
    step). Static in that graph; False in the dynamic-token graph (a SymInt), so it adds no
    guard."""
    num_tokens = x.shape[0]
    return isinstance(num_tokens, int) and num_tokens == 1


def _rows_of_one(logits: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
    """A one-token step's logits [1, vocab] at its `logits_indices` (every one 0): the row
    repeated as a view (stride 0), not gathered: the gather wrote every padded row into a
    fresh buffer each step (llama-160m: 45 us of a 3.4 ms batch-1 decode, profiled; the
    decode graph 1.3% faster without it). Consumers read the rows or take `[:1]`."""
    return logits.expand(logits_indices.shape[0], logits.shape[-1])


def _head_rows(head: Callable[..., Any], hidden: torch.Tensor, logits_indices: torch.Tensor) -> Any:
    """The LM head at `logits_indices` of `hidden` [num_tokens, d] (see `_one_token`)."""
    if _one_token(hidden):
        return _rows_of_one(head(hidden), logits_indices)
    return head(hidden[logits_indices])


def capture_forward(model: PreTrainedModel, task: str) -> Callable[..., Any]:
    """The forward the runner calls: `(input_ids, positions, logits_indices, meta, kv_caches)`.

    Returns logits [num_logits, vocab] for the rows at `logits_indices`.
    """
    if task == "encdec":
        return _capture_decoder_forward(model)

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        one = _one_token(input_ids)
        out = model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            logits_to_keep=0 if one else logits_indices,  # 0: every row
            use_cache=False,
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
        )
        return _rows_of_one(out.logits[0], logits_indices) if one else out.logits[0]

    return forward
