"""Load a checkpoint and apply every rewrite ember makes to the HF model, in one place:

- attention routed to the backend's paged-attention op (`attn_implementation`, HF's attention
  registry; the modeling code itself is unmodified);
- encoder-decoder models: learned positions placed per token (`_PositionsAddedByEmber`) and
  the decoder's cross-attention modules marked;
- narrow linears: weight-only int8 (`quantization="int8"`) or bf16 weights through ember's
  GEMV (`ember.model.layers`); a causal LM's q/k/v and gate/up projections fused into one
  linear each (`fuse_projections_`);
- LoRA wrappers around the targeted projections (`ember.lora.layers`).
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ember import kernels
from ember.attention import AttentionBackend
from ember.attention.hf_bridge import register_attention
from ember.errors import UnsupportedModelError
from ember.host.memory import drop_pages, move_to_huge_pages, release_free_heap
from ember.lora.layers import LoRALinear, install_lora
from ember.model import packed_cache
from ember.model.layers.experts import StackedPanels, quantize_experts_
from ember.model.layers.group import GroupLinear
from ember.model.layers.packed import GemvLinear, PackedLinear
from ember.model.layers.rewrite import (
    fuse_projections_,
    quantize_int4_,
    quantize_int8_,
    use_kernel_linears_,
)
from ember.model.spec import ModelSpec

logger = logging.getLogger("ember")


@dataclass(frozen=True)
class LoRAShape:
    """Adapter slots built into the model: `max_loras` slots of rank up to `max_rank`, a per-token
    slot index for up to `max_tokens` tokens per step."""

    max_loras: int
    max_rank: int
    max_tokens: int


@dataclass
class LoadedModel:
    """A model ready to capture, and what it was built with (the compile-cache key reads it).

    `kv_layer_shapes`: (num_kv_heads, head_dim) of each KV-cache layer. `lora_layers`: wrapped
    module name -> wrapper; `lora_token_slots [max_tokens]`: the slot index each token of a step
    uses, shared by every wrapper (both empty/None without LoRA).
    """

    model: PreTrainedModel
    spec: ModelSpec
    tokenizer: PreTrainedTokenizerBase | None
    dtype: torch.dtype
    weight_dtype: torch.dtype
    quantization: str | None
    attention_backend: str
    cpu_isa: str
    kv_layer_shapes: tuple[tuple[int, int], ...]
    lora: LoRAShape | None = None
    lora_layers: dict[str, LoRALinear] | None = None
    lora_token_slots: torch.Tensor | None = None


def load_model(
    spec: ModelSpec,
    dtype: torch.dtype,
    backend: AttentionBackend,
    quantization: str | None = None,
    lora: LoRAShape | None = None,
    weight_dtype: torch.dtype | None = None,
    kernel_linears: bool = True,
    cpu_isa: str = "native",
    load_format: str = "safetensors",
    quantize_activations: bool = True,
) -> LoadedModel:
    """Load `spec`'s weights (safetensors, offline), eval mode, with every rewrite above: the
    causal LM, the encoder-decoder LM, or the encoder base model of an embedding model.

    Linear weights are stored in `weight_dtype` (default `dtype`) or quantized; everything else
    (activations, norms, biases) runs in `dtype`. bf16 weights under fp32 math are read by
    ember's kernels (`cpu_isa` build), which widen them to fp32 as they go; the input embedding
    table stays in `weight_dtype` too (a lookup reads one row) and its output is widened.
    `kernel_linears`: route bf16/fp32 linears through ember's GEMV (off for frozen graphs,
    whose linears inductor prepacks). `load_format`: "safetensors" (only) or "auto" (PyTorch
    .bin files when there are no safetensors); the checkpoint's own code never runs
    (`trust_remote_code=False`). `quantize_activations=False`: int8 linears multiply fp32
    activations (`Int8Linear`).
    """
    if spec.gguf_file is not None:
        model, tokenizer = _load_gguf(spec, dtype, backend, cpu_isa)
        return _loaded(model, spec, tokenizer, dtype, dtype, "gguf", backend, cpu_isa)
    weight_dtype = weight_dtype or dtype
    narrow = weight_dtype != dtype and quantization is None
    if narrow and not kernels.available(cpu_isa):
        logger.warning("ember's kernels are unavailable: linear weights stored in %s", dtype)
        weight_dtype, narrow = dtype, False
    load_dtype = weight_dtype
    if quantization is not None and spec.checkpoint_dtype in (torch.bfloat16, torch.float16):
        # Quantized one linear at a time from the checkpoint's own 16-bit tensors (views of
        # the mapped file), never from an fp32 copy of the whole model.
        load_dtype = spec.checkpoint_dtype
        narrow = load_dtype != dtype
    attn: str | dict[str, str] = register_attention(backend, cpu_isa)
    if spec.multimodal is not None:
        # The vision tower attends within each image, unpaged: transformers' SDPA, as in HF.
        attn = {"": attn, "text_config": attn, "vision_config": "sdpa"}
    entry = None
    if lora is None:  # LoRA's slot tensors are shared outside the model: always built afresh
        # Kernels first: whether they load decides the model's layout (and the key says so).
        uses_kernels = (quantization is not None or kernel_linears or narrow) and (
            kernels.available(cpu_isa)
        )
        settings = {
            "dtype": str(dtype),
            "weight_dtype": str(weight_dtype),
            "quantization": quantization,
            "quantize_activations": quantize_activations,
            "kernel_linears": kernel_linears,
            "kernels": uses_kernels and (kernels.loaded_isa(), kernels.panel_width()),
        }
        entry = _checkpoint_entry(spec, attn, settings, load_format)
        model = packed_cache.load(entry)  # the model a previous load built, mapped back
        if model is not None:
            return _loaded(
                model, spec, load_tokenizer(spec.model_dir), dtype, weight_dtype, quantization,
                backend, cpu_isa,
            )  # fmt: skip
    model = _from_pretrained(spec, load_dtype, attn, load_format)
    layers = token_slots = None
    if lora is not None:  # before narrowing, which then reaches the wrapped base linears too
        layers, token_slots = install_lora(model, lora.max_loras, lora.max_rank, lora.max_tokens)
    consumed = CheckpointPages(model, spec.model_dir)
    if spec.task == "generate" and spec.multimodal is None and lora is None:
        # Fused as the checkpoint's own tensors, then packed: each group is copied once.
        fuse_projections_(model, consumed)
    _rewrite_linears(
        model, spec.task, dtype, quantization, quantize_activations, kernel_linears or narrow,
        cpu_isa, consumed,
    )  # fmt: skip
    if narrow:
        _widen_all_but_linear_weights(model, dtype)
    _release_checkpoint_mapping(model, spec.model_dir)
    tokenizer = load_tokenizer(spec.model_dir)
    return _loaded(
        model, spec, tokenizer, dtype, weight_dtype, quantization, backend, cpu_isa, lora,
        layers, token_slots, cache_entry=entry,
    )  # fmt: skip


def _from_pretrained(
    spec: ModelSpec, load_dtype: torch.dtype, attn: str | dict[str, str], load_format: str
) -> PreTrainedModel:
    """The checkpoint's HF model in eval mode, its attention routed to `attn`, with the
    encoder-decoder and cross-attention preparations made (weights as stored, unrewritten)."""
    try:
        model = spec.auto_class.from_pretrained(
            spec.model_dir,
            dtype=load_dtype,
            attn_implementation=attn,
            local_files_only=True,
            use_safetensors=True if load_format == "safetensors" else None,
            trust_remote_code=False,
        )
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise UnsupportedModelError(f"cannot load weights of {spec.model_dir!r}: {e}") from e
    model.eval().requires_grad_(False)
    if spec.task == "encdec":
        _prepare_encoder_decoder(model)
    if spec.multimodal is not None:
        _prepare_cross_attention_lm(model)
    return model


def _rewrite_linears(
    model: PreTrainedModel,
    task: str,
    dtype: torch.dtype,
    quantization: str | None,
    quantize_activations: bool,
    kernel_linears: bool,
    cpu_isa: str,
    consumed: CheckpointPages,
) -> None:
    """Quantize the linears (`quantization`), or route them through ember's kernels
    (`kernel_linears`, where the kernels are available)."""
    if quantization == "int8":
        kernels.load(cpu_isa)
        # An embedding model's steps are whole texts: int8 GEMMs on per-token scales.
        per_token = task in ("embed", "classify")
        quantize_int8_(model, consumed, quantize_activations, per_token)
        quantize_experts_(model, 8, consumed)  # MoE experts: 8-bit groups of 32 (Q8_0's)
    elif quantization == "int4":
        kernels.load(cpu_isa)
        quantize_int4_(model, consumed=consumed)
        quantize_experts_(model, 4, consumed)
    elif kernel_linears and kernels.available(cpu_isa):
        use_kernel_linears_(model, dtype, consumed)


def _loaded(
    model: PreTrainedModel,
    spec: ModelSpec,
    tokenizer: PreTrainedTokenizerBase | None,
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    quantization: str | None,
    backend: AttentionBackend,
    cpu_isa: str,
    lora: LoRAShape | None = None,
    lora_layers: dict[str, LoRALinear] | None = None,
    lora_token_slots: torch.Tensor | None = None,
    cache_entry: str | None = None,
) -> LoadedModel:
    """The `LoadedModel` of `model`, its weights moved to huge pages, then written to the
    weights cache at `cache_entry` (on a thread, from where they will stay: the writer holds
    no second copy)."""
    if lora is None:  # LoRA's slot tensors are also held outside the model: left in place
        moved = move_to_huge_pages([*model.parameters(), *model.buffers()])
        logger.debug("weights moved to huge pages: %.1f MB", moved / 1e6)
    packed_cache.save(cache_entry, model)
    release_free_heap()  # after every temporary of the load, the tokenizer's included
    return LoadedModel(
        model=model,
        spec=spec,
        tokenizer=tokenizer,
        dtype=dtype,
        weight_dtype=weight_dtype,
        quantization=quantization,
        attention_backend=backend.name,
        cpu_isa=cpu_isa,
        kv_layer_shapes=kv_layer_shapes(model, spec),
        lora=lora,
        lora_layers=lora_layers,
        lora_token_slots=lora_token_slots,
    )


def _checkpoint_entry(
    spec: ModelSpec, attn: str | dict[str, str], settings: dict[str, Any], load_format: str
) -> str | None:
    """The weights-cache entry of the checkpoint's model built with `settings`."""
    return packed_cache.entry_path(
        packed_cache.checkpoint_files(spec.model_dir),
        {
            "checkpoint": os.path.realpath(spec.model_dir),
            **settings,
            **_built_from(spec, attn),
            "task": spec.task,
            "load_format": load_format,
        },
    )


