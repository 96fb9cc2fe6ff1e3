"""StepPlan -> ForwardBatch -> forward -> sampled ids / pooled embeddings. The only model runner.

The runner owns the KV-cache tensors (one per layer) and the captured forwards (compiled or
eager). Every step is padded to a token bucket, so compiled graphs are reused across any mix
of prefills and decodes; padding tokens write into the null block and are dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ember.attention import get_backend
from ember.attention.metadata import NULL_BLOCK
from ember.compile import cache
from ember.compile.capture import CompiledForward, Forward, build_forwards
from ember.compile.inductor import compile_settings, vec_isa_probes
from ember.compile.regions import use_regions
from ember.compile.workers import (
    BackgroundGraphs,
    GraphJob,
    can_compile_in_background,
    compile_workers,
    prepare_graphs,
)
from ember.host.dirs import private_dir
from ember.host.memory import zeroed_lazily
from ember.lora.manager import LoRAManager
from ember.model.forwards import TOKEN_TYPE_SHIFT
from ember.model.loader import LoadedModel
from ember.runtime.batch import (
    DecodeBuffers,
    ForwardBatch,
    RunnerOutput,
    ScheduledRequest,
    StepPlan,
    build_forward_batch,
    encoder_plan,
    vision_plan,
    warmup_plan,
)
from ember.runtime.buckets import graph_sizes, padded_num_seqs, padded_num_tokens
from ember.runtime.config import EngineConfig
from ember.runtime.logits import apply_controls
from ember.runtime.multimodal import ImageInputs, VisionGeometry
from ember.runtime.pooling import ClassifierHead, PoolingConfig, pool
from ember.runtime.sampler import non_finite_rows, prompt_logprobs, row_maxima, sample, verify
from ember.runtime.structured import apply_bitmask, fill_bitmasks


def _profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A profiler range called `name` while a profiler records (as Dynamo marks its own
    ranges), else nothing: `torch.profiler.record_function` costs ~5 us a call even with no
    profiler on, against 0.3 us for this check."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch._C._profiler._RecordFunctionFast(name)
    return contextlib.nullcontext()


class ModelRunner:
    """Runs one step of the model over the paged KV cache, then samples or pools."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        num_blocks: int,
        pooling: PoolingConfig,
        lora: LoRAManager | None = None,
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.pooling = pooling
        self.classifier = ClassifierHead(loaded.model) if config.task == "classify" else None
        self.lora = lora
        self.backend = get_backend(config.attention_backend)
        # One tensor per layer, each with that layer's K/V heads and head_dim.
        self.kv_caches = [
            zeroed_lazily(
                self.backend.kv_cache_shape(
                    num_blocks, config.block_size, heads, head_dim, config.kv_dtype
                ),
                config.kv_dtype,
            )
            for heads, head_dim in loaded.kv_layer_shapes
        ]
        self.buckets = config.token_buckets
        self.decode_buffers = DecodeBuffers()
        self.background: BackgroundGraphs | None = None  # graphs compiling (background_compile)
        # Decoder layers compiled as regions (`ember.compile.regions`)?
        self.regions = config.compile and use_regions(
            loaded.model,
            config.regional_compile,
            loaded.spec.task == "generate"
            and loaded.spec.multimodal is None
            and not config.freeze_weights
            and self.backend.load_opaque_op(config.cpu_isa) is not None,
        )
        self.forwards = build_forwards(
            loaded,
            self.kv_caches,
            config.compile,
            self.buckets,
            config.freeze_weights,
            token_hint=config.max_num_batched_tokens,
            regions=self.regions,
        )
        # An encoder-decoder step carries each request's cross context; a vision-language
        # step each request's image K/V and each token's range of them.
        self.max_cross_blocks = 0
        self.cross_ranges = loaded.spec.multimodal is not None
        if config.task == "encdec":
            max_source = loaded.spec.max_positions
            self.max_cross_blocks = -(-max_source // config.block_size)
        self.vision_geometry: VisionGeometry | None = None
        if self.cross_ranges:
            self.vision_geometry = VisionGeometry.of(loaded.spec.hf_config)
            max_images = config.limit_mm_per_prompt.get("image", 0)
            tokens = max(max_images, 1) * self.vision_geometry.tokens_per_image
            self.max_cross_blocks = -(-tokens // config.block_size)

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """One example token count per compiled graph (static buckets, then the dynamic one)."""
        return graph_sizes(self.buckets, self.config.max_num_batched_tokens)

    @property
    def graphs_compiled(self) -> int:
        """Graphs compiled in this process (at warm-up on a cache miss; any later one is a
        shape the warm-up missed)."""
        return sum(f.num_compiled for _, f in self.forwards.compiled())

    @property
    def graphs_loaded(self) -> int:
        """Graphs loaded from the compile cache."""
        return sum(f.num_loaded for _, f in self.forwards.compiled())

    def close(self) -> None:
        """Release the KV cache, the forwards (and their compiled graphs) and the model."""
        if self.background is not None:
            self.background.stop()
            self.background = None
        self.kv_caches = []
        self.backend.release()
        self.forwards = None  # type: ignore[assignment]
        self.model = self.loaded = None  # type: ignore[assignment]
        gc.collect()

    def wait_for_graphs(self) -> None:
        """Block until every graph compiling in the background is in place."""
        if self.background is not None:
            self.background.poll(block=True)
            self.background = None

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run `plan`: the encoder pass of requests admitted this step (encoder-decoder models),
        the embeddings (pooled), then the generating requests (sampled). Graphs compiled in
        the background since the last step are switched in first."""
        if self.background is not None and self.background.poll():
            self.background = None
        if self.forwards.encoder is not None:
            encoder = encoder_plan(plan)
            if encoder.requests:
                self._forward(encoder, self.forwards.encoder, self.max_cross_blocks, cross=False)
        if self.forwards.vision is not None:
            for r in vision_plan(plan):
                self._encode_images(r)
        pooled = self._pool(plan)
        generate = plan.select(pool=False)
        if not generate.requests:
            return RunnerOutput({}, {}, pooled)
        step = self.forwards.step
        if self.forwards.text is not None and all(r.images is None for r in generate.requests):
            step = self.forwards.text  # no token attends an image: cross layers skipped
        batch = self._batch(generate, step, self.config.max_blocks_per_seq)
        logits = self._run(batch, step)
        prompt_lps = {}
        if batch.prompt_rows:
            prompt_lps = prompt_logprobs(logits, generate.requests, batch.prompt_rows)
        rows = [i for i, r in enumerate(generate.requests) if r.sample]
        if not rows:
            return RunnerOutput({}, {}, pooled, prompt_logprobs=prompt_lps)
        spans: list[tuple[int, tuple[int, ...]]] = []  # per sampling request: first row, drafts
        if batch.spec_rows:
            sampling, logits, spans = _spec_rows(logits, generate.requests, rows, batch)
        else:
            # A view when every request samples (the usual case): a 262k-id vocabulary makes a
            # 32-row copy of the logits cost milliseconds.
            logits = logits[: len(rows)] if rows[-1] == len(rows) - 1 else logits[rows]
            sampling = [generate.requests[i] for i in rows]
        logits = logits.float()
        # Logprobs are of the model's own distribution: taken before the controls below, which
        # change the rows that have any in place.
        logp = {
            i: torch.log_softmax(logits[i], dim=-1)
            for i, r in enumerate(sampling)
            if r.params.logprobs is not None and (r.controls is not None or r.grammar is not None)
        }
        errors, argmax = _controlled(logits, sampling, spans)
        if spans:
            return _verified(logits, sampling, spans, logp, argmax, errors, pooled, prompt_lps)
        by_id = {sampling[i].request_id: v for i, v in logp.items()}
        if errors:
            good = [i for i, r in enumerate(sampling) if r.request_id not in errors]
            sampling, logits, argmax = [sampling[i] for i in good], logits[good], argmax[good]
        tokens, logprobs = sample(logits, sampling, by_id, argmax) if sampling else ([], {})
        sampled = {r.request_id: t for r, t in zip(sampling, tokens, strict=True)}
        return RunnerOutput(sampled, logprobs, pooled, errors, prompt_lps)

    def _pool(self, plan: StepPlan) -> dict[str, list[float]]:
        """The pooled embedding (a classifier's logits) of each of `plan`'s pooled requests,
        by request id."""
        embeds = plan.select(pool=True)
        if not embeds.requests:
            return {}
        # Embedding models and classifiers run their compiled graphs; a causal LM's base model
        # runs eagerly (its compiled graphs produce logits).
        hidden = self._forward(embeds, self.forwards.hidden, self.config.max_blocks_per_seq)
        lens = [r.num_new_tokens for r in embeds.requests]
        if self.classifier is not None:
            out, start = {}, 0
            mask = (1 << TOKEN_TYPE_SHIFT) - 1
            for r, n in zip(embeds.requests, lens, strict=True):
                ids = [t & mask for t in r.token_ids]
                types = [t >> TOKEN_TYPE_SHIFT for t in r.token_ids]
                head = self.classifier(hidden[start : start + n], ids, types)
                out[r.request_id] = head.tolist()
                start += n
            return out
        vectors = pool(hidden[: sum(lens)], lens, self.pooling)
        return {r.request_id: v.tolist() for r, v in zip(embeds.requests, vectors, strict=True)}

    def _encode_images(self, request: ScheduledRequest) -> None:
        """Run the vision tower over each of `request`'s images (one graph call per image),
        writing their cross-attention K/V into the request's cross blocks."""
        images = request.images
        assert images is not None and self.forwards.vision is not None
        for i in range(images.num_images):
            slots = images.slots(i, request.cross_block_ids, self.config.block_size)
            with _profiled("ember::vision"):
                self.forwards.vision(*self._vision_args(images, i, slots))

    def _vision_args(self, images: ImageInputs, i: int, slots: torch.Tensor) -> tuple:
        return (
            images.pixel_values[i : i + 1][None].to(self.config.dtype),
            images.aspect_ratio_ids[i : i + 1][None],
            images.aspect_ratio_mask[i : i + 1][None],
            slots,
            self.kv_caches,
        )

    def _forward(
        self, plan: StepPlan, forward: Forward, max_blocks: int, cross: bool = True
    ) -> torch.Tensor:
        """Build the plan's batch (padded to its bucket when `forward` is compiled) and run it.
        `cross`: pass each request's cross-attention context (decoder steps)."""
        return self._run(self._batch(plan, forward, max_blocks, cross), forward)

    def _batch(
        self, plan: StepPlan, forward: Forward, max_blocks: int, cross: bool = True
    ) -> ForwardBatch:
        num_tokens = plan.num_tokens
        if isinstance(forward, CompiledForward):
            num_tokens = padded_num_tokens(num_tokens, self.buckets)
        slot_of = None
        if self.lora is not None:
            ids = {r.lora_id for r in plan.requests if r.lora_id is not None}
            slot_of = self.lora.activate(ids)
        return build_forward_batch(
            plan,
            self.config.block_size,
            max_blocks,
            num_tokens,
            padded_num_seqs(plan.num_seqs),
            self.max_cross_blocks if cross else 0,
            slot_of,
            cross_ranges=cross and self.cross_ranges,
            buffers=self.decode_buffers,
        )

    def _run(self, batch: ForwardBatch, forward: Forward) -> torch.Tensor:
        if self.lora is not None:
            self.lora.set_token_slots(batch.lora_slots)
        # A profiler range (`ember bench` splits a step into graph and host time with it).
        with _profiled("ember::forward"):
            return forward(*self._args(batch))

    def _args(self, batch: ForwardBatch) -> tuple[torch.Tensor | object, ...]:
        return (
            batch.input_ids,
            batch.positions,
            batch.logits_indices,
            batch.attn_metadata,
            self.kv_caches,
        )

    # ---- warm-up -----------------------------------------------------------------------------
    def _warmup_image(self) -> tuple[ImageInputs, int, torch.Tensor]:
        """A blank one-tile image whose K/V go to the null block (real requests never read
        it)."""
        g = self.vision_geometry
        assert g is not None
        config = self.loaded.spec.hf_config.vision_config
        size = config.image_size
        mask = torch.zeros(1, g.tiles, dtype=torch.long)
        mask[0, 0] = 1
        empty = np.zeros(1, dtype=np.int32)
        images = ImageInputs(
            pixel_values=torch.zeros(1, g.tiles, config.num_channels, size, size),
            aspect_ratio_ids=torch.ones(1, dtype=torch.long),
            aspect_ratio_mask=mask,
            num_tiles=(1,),
            geometry=g,
            starts=empty,
            ends=empty,
            attends=empty.astype(bool),
            digest=b"",
        )
        slots = NULL_BLOCK * self.config.block_size + (
            torch.arange(g.tokens_per_image) % self.config.block_size
        )
        return images, 0, slots

    @torch.inference_mode()
    def warmup(self, show_progress: bool = True, background: bool = False) -> bool:
        """Compile (or load) every graph now, so no request ever waits on a compile.

        With `compile_cache_dir`, saved graphs are loaded (nothing is traced or compiled then),
        and fresh ones are saved after compiling. Each graph then runs one dummy step, entirely
        in the null block, which real requests never read. Returns True on a cache hit.

        `background`: graphs not in the cache compile in forked workers instead while steps
        run eagerly (`BackgroundGraphs`); `execute` switches each in between steps, and
        `wait_for_graphs` blocks until all are in place.
        """
        compiled = self.forwards.compiled()
        if not compiled:
            return False
        # Frozen graphs hold the weights as constants (prepacked): they are not cached.
        cache_dir = None if self.config.freeze_weights else self.config.compile_cache_dir
        if cache_dir is not None:  # loads pickled graphs and built kernels: ours only
            cache_dir = private_dir(cache_dir, "compile cache")
        parts = cache.key_parts(
            self.loaded,
            self.buckets,
            self.config.block_size,
            self.config.freeze_weights,
            len(self.graph_sizes) > len(self.buckets),
            self.config.kv_dtype,
            self.regions,
        )
        record = cache.lookup(cache_dir, parts) if cache_dir is not None else None
        hit = record is not None
        inductor_dir = cache.inductor_dir(cache_dir, parts) if cache_dir is not None else None
        runs = self._warmup_runs(compiled, cache_dir, parts)
        if background and can_compile_in_background(list(runs)):
            self._compile_in_background(runs, inductor_dir, record, cache_dir, parts)
            return hit
        with (
            compile_settings(self.config.freeze_weights, inductor_dir),
            vec_isa_probes(cache.recorded_probes(record)) as probed,
        ):
            with tqdm(
                total=len(runs),
                desc="Loading graphs" if hit else "Compiling graphs",
                unit="graph",
                disable=not show_progress,
                dynamic_ncols=True,
            ) as bar:

                def ready(job: GraphJob) -> None:
                    runs[job]()
                    bar.update()

                jobs = list(runs)
                prepare_graphs(jobs, compile_workers(jobs), ready)
        if cache_dir is not None and not hit:
            cache.mark_complete(cache_dir, parts, probed)
        return hit

    def _warmup_runs(
        self, compiled: list[tuple[str, Any]], cache_dir: str | None, parts: dict[str, Any]
    ) -> dict[GraphJob, Any]:
        """Each graph's job (its forward, example args and cache file) and its dummy step,
        which runs the graph once."""
        bs = self.config.block_size
        runs: dict[GraphJob, Any] = {}
        for num_tokens in self.graph_sizes:
            for name, forward in compiled:
                if name == "vision":
                    if num_tokens != self.graph_sizes[0]:
                        continue  # one graph (one image), compiled once
                    key = "static"
                    args = self._vision_args(*self._warmup_image())
                    run = functools.partial(forward, *args)
                else:
                    if name == "encoder":  # encoder inputs within the encoder's positions
                        plan = warmup_plan(num_tokens, self.loaded.spec.max_positions, bs)
                        batch = self._batch(plan, forward, self.max_cross_blocks, cross=False)
                    else:
                        chunk = self.config.max_blocks_per_seq * bs
                        plan = warmup_plan(num_tokens, chunk, bs, cross=self.max_cross_blocks > 0)
                        batch = self._batch(plan, forward, self.config.max_blocks_per_seq)
                    key = forward.key(batch.input_ids.shape[0])
                    args = self._args(batch)
                    run = functools.partial(self._run, batch, forward)
                path = None
                if cache_dir is not None:
                    path = cache.graph_file(cache_dir, parts, f"{name}-{key}")
                runs[GraphJob(forward, args, path)] = run
        return runs

    def _compile_in_background(
        self,
        runs: dict[GraphJob, Any],
        inductor_dir: str | None,
        record: dict[str, Any] | None,
        cache_dir: str | None,
        parts: dict[str, Any],
    ) -> None:
        """Compile `runs`' graphs in forked workers while steps run eagerly
        (`BackgroundGraphs`); the cache entry is marked complete once all are in."""
        hit = record is not None
        probes: list[str] = []

        @contextlib.contextmanager
        def settings() -> Any:
            with (
                compile_settings(self.config.freeze_weights, inductor_dir),
                vec_isa_probes(cache.recorded_probes(record)) as probed,
            ):
                yield
            probes.extend(probed)

        def ready_and_record(job: GraphJob) -> None:
            runs[job]()
            runs.pop(job)
            if not runs and cache_dir is not None and not hit:
                cache.mark_complete(cache_dir, parts, probes)

        jobs = list(runs)
        self.background = BackgroundGraphs(jobs, compile_workers(jobs), ready_and_record, settings)


def _controlled(
    logits: torch.Tensor,
    sampling: list[ScheduledRequest],
    spans: list[tuple[int, tuple[int, ...]]],
) -> tuple[dict[str, str], torch.Tensor]:
    """Apply each row's logits controls and grammar in place; returns (the error of each
    request that cannot sample, by id; each row's argmax). A request whose logits row is
    NaN/inf (or whose own logits processor failed) fails alone; the others sample as usual."""
    failed = apply_controls(
        logits,
        [r.controls for r in sampling],
        [r.prompt_token_ids for r in sampling],
        [r.output_token_ids for r in sampling],
    )
    _apply_grammars(logits, sampling, spans, failed)
    bad = dict(failed)
    maxima, argmax = row_maxima(logits)
    for i in set(non_finite_rows(logits, maxima)) - failed.keys():
        r = sampling[i]
        bad[i] = (
            f"the model's logits for request {r.request_id!r} contain NaN or inf at output "
            f"token {len(r.output_token_ids)} (adapter: {r.lora_id}; after the request's "
            "logits controls, if any); no token was sampled"
        )
    return {sampling[i].request_id: error for i, error in sorted(bad.items())}, argmax


def _spec_rows(
    logits: torch.Tensor,
    requests: tuple[ScheduledRequest, ...],
    rows: list[int],
    batch: ForwardBatch,
) -> tuple[list[ScheduledRequest], torch.Tensor, list[tuple[int, tuple[int, ...]]]]:
    """The logits rows of a step that verifies draft tokens, in sampling order: for each
    sampling request, the rows predicting its drafts, then its own row. Returns (each row's
    request, as it would be at that row: its drafts before the row appended to its output;
    the rows; per request, its first row and drafts)."""
    num_prompt_rows = sum(count for _, _, count in batch.prompt_rows)
    spec_start = batch.logits_indices.shape[0] - num_prompt_rows
    spec_start -= sum(k for _, k in batch.spec_rows)
    first_spec_row = {}
    for i, k in batch.spec_rows:
        first_spec_row[i] = spec_start
        spec_start += k
    order: list[int] = []
    row_requests: list[ScheduledRequest] = []
    spans: list[tuple[int, tuple[int, ...]]] = []
    for i in rows:
        r = requests[i]
        drafts = r.spec_token_ids
        spans.append((len(order), drafts))
        if drafts:
            order.extend(range(first_spec_row[i], first_spec_row[i] + len(drafts)))
            output = list(r.output_token_ids)
            row_requests.extend(
                dataclasses.replace(r, output_token_ids=output + list(drafts[:j]))
                for j in range(len(drafts) + 1)
            )
        else:
            row_requests.append(r)
        order.append(i)
    return row_requests, logits[order], spans


def _apply_grammars(
    logits: torch.Tensor,
    rows: list[ScheduledRequest],
    spans: list[tuple[int, tuple[int, ...]]],
    failed: dict[int, str],
) -> None:
    """Structured outputs: mask in place what each row's grammar disallows next. A request
    verifying drafts gets, at each of its rows, the mask of its grammar advanced over the
    drafts before that row (rows past a draft the grammar refuses are left unmasked: that
    draft is masked at the row before, so no later row is used), then the grammar goes back."""
    spec_first = {first: drafts for first, drafts in spans if drafts}
    spec_rows = {f + j for f, d in spec_first.items() for j in range(len(d) + 1)}
    plain = [
        i
        for i, r in enumerate(rows)
        if r.grammar is not None and r.grammar.active and i not in failed and i not in spec_rows
    ]
    if plain:
        masks = fill_bitmasks([rows[i].grammar for i in plain])  # type: ignore[misc]
        if plain == list(range(len(plain))):
            apply_bitmask(logits[: len(plain)], masks)
        else:
            for j, i in enumerate(plain):
                apply_bitmask(logits[i : i + 1], masks[j : j + 1])
    for first, drafts in spec_first.items():
        grammar = rows[first].grammar
        if grammar is None or any(first + j in failed for j in range(len(drafts) + 1)):
            continue
        for j, mask in enumerate(grammar.masks_along(drafts)):
            if mask is not None:
                apply_bitmask(logits[first + j : first + j + 1], mask)


def _verified(
    logits: torch.Tensor,
    rows: list[ScheduledRequest],
    spans: list[tuple[int, tuple[int, ...]]],
    logp: dict[int, torch.Tensor],
    argmax: torch.Tensor,
    errors: dict[str, str],
    pooled: dict[str, list[float]],
    prompt_lps: dict,
) -> RunnerOutput:
    """The output of a step that verified draft tokens (`sampler.verify`)."""
    good = [(f, d) for f, d in spans if rows[f].request_id not in errors]
    tokens, logprobs = verify(logits, rows, good, logp, argmax) if good else ([], [])
    sampled, accepted, spec_logprobs = {}, {}, {}
    for (first, drafts), emitted, lps in zip(good, tokens, logprobs, strict=True):
        rid = rows[first].request_id
        sampled[rid] = emitted[-1]
        if drafts:
            accepted[rid] = tuple(emitted[:-1])
        if lps is not None:
            spec_logprobs[rid] = lps
    return RunnerOutput(
        sampled, {}, pooled, errors, prompt_lps, accepted=accepted, spec_logprobs=spec_logprobs
    )
