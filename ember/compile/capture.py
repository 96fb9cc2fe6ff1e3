"""Capture: the forward closures the runner calls, and the one `torch.compile` call site.

Each closure runs the HF model (loaded and rewritten by `ember.model.loader`) over one step's
flattened token stream, passing the step's tensors (`attn_metadata`, `kv_caches`) as keyword
arguments that transformers hands through to every attention call. The closures are traced by
torch.compile: no `.item()`, no branching on tensor values, no config or global reads.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ember import kernels
from ember.compile.flat_call import flat_call
from ember.compile.regions import apply_regions
from ember.model.forwards import (
    capture_cross_attention_lm_forward,
    capture_encoder_forward,
    capture_forward,
    capture_hidden_forward,
    capture_vision_forward,
)
from ember.model.loader import LoadedModel
from ember.model.spec import POOLED_TASKS

logger = logging.getLogger("ember")

Forward = Callable[..., Any]


@dataclass(frozen=True)
class Forwards:
    """What the runner runs, compiled or eager; all take `(input_ids, positions,
    logits_indices, attn_metadata, kv_caches)`.

    `step`: logits [num_seqs, vocab] at `logits_indices` for an LM; hidden states
    [num_tokens, hidden] for an embedding model. `hidden`: hidden states [num_tokens, hidden]
    for pooling (an embedding model's `step`; a causal LM's base model, eager, since its graphs
    produce logits). `encoder`: the encoder pass of an encoder-decoder model, else None.
    `vision`: the vision pass of a vision-language model, one image per call
    (`capture_vision_forward`), else None; `text`: its step for steps where no token attends
    an image (cross-attention layers skipped, as HF skips them without images), else None.
    Compiled forwards are `CompiledForward`s.
    """

    step: Forward
    hidden: Forward
    encoder: Forward | None = None
    vision: Forward | None = None
    text: Forward | None = None

    def compiled(self) -> list[tuple[str, CompiledForward]]:
        """The compiled forwards by name (the name keys their graphs in the compile cache)."""
        named = [
            ("step", self.step),
            ("encoder", self.encoder),
            ("vision", self.vision),
            ("text", self.text),
        ]
        return [(name, f) for name, f in named if isinstance(f, CompiledForward)]


def build_forwards(
    loaded: LoadedModel,
    kv_caches: list[torch.Tensor],
    compile: bool,
    buckets: tuple[int, ...],
    freezing: bool = False,
    token_hint: int | None = None,
    regions: bool = False,
) -> Forwards:
    """Capture `loaded`'s forwards; with `compile`, as `CompiledForward`s over the static token
    `buckets` (plus one dynamic-token graph, compiled for steps of about `token_hint` tokens).
    The KV caches' block count is a dynamic dim, so graphs do not depend on the cache size.
    `regions`: the decoder layers compile as regions (`ember.compile.regions`)."""
    model, task = loaded.model, loaded.spec.task
    if compile and regions:
        apply_regions(model)
    vision = text = None
    if task in POOLED_TASKS:
        step = capture_hidden_forward(model, task, loaded.spec.position_offset)
    elif loaded.spec.multimodal is not None:
        step = capture_cross_attention_lm_forward(model)
        text = capture_cross_attention_lm_forward(model, images=False)
        vision = capture_vision_forward(model)
    else:
        step = capture_forward(model, task)
    encoder = capture_encoder_forward(model) if task == "encdec" else None
    if compile:
        for kv in kv_caches:
            torch._dynamo.mark_dynamic(kv, 1)
        step = CompiledForward(step, buckets, freezing, token_hint=token_hint)
        if encoder is not None:
            encoder = CompiledForward(encoder, buckets, freezing, token_hint=token_hint)
        vision = CompiledForward(vision, (), freezing, static=True) if vision else None
        if text is not None:
            text = CompiledForward(text, buckets, freezing, token_hint=token_hint)
    hidden = step if task in POOLED_TASKS else capture_hidden_forward(model, task)
    return Forwards(step, hidden, encoder, vision, text)


def _no_guards(entries: list[Any]) -> list[bool]:
    return [False] * len(entries)


class CompiledForward:
    """One forward's compiled graphs: one per static token bucket and one whose token count is
    dynamic (see `ember.runtime.buckets`), each compiled ahead of time by the one `torch.compile`
    call site (`aot_compile`, fullgraph: no graph breaks allowed) and called directly.

    The runner pads every step to the graph it runs, so no Dynamo guard decides which graph
    serves a call: graphs are compiled with no guards and called without a guard check or a
    Dynamo cache lookup (measured on llama-160m batch-1 decode, bf16: 6.35 vs 6.60 ms per
    forward in one process against `torch.compile`'s own dispatch), and, where its bytecode
    allows (`ember.compile.flat_call`), without the bytecode that collects the weights from
    the module tree on every call (llama-160m Q4_0 decode: 1.95 -> 1.79 ms). Inputs keep
    their marked dynamic dims (`num_seqs`, the block-table width, the cache's block count,
    and the token count of the dynamic graph), so Dynamo fails the compile rather than
    specialise one.
    A compiled graph is saved to and loaded from the compile cache as one file (Dynamo's
    bytecode and the inductor graph together), so a warm start traces nothing. The objects the
    forward closes over (the model) are external data: the loaded graph reads the live
    engine's weights, KV caches and LoRA slots.
    """

    def __init__(
        self,
        forward: Forward,
        buckets: tuple[int, ...],
        freezing: bool = False,
        static: bool = False,
        token_hint: int | None = None,
    ) -> None:
        self.forward = forward
        self.buckets = buckets
        self.freezing = freezing
        self.token_hint = token_hint
        # One graph of fixed input shapes (the vision pass: one image), not a step.
        self.static = static
        self.graphs: dict[str, Any] = {}
        self.num_compiled = 0  # graphs compiled in this process (cache misses, late shapes)
        self.num_loaded = 0  # graphs loaded from the compile cache
        self._dynamo: Forward | None = None
        # While graphs compile in the background (`BackgroundGraphs`), a step whose graph is
        # not ready yet runs the forward eagerly instead of compiling it here.
        self.eager_fallback = False

    def key(self, num_tokens: int) -> str:
        """The graph serving a step of `num_tokens` (already padded to its bucket)."""
        if self.static:
            return "static"
        return f"tokens{num_tokens}" if num_tokens <= self.buckets[-1] else "dynamic"

    def __call__(self, *args: Any) -> Any:
        graph = self.graphs.get(self.key(args[0].shape[0]))
        if graph is None:
            if self.eager_fallback:
                return self.forward(*args)
            graph = self.prepare(args)
        return graph(*args)

    def _external(self) -> dict[str, Any]:
        cells = self.forward.__closure__ or ()
        return {f"cell{i}": cell.cell_contents for i, cell in enumerate(cells)}

    def prepare(self, args: tuple[Any, ...], cache_file: str | None = None) -> Any:
        """The graph for `args` (a step padded to its bucket): loaded from `cache_file` when it
        exists, else compiled for these example inputs (and saved there)."""
        key = self.key(args[0].shape[0])
        if self.freezing:
            return self._prepare_frozen(key, args)
        if cache_file is not None and os.path.isfile(cache_file):
            self.num_loaded += 1
            return self._keep(key, self._load(cache_file))
        graph = self._compile(key, args)
        self.num_compiled += 1
        if cache_file is not None:
            self._save(graph, cache_file)
        return self._keep(key, graph)

    def adopt(self, args: tuple[Any, ...], graph_file: str) -> Any:
        """The graph for `args` that a compile worker forked from this process compiled for
        this process into `graph_file` (see `prepare_graphs`): loaded, and counted as
        compiled here."""
        graph = self._load(graph_file)
        self.num_compiled += 1
        return self._keep(self.key(args[0].shape[0]), graph)

    def compile_to(self, args: tuple[Any, ...], graph_file: str) -> None:
        """Compile the graph for `args` and save it to `graph_file`, keeping nothing (what a
        compile worker does)."""
        self._save(self._compile(self.key(args[0].shape[0]), args), graph_file)

    def _compile(self, key: str, args: tuple[Any, ...]) -> Any:
        kernels.install_fast_calls()
        if not self.static:
            _mark_step_dynamic(args, key == "dynamic", self.token_hint)
        compiler = torch.compile(
            self.forward, fullgraph=True, options={"guard_filter_fn": _no_guards}
        )
        return compiler.aot_compile((args, {}))

    def _save(self, graph: Any, path: str) -> None:
        """Write `graph` to `path` whole or not at all (a reader never sees part of a file)."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        partial = _partial(path, os.getpid())
        try:
            graph.save_compiled_function(partial, external_data=self._external())
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)

    def _load(self, path: str) -> Any:
        kernels.install_fast_calls()
        with open(path, "rb") as f:
            return torch.compiler.load_compiled_function(f, external_data=self._external())

    def _keep(self, key: str, graph: Any) -> Any:
        graph.disable_guard_check()
        self.graphs[key] = flat_call(graph) or graph
        return self.graphs[key]

    def _prepare_frozen(self, key: str, args: tuple[Any, ...]) -> Any:
        """Frozen graphs (weights folded and prepacked as constants) do not go through
        `aot_compile` in torch 2.13 (its serializable wrapper rejects them): they are compiled
        and dispatched by `torch.compile` itself, guards on the inputs included, never cached.
        Each capture gets its own code object, so two engines in one process never share
        graphs (Dynamo caches graphs per code object)."""
        kernels.install_fast_calls()
        if self._dynamo is None:
            fresh = types.FunctionType(
                self.forward.__code__.replace(),
                self.forward.__globals__,
                self.forward.__name__,
                self.forward.__defaults__,
                self.forward.__closure__,
            )
            self._dynamo = torch.compile(fresh, fullgraph=True)
        if not self.static:
            _mark_step_dynamic(args, key == "dynamic", self.token_hint)
        self._dynamo(*args)
        self.num_compiled += 1
        self.graphs[key] = self._dynamo
        return self._dynamo


