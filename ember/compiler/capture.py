"""Capture: the forward closures the runner calls, and the one `torch.compile` call site.

Each closure runs the HF model (loaded and rewritten by `ember.compiler.loader`) over one step's
flattened token stream, passing the step's tensors (`attn_metadata`, `kv_caches`) as keyword
arguments that transformers hands through to every attention call. The closures are traced by
torch.compile: no `.item()`, no branching on tensor values, no config or global reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ember import kernels
from ember.compiler.flat_call import flat_call
from ember.compiler.loader import LoadedModel, embed_with_positions
from ember.compiler.regions import apply_regions

Forward = Callable[..., Any]
logger = logging.getLogger("ember")


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
    `regions`: the decoder layers compile as regions (`ember.compiler.regions`)."""
    model, task = loaded.model, loaded.spec.task
    if compile and regions:
        apply_regions(model)
    vision = text = None
    if task == "embed":
        step = capture_hidden_forward(model, task)
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
    hidden = step if task == "embed" else capture_hidden_forward(model, task)
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
    allows (`ember.compiler.flat_call`), without the bytecode that collects the weights from
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


@dataclass(frozen=True, eq=False)
class GraphJob:
    """A graph for warm-up to prepare: `forward`'s graph for the example step `args`, kept in
    the compile-cache file `path` (None: no cache)."""

    forward: CompiledForward
    args: tuple[Any, ...]
    path: str | None


# Compile workers at most, this process included (each holds a compiler's memory).
MAX_COMPILE_WORKERS = 4
# A compile worker still running this long (plus 4x what this process's own share took) after
# this process finished its share is taken to be stuck: it is stopped and its graphs compiled
# here.
WORKER_GRACE_S = 120.0


def compile_workers(jobs: list[GraphJob]) -> int:
    """How many processes compile `jobs` at once: one per graph to compile, up to the cores
    this process may run on (a compile keeps about one core busy: its Python lowering, then
    the C++ builds of its kernels), `MAX_COMPILE_WORKERS`, and `EMBER_COMPILE_WORKERS` when
    set. Frozen graphs are not saved, so they compile here, one by one; so does everything
    off Linux, and in a process that has started CUDA (which a forked child cannot use)."""
    todo = _to_compile(jobs)
    if (
        not sys.platform.startswith("linux")
        or torch.cuda.is_initialized()
        or any(j.forward.freezing for j in todo)
    ):
        return 1
    cores = len(os.sched_getaffinity(0))
    limit = MAX_COMPILE_WORKERS
    requested = os.environ.get("EMBER_COMPILE_WORKERS", "")
    if requested:
        try:
            limit = int(requested)
        except ValueError:
            raise ValueError(
                f"EMBER_COMPILE_WORKERS must be a whole number of processes, got {requested!r}"
            ) from None
    return max(1, min(len(todo), cores, limit))


def can_compile_in_background(jobs: list[GraphJob]) -> bool:
    """Whether `jobs`' graphs can compile in forked workers while this process runs steps:
    on Linux, not frozen (frozen graphs compile in this process), no CUDA started."""
    return (
        sys.platform.startswith("linux")
        and not torch.cuda.is_initialized()
        and not any(j.forward.freezing for j in jobs)
    )


def _to_compile(jobs: list[GraphJob]) -> list[GraphJob]:
    """The jobs whose graph has no cache file yet."""
    return [j for j in jobs if j.path is None or not os.path.isfile(j.path)]


def prepare_graphs(
    jobs: list[GraphJob],
    workers: int = 1,
    ready: Callable[[GraphJob], None] = lambda job: None,
) -> None:
    """Prepare every job's graph: loaded from its cache file when there is one, else compiled;
    `ready(job)` is called as each one is prepared.

    With `workers` > 1 the graphs to compile are dealt out round-robin: this process compiles
    the first share while `workers - 1` children forked from it (sharing its loaded weights
    copy-on-write) compile the others, each saving its graphs to their cache files (or
    temporary ones), which this process then loads. A worker that fails or is stuck leaves its
    graphs to be compiled here. Measured cold starts of llama-160m (2 cores, two graphs, runs
    alternated): 50.5 / 46.0 / 43.2 / 50.8 s one after the other, 35.6 / 33.3 / 34.9 / 38.4 s
    at once (a compile alone keeps ~1.3 of the 2 cores busy)."""
    todo = _to_compile(jobs)
    workers = max(1, min(workers, len(todo)))
    if workers == 1:
        for job in jobs:
            job.forward.prepare(job.args, job.path)
            ready(job)
        return
    scratch = tempfile.mkdtemp(prefix="ember-graphs-")
    forked: list[tuple[int | None, list[tuple[GraphJob, str]]]] = []
    running: set[int] = set()
    try:
        for w in range(1, workers):
            share = [
                (job, job.path or os.path.join(scratch, f"graph{w}-{i}"))
                for i, job in enumerate(todo[w::workers])
            ]
            pid = _fork_worker(share)
            if pid is not None:
                running.add(pid)
            forked.append((pid, share))
        delegated = set(todo) - set(todo[0::workers])
        start = time.monotonic()
        for job in jobs:
            if job not in delegated:
                job.forward.prepare(job.args, job.path)
                ready(job)
        deadline = time.monotonic() + WORKER_GRACE_S + 4 * (time.monotonic() - start)
        for pid, share in forked:
            code = None
            if pid is not None:
                code = _reap(pid, deadline)
                running.discard(pid)
                if code != 0:
                    logger.warning(
                        "compile worker %d %s; compiling its %d graph(s) here",
                        pid,
                        "was stuck" if code is None else f"failed (exit code {code})",
                        len(share),
                    )
            for job, target in share:
                if pid is not None:  # what a stopped worker was writing
                    with contextlib.suppress(OSError):
                        os.remove(_partial(target, pid))
                if code == 0 and os.path.isfile(target):
                    job.forward.adopt(job.args, target)
                else:
                    job.forward.prepare(job.args, job.path)
                ready(job)
    finally:
        for pid, share in forked:  # this process failed: stop the workers still running
            if pid in running:
                _reap(pid, time.monotonic())
                for _, target in share:
                    with contextlib.suppress(OSError):
                        os.remove(_partial(target, pid))
        shutil.rmtree(scratch, ignore_errors=True)


