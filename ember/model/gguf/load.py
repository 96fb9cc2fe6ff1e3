"""GGUF files (llama.cpp's format): the config, tokenizer and weights of one `.gguf` file, mapped
to the transformers model of its architecture, whose code then runs unmodified.

The file is read by ember's own parser (`reader`); metadata, tokenizer (with its chat template)
and the tensor-name mapping are made as transformers' own GGUF support makes them (`hf`,
`names`), and its per-architecture tensor processors are applied (the reverse of llama.cpp's
Q/K row permutation, Gemma's norm offset). What transformers does not do is keep the weights
quantized: its loader dequantizes every tensor to fp32. Here each tensor is placed in the model as
it is read:

- Q8_0, Q4_0 and Q4_1 linear weights become `GroupLinear`s holding the file's codes and scales
  exactly (fp16 scales, 8- or 4-bit codes, multiplied by ember's int8 dot-product kernel); a
  table in one of those types becomes a `GroupEmbedding` over the same codes, shared with a
  tied LM head;
- Q4_K weights (most of a Q4_K_M file) and Q6_K weights (a Q4_K_M file's LM head and half its
  V and down projections, and the head of most Q4_0 files) are kept as they are, in
  super-blocks of 256: 4-bit codes with a 6-bit scale and offset per 32 and fp16 d and dmin
  per 256, and 6-bit codes with an int8 scale per 16 and fp16 d per 256 (4.5 and 6.56 bits a
  weight, as in the file);
- Q5_0 weights become 5-bit codes exactly (5.5 bits a weight, as in the file); every other
  quantized type (Q5_K, Q5_1, IQ*) is
  dequantized tensor by tensor (the `gguf` package's numpy reference) and requantized to 8-bit
  groups of 32;
- F32, F16 and BF16 tensors keep their type: linears become `PackedLinear`s (F16 packed as fp16
  and widened exactly), packed straight from the file's map, and a table tied to the LM head
  becomes a `PackedEmbedding` over the packed head; a quantized tensor that fits no group
  layout is dequantized to bf16.

The model is built on the meta device, so nothing is allocated for a weight until its tensor is
read, and the file's memory map is dropped after loading: the process holds about the file's
size.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from ember import kernels
from ember.errors import UnsupportedModelError
from ember.host.memory import HeapTrimmer, weight_arena
from ember.model.gguf.convert import (
    _dense,
    _dense_view,
    _permute_rows,
    _row_chunks,
    fused_group_linear,
    group_linear_from_file,
    panel_layout,
)
from ember.model.gguf.index import _IndexedFile, _save_index
from ember.model.gguf.names import weights_map
from ember.model.gguf.reader import DENSE_TYPES, _architecture, _reader
from ember.model.layers.experts import QuantizedExperts, StackedPanels, hf_experts_activation
from ember.model.layers.group import (
    GroupEmbedding,
    GroupLinear,
)
from ember.model.layers.packed import PackedEmbedding, PackedLinear, gathers_rows
from ember.model.layers.panels import GROUP_SIZE
from ember.model.layers.rewrite import FUSED_PROJECTIONS, place_fused

logger = logging.getLogger("ember")

# A MoE layer's experts in one tensor [E, rows, K] each (llama.cpp's names).
_EXPERT_TENSOR = re.compile(r"(?P<name>blk\.\d+\.ffn_(?P<w>gate|up|down)_exps)\.weight")


@contextlib.contextmanager
def weights_arena(path: str) -> Iterator[None]:
    """The quantized weights of `path` loaded in this block are packed into one
    `WeightArena`, faulted in by a thread from here on and collapsed into huge pages once the
    engine is ready (see `host.WeightArena`), instead of being built on the heap and copied
    by `move_to_huge_pages`. AMD EPYC (Zen 4, KVM), fresh processes, medians of 5:
    qwen2-0.5b Q4_0 loaded in 1.37 s instead of 1.55 (1.50 with the arena not faulted in
    ahead), peak RSS +384 MB instead of +402; llama-160m Q8_0 0.53 s instead of 0.56, +151
    MB instead of +163. Faulted in as 4 KiB pages and collapsed later: 0.93 s and 0.25 s."""
    packed, panel = 0, kernels.panel_width()
    for tensor in _reader(path, light=True).tensors:
        qtype = tensor.tensor_type
        if qtype.name in DENSE_TYPES and len(tensor.shape) == 2:  # packed, or a copied table
            n, k = int(tensor.shape[1]), int(tensor.shape[0])
            packed += -(-n // panel) * panel * k * tensor.n_bytes // (n * k)
            continue
        experts = int(tensor.shape[2]) if len(tensor.shape) == 3 else 1  # MoE: [E, N, K]
        if (
            qtype.name in DENSE_TYPES
            or len(tensor.shape) not in (2, 3)
            or tensor.shape[0] % GROUP_SIZE
        ):
            continue
        bits, offsets, super_blocks = panel_layout(qtype)
        n, k = int(tensor.shape[1]), int(tensor.shape[0])
        packed += experts * GroupLinear.packed_nbytes(n, k, bits, offsets, super_blocks)
    # Room for fused groups' and alignment's slack; only `packed` is faulted in ahead.
    with weight_arena(packed + packed // 8 + (4 << 20), packed):
        yield


def load_gguf_model(
    path: str, config: PretrainedConfig, auto_class: Any, attn_implementation: str
) -> nn.Module:
    """The transformers model of `config` with the file's weights (see the module doc)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = _reader(path, light=True)  # tensors and the architecture only
    arch = _architecture(reader, path)
    with torch.device("meta"):
        model = auto_class.from_config(config, attn_implementation=attn_implementation)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    model_class = f"{type(model).__module__}.{type(model).__qualname__}"
    names = reader.names.get(model_class) if isinstance(reader, _IndexedFile) else None
    if names is None:
        # Names by the file's own architecture (Mistral files say "llama", which gguf-py maps).
        names = weights_map(model, processor, arch)
        _save_index(path, reader, arch, model_class, names)
    placer = _Placer(path, model, processor, reader)
    kept, dense, tables, experts = placer.sort(names, arch)
    placer.place_experts(experts)
    placer.fuse_quantized(kept)
    placer.place_dense_linears(dense)
    placer.place_quantized(kept)
    for module_name, tensor in tables.items():  # after the head, which may be quantized
        if not _pack_tied_table(model, module_name, processor, tensor, reader.drop_pages):
            placer.place_dense(
                model.get_submodule(module_name), "weight", tensor, f"{module_name}.weight"
            )
    del reader, placer, kept, dense, tables
    _tie_head(model, config)
    _materialize_buffers(model)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise UnsupportedModelError(
            f"GGUF file {path!r} has no tensors for {len(missing)} weights of {arch}, e.g. "
            f"{', '.join(missing[:3])}"
        )
    return model.eval().requires_grad_(False)