def _built_from(spec: ModelSpec, attention: str | dict[str, str]) -> dict[str, Any]:
    """What a weights-cache entry's model is built from besides its files and settings: the
    attention implementation, the model class and a digest of its config."""
    return {
        "attention": attention,
        "model_class": f"{spec.auto_class.__module__}.{spec.auto_class.__qualname__}",
        "config": packed_cache.config_digest(spec.hf_config),
    }


def _load_gguf(
    spec: ModelSpec, dtype: torch.dtype, backend: AttentionBackend, cpu_isa: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A GGUF file's model and tokenizer (`ember.model.gguf`): quantized weights as 8- or
    4-bit groups, the rest in their own 16/32-bit types; math in `dtype`."""
    from ember.model.gguf import hf, reader
    from ember.model.gguf import load as gguf

    path = spec.gguf_file
    assert path is not None
    kernels.prebuild(cpu_isa)
    attention = register_attention(backend, cpu_isa, resolve=False)
    entry = packed_cache.entry_path(
        path,
        {
            "cpu_isa": cpu_isa,
            "panel": kernels.panel_width(),
            **_built_from(spec, attention),
        },
    )
    model = packed_cache.load(entry)  # the model a previous load built, mapped back
    try:
        if model is not None:
            tokenizer = hf.load_gguf_tokenizer(path)
        else:
            # Neither the tokenizer nor the weights' layout needs the kernels loaded: a first
            # build runs on another core meanwhile (about 15 s).
            with gguf.weights_arena(path):  # faulted in while the tokenizer and model load
                tokenizer = hf.load_gguf_tokenizer(path)
                model = gguf.load_gguf_model(path, spec.hf_config, spec.auto_class, attention)
            packed_cache.save(entry, model)
    finally:
        reader.release(path)  # the file's memory map
    if not kernels.available(cpu_isa):
        raise UnsupportedModelError(
            "GGUF files run on ember's C++ kernels, which cannot be built here"
        )
    register_attention(backend, cpu_isa)
    use_kernel_linears_(model, dtype)
    fuse_projections_(model)
    _widen_all_but_linear_weights(model, dtype)
    return model, tokenizer


def _widen_all_but_linear_weights(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Every floating parameter and buffer in `dtype`, except the weights ember's linears read
    narrow (and every tensor of a group-quantized one) and the input embedding table, whose
    output is widened instead (a tied LM head shares that table, so it stays one tensor)."""
    embed = model.get_input_embeddings()
    keep = {id(m.weight) for m in model.modules() if isinstance(m, (GemvLinear, PackedLinear))}
    keep.update(
        id(t)
        for m in model.modules()
        if isinstance(m, (GroupLinear, StackedPanels))
        for t in m.buffers()
    )
    keep.add(id(embed.weight))
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype and id(param) not in keep:
                param.data = param.data.to(dtype)
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_floating_point() and buf.dtype != dtype and id(buf) not in keep:
                module._buffers[name] = buf.to(dtype)
    embed.register_forward_hook(_WidenOutput(dtype))


class _WidenOutput:
    """A forward hook that casts a module's output to `dtype` (a class, not a lambda: the
    weights cache pickles the model with its hooks)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, _module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return out.to(self.dtype)


def _release_checkpoint_mapping(model: PreTrainedModel, model_dir: str) -> None:
    """Copy the few tensors that still view the checkpoint's memory-mapped safetensors files
    once most of the mapping is no longer used, so the mapping is unmapped.

    transformers maps the files and, where no dtype conversion is needed, hands out views of
    the mapping. Once the linears are repacked (fp32 panels, int8), only the embeddings and
    norms still view it, yet they keep the whole mapping alive, and every page the repacking
    read counts in the process's RSS: a second copy of the weights (fp32 model of 274 MB: RSS
    +274 MB). Kept as is when the model still reads most of the mapped bytes (bf16 weights
    read in place): copying them would only move them from page cache to private memory.
    """
    ranges = _mapped_ranges(os.path.realpath(model_dir))
    if not ranges:
        return
    mapped = sum(end - start for start, end in ranges)
    tensors = _mapped_tensors(model, ranges)
    used = sum(
        t.numel() * t.element_size() for _, _, t, _ in {id(x[2]): x for x in tensors}.values()
    )
    if used > mapped // 2:
        return
    copies: dict[int, torch.Tensor] = {}  # tied tensors stay tied
    for module, name, t, is_param in tensors:
        copy = copies.setdefault(id(t), t.detach().clone())
        if is_param:
            t.data = copy  # the same Parameter object: ties through it survive
        else:
            module._buffers[name] = copy


class CheckpointPages:
    """Gives back the pages of the checkpoint's file mapping that a weight held once that
    weight has been re-laid out (fused, packed or quantized into tensors of ember's own), so
    the load holds about one copy of the weights rather than two: the mapping's pages count
    in the process's RSS until unmapped, and the mapping stays until the last view of it
    goes (`_release_checkpoint_mapping`, after every linear is converted). Measured on a
    Qwen2-0.5B bf16 checkpoint (988 MB), peak RSS growth over the load (with the fusing
    before packing, the chunked quantizers and the old linears freed as they go): 2380 ->
    1220 MB at the default dtype, 2877 -> 1012 with int8, 2835 -> 836 with int4.

    Only whole pages inside the weight are given back (`MADV_DONTNEED`: a later read of them
    would fault in the file's bytes again), once every module that held it has let it go (a
    tied table stays while its embedding reads it), and none that another tensor views.
    """

    def __init__(self, model: torch.nn.Module, model_dir: str) -> None:
        self.ranges = _mapped_ranges(os.path.realpath(model_dir))
        self.page = os.sysconf("SC_PAGE_SIZE")
        # id -> (the tensor, weakly: a freed one's id may be reused; its byte range)
        self.views: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self.users: dict[int, int] = {}  # id -> modules holding it
        self.released = 0
        for _, _, t, _ in _mapped_tensors(model, self.ranges):
            start = t.data_ptr()
            self.views[id(t)] = (weakref.ref(t), start, start + t.numel() * t.element_size())
            self.users[id(t)] = self.users.get(id(t), 0) + 1

    def __call__(self, t: torch.Tensor) -> None:
        view = self.views.get(id(t))
        if view is None or view[0]() is not t:
            return
        self.users[id(t)] -= 1
        if self.users[id(t)] > 0:
            return
        del self.views[id(t)]
        if not t.is_contiguous():
            return
        first = -(-view[1] // self.page) * self.page
        last = view[2] // self.page * self.page
        if last <= first:
            return
        if any(ref() is not None and s < last and first < e for ref, s, e in self.views.values()):
            return  # another tensor views these pages (a tie, an alias): left mapped
        if drop_pages(first, last - first):
            self.released += last - first


def _mapped_tensors(
    model: torch.nn.Module, ranges: list[tuple[int, int]]
) -> list[tuple[torch.nn.Module, str, torch.Tensor, bool]]:
    """(module, name, tensor, is_param) of each parameter and buffer of `model` whose data lies
    in one of `ranges`, once per module holding it (a tied tensor once per holder)."""
    return [
        (module, name, t, is_param)
        for module in model.modules()
        for is_param, items in (
            (True, module.named_parameters(recurse=False)),
            (False, module.named_buffers(recurse=False)),
        )
        for name, t in items
        if t.numel() and any(start <= t.data_ptr() < end for start, end in ranges)
    ]


def _mapped_ranges(directory: str) -> list[tuple[int, int]]:
    """Address ranges of this process's file mappings of files under `directory` (Linux)."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip().startswith(directory + os.sep):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return ranges


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None (logged) when it has none: token-id prompts only."""
    try:
        return AutoTokenizer.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, TypeError, ImportError) as e:
        # ImportError: the tokenizer class needs a package not installed (BioGPT: sacremoses)
        logger.warning("no tokenizer in %s (%s); only token-id prompts work", model_dir, e)
        return None


def kv_layer_shapes(model: torch.nn.Module, spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(num_kv_heads, head_dim) of each KV-cache layer, read from the loaded attention modules
    (models such as Gemma 4 give global-attention layers their own head_dim and K/V heads);
    layers whose modules do not say keep the config's geometry."""
    shapes = [(spec.num_kv_heads, spec.head_dim)] * spec.num_kv_layers
    for module in model.modules():
        idx, dim = getattr(module, "layer_idx", None), getattr(module, "head_dim", None)
        k_proj = getattr(module, "k_proj", None)
        out = getattr(k_proj, "out_features", None)
        if isinstance(idx, int) and isinstance(dim, int) and isinstance(out, int):
            if 0 <= idx < spec.num_kv_layers:
                shapes[idx] = (out // dim, dim)
    return tuple(shapes)


class _PositionsAddedByEmber(torch.nn.Module):
    """Stands in for an encoder-decoder model's learned position embedding.

    HF's BART-family encoder and decoder derive positions from the batch shape (0..T-1 plus the
    HF cache length), which is wrong for ember's flattened multi-sequence stream. ember adds
    each token's own position embedding to `inputs_embeds` (`embed_with_positions`), and this
    module adds zeros in its place: x + 0.0 == x, so the sum is bit-identical to HF's.
    """

    def __init__(self, original: torch.nn.Embedding) -> None:
        super().__init__()
        self.original = original

    def forward(
        self,
        input_ids: torch.Tensor | None,
        past_key_values_length: int = 0,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num = input_ids.shape[1] if input_ids is not None else position_ids.shape[-1]  # type: ignore[union-attr]
        weight = self.original.weight
        return weight.new_zeros(1, num, weight.shape[1])


def _prepare_encoder_decoder(model: PreTrainedModel) -> None:
    """Swap in `_PositionsAddedByEmber` and mark the decoder's cross-attention modules (the HF
    modeling code itself is untouched)."""
    arch = type(model).__name__
    for stack in (model.get_encoder(), model.get_decoder()):
        positions = getattr(stack, "embed_positions", None)
        if not isinstance(positions, torch.nn.Embedding) or not hasattr(positions, "offset"):
            raise UnsupportedModelError(
                f"{arch}: ember runs encoder-decoder models with learned absolute position "
                "embeddings (the BART family); this one has none it can place per sequence"
            )
        stack.embed_positions = _PositionsAddedByEmber(positions)
    for layer in model.get_decoder().layers:
        cross = getattr(layer, "encoder_attn", None)
        if cross is None:
            raise UnsupportedModelError(f"{arch}: decoder layers have no `encoder_attn`")
        cross._ember_cross_attention = True


def _prepare_cross_attention_lm(model: PreTrainedModel) -> None:
    """Mark the cross-attention modules of a vision-language model (Mllama): each text token
    attends a range of its sequence's image tokens (`ember::cross_attention_ranges`)."""
    lm = model.get_decoder()
    layers = getattr(lm, "cross_attention_layers", None)
    if not layers:
        raise UnsupportedModelError(f"{type(model).__name__}: no cross-attention layers")
    for idx in layers:
        lm.layers[idx].cross_attn._ember_cross_attention = "ranges"


def embed_with_positions(
    stack: Any, input_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Token embeddings plus each token's own position embedding: [1, num_tokens, d]. Traced by
    torch.compile (called from the captured encoder-decoder forwards)."""
    learned = stack.embed_positions.original
    # nn.Embedding's lookup, not the module's own forward (which derives positions from shape).
    pos = torch.nn.functional.embedding(positions[None] + learned.offset, learned.weight)
    return stack.embed_tokens(input_ids[None]) + pos