class BackgroundGraphs:
    """Graphs prepared while the engine already answers (`EngineArgs.background_compile`).

    Graphs in the compile cache are loaded at once; the others are dealt out to compile
    workers forked from this process (as `prepare_graphs` does, but this process compiles
    none: it serves steps on the eager path meanwhile, `CompiledForward.eager_fallback`).
    `poll()`, called between steps, adopts the graphs of every worker that has finished, so
    each bucket switches to its graph at a step boundary; a worker that failed leaves its
    graphs to be compiled here at that poll. `ready(job)` runs after each graph is in place
    (the runner's dummy step); `settings()` is the context the graphs are loaded in."""

    def __init__(
        self,
        jobs: list[GraphJob],
        workers: int,
        ready: Callable[[GraphJob], None],
        settings: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self.ready, self.settings = ready, settings
        todo = _to_compile(jobs)
        with settings():
            for job in jobs:
                if job not in todo:
                    job.forward.prepare(job.args, job.path)
                    ready(job)
        self.scratch = tempfile.mkdtemp(prefix="ember-graphs-")
        self.workers: list[tuple[int | None, list[tuple[GraphJob, str]]]] = []
        workers = max(1, min(workers, len(todo)))
        for w in range(workers if todo else 0):
            share = [
                (job, job.path or os.path.join(self.scratch, f"graph{w}-{i}"))
                for i, job in enumerate(todo[w::workers])
            ]
            self.workers.append((_fork_worker(share), share))
        self.forwards = {job.forward for job in todo}  # eager while any graph is missing
        for forward in self.forwards:
            forward.eager_fallback = True

    def poll(self, block: bool = False) -> bool:
        """Adopt the graphs of the workers that have finished (`block`: wait for all);
        True when every graph is in place."""
        for entry in list(self.workers):
            pid, share = entry
            code: int | None = -1
            if pid is not None:
                try:
                    done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 1 << 8
                if not done:
                    continue
                code = os.waitstatus_to_exitcode(status)
            self.workers.remove(entry)
            if code != 0:
                logger.warning("compile worker %s failed (exit code %s); compiling its %d "
                               "graph(s) here", pid, code, len(share))  # fmt: skip
            with self.settings():
                for job, target in share:
                    if code == 0 and os.path.isfile(target):
                        job.forward.adopt(job.args, target)
                    else:
                        job.forward.prepare(job.args, job.path)
                    self.ready(job)
        if not self.workers:
            for forward in self.forwards:
                forward.eager_fallback = False
            shutil.rmtree(self.scratch, ignore_errors=True)
        return not self.workers

    def stop(self) -> None:
        """Stop the workers still compiling (an engine closed before its graphs were done)."""
        for pid, share in self.workers:
            if pid is not None:
                _reap(pid, time.monotonic())
                for _, target in share:
                    with contextlib.suppress(OSError):
                        os.remove(_partial(target, pid))
        self.workers.clear()
        for forward in self.forwards:
            forward.eager_fallback = False
        shutil.rmtree(self.scratch, ignore_errors=True)


def _fork_worker(share: list[tuple[GraphJob, str]]) -> int | None:
    """Fork a compile worker that compiles `share`'s graphs, each into its file; its pid, or
    None when this process cannot fork."""
    _join_prewarm()
    threads = torch.get_num_threads()
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        with warnings.catch_warnings():  # Python >= 3.12 warns on fork with threads running
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        return None
    if pid != 0:
        return pid
    code = 1
    try:
        _die_with_parent(parent)
        # The parent's OpenMP threads do not exist here, so no parallel region may start:
        # ATen runs its loops on this one thread, while inductor, which asks
        # `torch.get_num_threads()`, still writes the kernels the parent would (same code,
        # same `#pragma omp parallel`). The parent's C++-build thread pool has no threads here
        # either: a fresh one is made on use.
        torch.set_num_threads(1)
        torch.get_num_threads = lambda: threads
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.pool.cache_clear()
        for job, target in share:
            job.forward.compile_to(job.args, target)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this compile worker when its parent exits (Linux's
    PR_SET_PDEATHSIG): a server stopped while its graphs compile in the background leaves no
    compiler running."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent exited before the request took effect
        os._exit(1)


def _partial(path: str, pid: int) -> str:
    """Where process `pid` writes the graph file `path` before moving it into place."""
    return f"{path}.{pid}.partial"


def _reap(pid: int, deadline: float) -> int | None:
    """Wait for child `pid` until `deadline` (`time.monotonic()`); its exit code, or None when
    it was still running then (it is killed)."""
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return -1
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)


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
    its range of the request's image K/V, see `ember.compiler.hf_bridge`) and the step's
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