class _Placer:
    """Places a GGUF file's tensors in the meta-device `model` as each is converted. Each
    tensor's file pages are dropped from the process once it is converted, and the C heap's
    freed temporaries returned now and then: qwen2-0.5b Q4_0 (350 MB) loaded with a peak of
    +1,000 MB over the imports, +800 MB with the conversions chunked alone."""

    def __init__(self, path: str, model: nn.Module, processor: Any, reader: Any) -> None:
        self.path, self.model, self.processor, self.reader = path, model, processor, reader
        self.heap = HeapTrimmer()

    def release(self, part: np.ndarray) -> None:
        self.reader.drop_pages(part)
        self.heap.freed(part.nbytes * 4)  # the chunk's temporaries: about 4 bytes a byte of it

    def sort(
        self, names: dict[str, str], arch: str
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
        """Place every tensor that goes in as it is (`place_dense`); return the rest by module:
        (quantized weights, converted once every bias is in place; F32/F16/BF16 linear
        weights, packed likewise; F32/F16/BF16 tables, packed as a tied head or copied; MoE
        experts modules' expert tensors, by "gate" / "up" / "down")."""
        kept: dict[str, Any] = {}
        dense: dict[str, Any] = {}
        tables: dict[str, Any] = {}
        experts: dict[str, dict[str, Any]] = {}
        for tensor in self.reader.tensors:
            hf_name = names.get(tensor.name)
            expert = _EXPERT_TENSOR.fullmatch(tensor.name)
            if hf_name is None and expert is not None and expert["name"] in names:
                # transformers maps gate and up (one HF tensor) by their names without ".weight"
                module_name = names[expert["name"]].rpartition(".")[0]
                experts.setdefault(module_name, {})[expert["w"]] = tensor
                continue
            if hf_name is None:
                logger.info("GGUF tensor %s has no place in %s; skipped", tensor.name, arch)
                continue
            qtype = tensor.tensor_type.name
            module_name, _, attr = hf_name.rpartition(".")
            module = self.model.get_submodule(module_name)
            if attr == "weight" and qtype not in DENSE_TYPES and _groups_fit(module):
                kept[module_name] = tensor
                continue
            if attr == "weight" and qtype in DENSE_TYPES and len(tensor.shape) == 2:
                if isinstance(module, nn.Linear):
                    dense[module_name] = tensor
                    continue
                if gathers_rows(module):
                    tables[module_name] = tensor
                    continue
            self.place_dense(module, attr, tensor, hf_name)
        return kept, dense, tables, experts

    def place_experts(self, experts: dict[str, dict[str, Any]]) -> None:
        """Each MoE layer's expert tensors ([E, rows, K] each): quantized ones kept as the file
        holds them in a `QuantizedExperts` (see `ember.model.layers.experts`), where the
        experts module is one it runs exactly; else set as the HF module's `gate_up_proj`
        ([gate; up] per expert) and `down_proj`, dequantized to bf16 where quantized."""
        for module_name, parts in experts.items():
            module = self.model.get_submodule(module_name)
            if set(parts) != {"gate", "up", "down"}:
                raise UnsupportedModelError(
                    f"GGUF file {self.path!r}: {module_name} has expert tensors "
                    f"{sorted(parts)}, not gate, up and down"
                )
            gate, up, down = parts["gate"], parts["up"], parts["down"]
            num_experts, rows2, width = module.gate_up_proj.shape
            for tensor, want in ((gate, (width, rows2 // 2)), (up, (width, rows2 // 2)),
                                 (down, (rows2 // 2, width))):  # fmt: skip
                got = tuple(int(n) for n in tensor.shape)  # ggml's order: K, rows, experts
                if got != (*want, num_experts):
                    raise UnsupportedModelError(
                        f"GGUF tensor {tensor.name} is {got[::-1]}, the config says "
                        f"{(num_experts, *want[::-1])}"
                    )
            activation = hf_experts_activation(module)
            types = [t.tensor_type for t in (gate, up, down)]
            fits = (
                all(t.name not in DENSE_TYPES for t in types)
                and not (width % GROUP_SIZE)
                and not (rows2 // 2 % GROUP_SIZE)
            )
            if activation is not None and fits:
                _place(self.model, module_name, self._quantized_experts(gate, up, down, activation))
                continue
            halves = [_dense(t, t.tensor_type.name, t.data) for t in (gate, up)]
            dtype = torch.promote_types(halves[0].dtype, halves[1].dtype)
            gate_up = torch.cat([h.to(dtype) for h in halves], dim=1)
            del halves
            _set_tensor(module, "gate_up_proj", gate_up, f"{module_name}.gate_up_proj")
            _set_tensor(module, "down_proj", _dense(down, types[2].name, down.data),
                        f"{module_name}.down_proj")  # fmt: skip
            for t in (gate, up, down):
                self.reader.drop_pages(t.data)

    def _quantized_experts(self, gate: Any, up: Any, down: Any, activation: str) -> nn.Module:
        """gate, up and down, each one `StackedPanels` packed expert by expert straight from
        the file (gate and up as one where they share a type and the gate fills whole
        panels), each expert's file pages dropped once packed."""
        num_experts = int(gate.shape[2])
        fused = (
            gate.tensor_type == up.tensor_type and int(gate.shape[1]) % kernels.panel_width() == 0
        )

        def stacked(tensors: list[Any]) -> StackedPanels:
            bits, offsets, super_blocks = panel_layout(tensors[0].tensor_type)
            rows = sum(int(t.shape[1]) for t in tensors)
            stack = StackedPanels(num_experts, rows, int(tensors[0].shape[0]), bits, offsets,
                                  super_blocks)  # fmt: skip
            for e in range(num_experts):
                chunks = itertools.chain.from_iterable(
                    _row_chunks(t.data[e], t.tensor_type, self.release) for t in tensors
                )
                stack.fill(e, chunks)
            return stack

        if fused:
            return QuantizedExperts(num_experts, activation, stacked([gate, up]), None,
                                    stacked([down]))  # fmt: skip
        return QuantizedExperts(num_experts, activation, stacked([gate]), stacked([up]),
                                stacked([down]))  # fmt: skip

    def place_dense(self, module: nn.Module, attr: str, tensor: Any, hf_name: str) -> None:
        """`tensor` set as it is (`_dense`), its file pages dropped."""
        data = _permute_rows(self.processor, tensor.name, tensor.data)
        _set_tensor(module, attr, _dense(tensor, tensor.tensor_type.name, data), hf_name)
        del data
        self.reader.drop_pages(tensor.data)
        self.heap.freed(tensor.n_bytes)

    def bias_of(self, module_name: str, tensor: Any) -> torch.Tensor | None:
        """The bias of `module_name`, once its GGUF weight `tensor` is checked against it."""
        module = self.model.get_submodule(module_name)
        expected = (module.weight.shape[0], module.weight.shape[1])
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml lists the input size first
        if shape != expected:
            raise UnsupportedModelError(
                f"GGUF file {self.path!r}: {module_name} is {shape[0]}x{shape[1]}, the config "
                f"says {expected[0]}x{expected[1]}"
            )
        bias = getattr(module, "bias", None) if isinstance(module, nn.Linear) else None
        if bias is not None and bias.is_meta:
            raise UnsupportedModelError(
                f"GGUF file {self.path!r} has no tensor for {module_name}.bias"
            )
        return bias

    def fuse_quantized(self, kept: dict[str, Any]) -> None:
        """The quantized q/k/v and gate/up weights that can be fused, placed (and taken out of
        `kept`)."""
        model, processor = self.model, self.processor
        for parent, names, group in _fusable_groups(kept):
            data = [_permute_rows(processor, t.name, t.data) for t in group]
            biases = [self.bias_of(f"{parent}.{n}", t) for n, t in zip(names, group, strict=True)]
            types = [t.tensor_type for t in group]
            fused = fused_group_linear(list(zip(data, types, biases, strict=True)), self.release)
            for name, t in zip(names, group, strict=True):
                del kept[f"{parent}.{name}"]
                self.reader.drop_pages(t.data)
            del data
            sizes = [int(t.shape[1]) for t in group]
            place_fused(model.get_submodule(parent), names, sizes, fused)

    def place_quantized(self, kept: dict[str, Any]) -> None:
        """The other quantized weights, each alone (a table as a `GroupEmbedding`)."""
        model, processor = self.model, self.processor
        for module_name, tensor in kept.items():
            module = model.get_submodule(module_name)
            bias = self.bias_of(module_name, tensor)
            data, qtype = _permute_rows(processor, tensor.name, tensor.data), tensor.tensor_type
            linear = group_linear_from_file(data, qtype, bias, self.release)
            del data
            self.reader.drop_pages(tensor.data)
            if isinstance(module, nn.Embedding):
                scale = getattr(module, "scalar_embed_scale", None)  # Gemma's scaled table
                scale = None if scale is None else float(scale)
                _place(model, module_name, GroupEmbedding(linear, scale))
            else:
                _place(model, module_name, linear)

    def place_dense_linears(self, dense: dict[str, Any]) -> None:
        """The F32/F16/BF16 linear weights, packed (fused where they can be)."""
        model, processor, drop_pages = self.model, self.processor, self.reader.drop_pages
        for parent, names, group in _fusable_groups(dense):
            biases = [self.bias_of(f"{parent}.{n}", t) for n, t in zip(names, group, strict=True)]
            packed = _packed_linear(processor, group, biases, drop_pages)
            for name in names:
                del dense[f"{parent}.{name}"]
            sizes = [int(t.shape[1]) for t in group]
            place_fused(model.get_submodule(parent), names, sizes, packed)
        for module_name, tensor in dense.items():
            bias = self.bias_of(module_name, tensor)
            _place(model, module_name, _packed_linear(processor, [tensor], [bias], drop_pages))


def _fusable_groups(kept: dict[str, Any]) -> list[tuple[str, tuple[str, ...], list[Any]]]:
    """(parent module, projection names, their GGUF tensors) for each group of
    `FUSED_PROJECTIONS` (q/k/v, gate/up) that converts into one `GroupLinear`: all kept, of one
    quantized type and input size, every part but the last filling whole panels; else its
    longest such prefix of two or more (q/k where llama.cpp's K-quant mixes give v more bits:
    half of a Q4_K_M file's layers, where q/k/v made three calls a step, each quantizing x)."""
    panel = kernels.panel_width()
    groups = []
    for module_name in kept:
        parent, _, child = module_name.rpartition(".")
        for names in FUSED_PROJECTIONS:
            if child != names[0]:
                continue
            tensors = [kept.get(f"{parent}.{n}") for n in names]
            for count in range(len(names), 1, -1):
                part = tensors[:count]
                if any(t is None for t in part):
                    continue
                if len({(t.tensor_type, int(t.shape[0])) for t in part}) != 1:
                    continue  # ggml lists the input size (fastest dim) first
                if any(int(t.shape[1]) % panel for t in part[:-1]):
                    continue
                groups.append((parent, names[:count], part))
                break
    return groups


def _packed_linear(
    processor: Any,
    tensors: list[Any],
    biases: list[torch.Tensor | None],
    drop_pages: Callable[[np.ndarray], None],
) -> PackedLinear:
    """A `PackedLinear` of F32/F16/BF16 GGUF weights (side by side where there are several),
    packed from the file's map, rows in the order `processor` puts them (Llama's Q/K:
    gathered a chunk at a time); each tensor's file pages are dropped as its rows are read."""
    parts, orders = [], []
    for tensor, bias in zip(tensors, biases, strict=True):
        data, order = tensor.data, _row_order(processor, tensor.name, int(tensor.shape[1]))
        if order is False:  # not a permutation: the processor's own copy
            data, order = _permute_rows(processor, tensor.name, data), None
        view = _dense_view(tensor.tensor_type.name, data)
        assert view is not None
        parts.append((view, bias))
        orders.append(order)

    def done(part: int, start: int, end: int) -> None:
        drop_pages(tensors[part].data[start:end])

    packed = PackedLinear.from_weights(parts, orders, done)
    del parts
    return packed


def _row_order(processor: Any, name: str, rows: int) -> torch.Tensor | None | Literal[False]:
    """What `processor` does to the rows of tensor `name`, found by processing a column of row
    numbers: None where nothing, the rows' new order where it permutes them (Llama's Q/K:
    packed rows are then gathered from the file a chunk at a time, instead of a permuted copy
    of the whole weight), False where it does anything else."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    got = np.asarray(processor.process(weights=index, name=name).weights)
    if got.shape != index.shape:
        return False
    got = got.reshape(rows)
    if np.array_equal(got, index[:, 0]):
        return None
    if not np.array_equal(np.sort(got), index[:, 0]):
        return False
    return torch.from_numpy(got.copy())


def _pack_tied_table(
    model: nn.Module,
    module_name: str,
    processor: Any,
    tensor: Any,
    drop_pages: Callable[[np.ndarray], None],
) -> bool:
    """For a file without `output.weight`, whose LM head is the input table: the head packed
    from the table's F32/F16/BF16 values in the file and the table made a `PackedEmbedding`
    gathering rows of it (held once, as `use_kernel_linears_` does for a checkpoint's tied
    head). False, with nothing changed, where the file has a head or `module_name` is not the
    model's input embedding."""
    head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings()  # type: ignore[operator]
    if (
        not isinstance(head, nn.Linear)
        or not head.weight.is_meta
        or head.bias is not None
        or embed is not model.get_submodule(module_name)
    ):
        return False
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml lists the fastest dim first
    if shape != tuple(head.weight.shape) or shape != tuple(embed.weight.shape):
        raise UnsupportedModelError(
            f"GGUF tensor for {module_name}.weight is {shape}, the config says "
            f"{tuple(embed.weight.shape)}"
        )
    packed = _packed_linear(processor, [tensor], [None], drop_pages)
    scale = getattr(embed, "scalar_embed_scale", None)
    model.lm_head = packed
    model.set_input_embeddings(  # type: ignore[operator]
        PackedEmbedding(embed, packed, None if scale is None else float(scale))
    )
    return True


def _groups_fit(module: nn.Module) -> bool:
    """A linear, or a table whose lookup is a plain row gather (times a constant scale: Gemma's
    `scalar_embed_scale`)."""
    if isinstance(module, nn.Linear):
        return module.weight.shape[1] % GROUP_SIZE == 0
    return gathers_rows(module)


def _set_tensor(module: nn.Module, attr: str, value: torch.Tensor, hf_name: str) -> None:
    current = getattr(module, attr)
    if tuple(current.shape) != tuple(value.shape):
        raise UnsupportedModelError(
            f"GGUF tensor for {hf_name} is {tuple(value.shape)}, the config says "
            f"{tuple(current.shape)}"
        )
    param = nn.Parameter(value, requires_grad=False)
    param._is_hf_initialized = True  # type: ignore[attr-defined]
    module._parameters[attr] = param


def _place(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _tie_head(model: nn.Module, config: PretrainedConfig) -> None:
    """A file without `output.weight` ties the LM head to the table: the same Parameter, or
    the same `GroupLinear` when the table is kept quantized."""
    head = getattr(model, "lm_head", None)
    if head is None or not isinstance(head, nn.Linear) or not head.weight.is_meta:
        return
    embed = model.get_input_embeddings()  # type: ignore[operator]
    if isinstance(embed, GroupEmbedding):
        model.lm_head = embed.table
    else:
        head.weight = embed.weight


def _materialize_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary inv_freq) were built on the meta device: allocate them and
    let transformers initialize them as from_pretrained does (every loaded weight is marked
    initialized, so only they are touched)."""
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner._buffers[attr] = torch.empty_like(buf, device="cpu")
    for module in model.modules():
        if not any(p.is_meta for p in module.parameters(recurse=False)):
            for p in module.parameters(recurse=False):
                p._is_hf_initialized = True  # type: ignore[attr-defined]
        if isinstance(module, (GroupLinear, GroupEmbedding)):
            module._is_hf_initialized = True  # type: ignore[attr-defined]
    model.initialize_weights()  # type: ignore[operator]
