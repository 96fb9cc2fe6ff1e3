"""Capture: the forward closures the runner calls, and the one `torch.compile` call site.

Each closure runs the HF model (loaded and rewritten by `ember.compiler.loader`) over one step's
flattened token stream, passing the step's tensors (`attn_metadata`, `kv_caches`) as keyword
arguments that transformers hands through to every attention call. The closures are traced by
torch.compile: no `.item()`, no branching on tensor values, no config or global reads.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ember.compiler.loader import LoadedModel, embed_with_positions

Forward = Callable[..., Any]


@dataclass(frozen=True)
class Forwards:
    """What the runner runs, compiled or eager; all take `(input_ids, positions,
    logits_indices, attn_metadata, kv_caches)`.

    `step`: logits [num_seqs, vocab] at `logits_indices` for an LM; hidden states
    [num_tokens, hidden] for an embedding model. `hidden`: hidden states [num_tokens, hidden]
    for pooling (an embedding model's `step`; a causal LM's base model, eager, since its graphs
    produce logits). `encoder`: the encoder pass of an encoder-decoder model, else None.
    """

    step: Forward
    hidden: Forward
    encoder: Forward | None = None
    compiled: bool = False

    def is_compiled(self, forward: Forward) -> bool:
        """Whether `forward` (one of these) runs compiled graphs: all but an eager `hidden`."""
        return self.compiled and (forward is not self.hidden or self.hidden is self.step)


def build_forwards(loaded: LoadedModel, kv_caches: list[torch.Tensor], compile: bool) -> Forwards:
    """Capture `loaded`'s forwards; with `compile`, through the one `torch.compile` call. The
    KV caches' block count is a dynamic dim, so graphs do not depend on the cache size."""
    model, task = loaded.model, loaded.spec.task
    if task == "embed":
        step = capture_hidden_forward(model, task)
    else:
        step = capture_forward(model, task)
    encoder = capture_encoder_forward(model) if task == "encdec" else None
    if compile:
        for kv in kv_caches:
            torch._dynamo.mark_dynamic(kv, 1)
        step = compile_forward(step)
        encoder = compile_forward(encoder) if encoder is not None else None
    hidden = step if task == "embed" else capture_hidden_forward(model, task)
    return Forwards(step, hidden, encoder, compile)


def compile_forward(forward: Forward) -> Forward:
    """The one `torch.compile` call site; no graph breaks allowed.

    Dynamo makes one graph per static token bucket and one with a dynamic token count (see
    `ember.runtime.buckets`). Compilation happens on the first call of each; the runner warms
    them all inside `ember.compiler.inductor.compile_settings()` before serving.

    Guards on the model's modules and parameters are skipped: ember never reassigns a module
    attribute or parameter after capture (weights, KV caches and LoRA slots change in place).
    Measured with two llama-160m engines stepping alternately in one process, batch-1 decode
    6.12 vs 6.39 and 6.04 vs 6.33 ms per step. Dynamo caches graphs per code object, so each
    capture compiles its own copy of the closure's code: two engines in one process never
    share graphs whose guards no longer tell their models apart.
    """
    fresh = types.FunctionType(
        forward.__code__.replace(),
        forward.__globals__,
        forward.__name__,
        forward.__defaults__,
        forward.__closure__,
    )
    return torch.compile(
        fresh,
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )


def mark_dynamic(
    per_seq: list[torch.Tensor], tables: list[torch.Tensor], per_token: list[torch.Tensor]
) -> None:
    """Mark a step's graph inputs dynamic before a compiled call: `per_seq` tensors in dim 0
    (num_seqs), `tables` in both dims (num_seqs, block-table width), `per_token` in dim 0
    (num_tokens: pass them only past the static bucket ladder)."""
    for t in per_seq:
        torch._dynamo.mark_dynamic(t, 0)
    for t in tables:
        torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(t, 1)
    for t in per_token:
        torch._dynamo.mark_dynamic(t, 0)


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


def capture_hidden_forward(model: PreTrainedModel, task: str) -> Callable[..., Any]:
    """The forward for pooling: same arguments as `capture_forward`'s, returns the last hidden
    states [num_tokens, hidden] (after the final norm) of the encoder or the causal LM's base
    model. `logits_indices` is unused (pooling needs every row)."""
    base = model.get_decoder() if task == "generate" else model
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
        types = {k: torch.zeros_like(input_ids)[None] for k in extra}
        out = base(
            input_ids=input_ids[None],
            position_ids=positions[None],
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
        logits = model.get_output_embeddings()(hidden[logits_indices])
        return logits + bias[0] if bias is not None else logits

    return forward


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
        out = model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            logits_to_keep=logits_indices,
            use_cache=False,
            attn_metadata=attn_metadata,
            kv_caches=kv_caches,
        )
        return out.logits[0]

    return forward