_prewarm: threading.Thread | None = None


def prewarm_graph_imports() -> None:
    """Import what every compiled graph's code imports (inductor's runtime: its wrapper code
    starts with `from torch._inductor.select_algorithm import extern_kernels`) on a thread,
    once per process, so that the import overlaps the weights' loading, whose copies run
    without the GIL. A warm start of a Llama-3.2-1B shape (bf16, 2 cores): 6.82 / 6.53 s ->
    5.25 / 4.98 s, the import ~1.7-2.0 s of it. Whoever imports the module meanwhile waits for
    the thread under Python's own module lock."""
    global _prewarm
    if _prewarm is not None or "torch._inductor.select_algorithm" in sys.modules:
        return

    def run() -> None:
        try:
            importlib.import_module("torch._inductor.select_algorithm")
        except Exception:  # noqa: BLE001  (the graph load imports it again and reports)
            logger.debug("prewarming inductor's imports failed", exc_info=True)

    _prewarm = threading.Thread(target=run, name="ember-prewarm-imports", daemon=True)
    _prewarm.start()


def _join_prewarm() -> None:
    """Wait for `prewarm_graph_imports`' thread: a process forked while it imports would hold
    the module locks of a thread it does not have (a compile worker hung on its first import
    of inductor, and the engine compiled every graph itself)."""
    if _prewarm is not None:
        _prewarm.join()


def _partial(path: str, pid: int) -> str:
    """Where process `pid` writes the graph file `path` before moving it into place."""
    return f"{path}.{pid}.partial"


def _mark_step_dynamic(
    args: tuple[Any, ...], dynamic_tokens: bool, token_hint: int | None = None
) -> None:
    """Mark a step's inputs dynamic before compiling: per-sequence tensors in dim 0
    (num_seqs), block tables in both dims (num_seqs, width), per-token tensors in dim 0 when
    the graph's token count is dynamic.

    The token count's size hint is `token_hint` rather than the example step's (2 tokens):
    inductor decides from the hint which loops of its kernels run on all threads, and from 2
    tokens it made the norms and residual adds of narrow models serial (a MiniLM embedding
    step of 2,000 tokens ran its LayerNorms on one core)."""
    input_ids, positions, logits_indices, meta, _ = args
    per_seq = [meta.query_start_loc, meta.seq_lens, logits_indices, meta.cross_seq_lens]
    for t in per_seq:
        if t is not None:
            torch._dynamo.mark_dynamic(t, 0)
    for t in (meta.block_tables, meta.cross_block_tables):
        if t is not None:
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
    if dynamic_tokens:
        per_token = (input_ids, positions, meta.slot_mapping, meta.cross_token_ranges)
        for t in (*per_token, meta.cross_row_mask):
            if t is not None:
                torch._dynamo.mark_dynamic(t, 0, hint_override=token_hint)
