"""LLMEngine: add_request / step / abort_request. The only outer loop.

One step: `plan = scheduler.schedule()`, `result = runner.execute(plan)`,
`scheduler.update(plan, result)` (which appends, detokenizes and finishes requests), then the
outputs of the requests that changed are built from their state.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from ember.attention import get_backend
from ember.compile.capture import prewarm_graph_imports
from ember.host.memory import collapse_to_huge_pages
from ember.lora.adapter import LoRARequest
from ember.lora.manager import LoRAManager
from ember.model.forwards import with_token_types
from ember.model.loader import LoadedModel, LoRAShape, load_model
from ember.model.spec import POOLED_TASKS
from ember.runtime.block_manager import BlockManager
from ember.runtime.config import EngineConfig, KVCacheSpec
from ember.runtime.draft import DraftProposer, draft_engine_args
from ember.runtime.input_processor import InputProcessor, PromptType
from ember.runtime.model_runner import ModelRunner
from ember.runtime.output_processor import OutputProcessor, ParentRequest, child_id
from ember.runtime.outputs import (
    EmbeddingRequestOutput,
    IncrementalDetokenizer,
    RequestOutput,
)
from ember.runtime.pooling import load_pooling_config
from ember.runtime.prefix_store import open_prefix_store
from ember.runtime.request import Request, RequestStatus, SamplingParams
from ember.runtime.scheduler import Scheduler
from ember.runtime.speculative import NgramProposer, Proposer, SpecState, SpeculativeConfig

logger = logging.getLogger("ember")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_thread(
    method: Callable[Concatenate[LLMEngine, _P], _R],
) -> Callable[Concatenate[LLMEngine, _P], _R]:
    """Raise RuntimeError when a second thread enters the engine while one is inside (the
    same thread may nest: `embed` steps the engine)."""

    @functools.wraps(method)
    def guarded(self: LLMEngine, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not self._entered.acquire(blocking=False):
            raise RuntimeError(
                f"LLMEngine.{method.__name__} was called from a second thread while another "
                "thread is using this engine; LLMEngine is not thread-safe (LLM serialises "
                "calls from several threads)"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            self._entered.release()

    return guarded


class LLMEngine:
    """Continuous-batching engine over one model. Not thread-safe: a call from a second
    thread while another is inside raises RuntimeError (never silent mixing)."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        num_blocks: int,
        draft: LLMEngine | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.spec.hf_config
        model = loaded.model
        embed = model.get_input_embeddings()  # type: ignore[operator]
        # Prompt ids index the input embeddings; sampled ids the logits, which can be narrower
        # (Mllama's embeddings have 8 rows past its vocabulary: its <|image|> token among them).
        self.num_input_ids = int(getattr(embed, "num_embeddings", None) or embed.weight.shape[0])  # type: ignore[index]
        self.vocab_size = min(
            self.num_input_ids,
            getattr(loaded.spec.text_config, "vocab_size", None) or self.num_input_ids,
        )
        self.eos_token_id, self.other_eos_ids = _eos_ids(model, self.tokenizer)
        # Every id that ends a request as EOS (masked by min_tokens, allowed at a grammar's end).
        self._all_eos_ids = sorted(
            self.other_eos_ids | ({self.eos_token_id} if self.eos_token_id is not None else set())
        )
        self.default_sampling = _sampling_defaults(model, config.generation_config)
        self.lora: LoRAManager | None = None
        if loaded.lora is not None:
            assert loaded.lora_layers is not None and loaded.lora_token_slots is not None
            self.lora = LoRAManager(
                loaded.lora_layers,
                loaded.lora_token_slots,
                loaded.lora.max_loras,
                loaded.lora.max_rank,
            )
        pooling = load_pooling_config(config.model, config.task)
        self.runner = ModelRunner(loaded, config, num_blocks, pooling, self.lora)
        # The prefix cache's disk tier (`prefix_cache_dir`): reads into and copies from the
        # runner's KV tensors.
        self.prefix_store = open_prefix_store(config, loaded, self.runner.kv_caches)
        self.block_manager = BlockManager(num_blocks, config.block_size, self.prefix_store)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            config.max_loras if config.enable_lora else 0,
            self._proposer(config.speculative_config, draft),
        )
        self.input_processor = InputProcessor(
            config,
            self.tokenizer,
            self.model_config,
            self.num_input_ids,
            self.vocab_size,
            self._all_eos_ids,
            self.runner.vision_geometry,
        )
        self.compile_cache_hit = False
        self._rng = random.Random(config.seed)
        self.output_processor = OutputProcessor()
        self._closed = False
        self._entered = threading.RLock()  # held by the thread inside the engine (_one_thread)
        # Outputs of other requests produced while `embed` ran the loop: the next step's.
        self._held: list[Any] = []

    def _proposer(self, spec: SpeculativeConfig | None, draft: LLMEngine | None) -> Proposer | None:
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        if draft is None:
            raise ValueError("speculative_config.method='draft_model' needs the draft's engine")
        return DraftProposer(draft, spec, self.vocab_size)

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = True) -> LLMEngine:
        """Load the model, size the KV cache and compile every bucket before returning."""
        if config.compile and not config.background_compile:
            # inductor's runtime imports on a thread while the weights load (not where graphs
            # compile in the background: its workers fork at once, after the thread is done)
            prewarm_graph_imports()
        loaded = _load(config)
        gib = config.kv_cache_gib
        draft = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            # The draft model's engine, sharing the KV budget so both caches hold as many
            # tokens (per token: target K/V bytes : draft K/V bytes).
            try:
                draft_config = draft_engine_args(config, spec).create_engine_config()
            except ValueError as e:
                raise ValueError(f"speculative_config.model={spec.model!r}: {e}") from e
            if draft_config.task != "generate":
                raise ValueError(
                    f"speculative_config.model={spec.model!r} is not a decoder-only LM"
                )
            draft_loaded = _load(draft_config)
            per_token = [
                KVCacheSpec(c_loaded.kv_layer_shapes, 1, 1, c.kv_dtype).bytes_per_block
                for c, c_loaded in ((config, loaded), (draft_config, draft_loaded))
            ]
            draft_gib = gib * per_token[1] / sum(per_token)
            gib -= draft_gib
            draft_config = dataclasses.replace(draft_config, kv_cache_gib=draft_gib)
            draft = cls(
                draft_config, draft_loaded, _num_blocks(draft_config, draft_loaded, draft_gib)
            )
            draft.compile_cache_hit = draft.runner.warmup(
                show_progress, background=config.background_compile
            )
        engine = cls(config, loaded, _num_blocks(config, loaded, gib), draft)
        collapse_to_huge_pages()  # the weights' pages, on a thread, while the graphs compile
        engine.compile_cache_hit = engine.runner.warmup(
            show_progress, background=config.background_compile
        )
        return engine

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt (`InputProcessor.tokenize`)."""
        return self.input_processor.tokenize(prompt)

    def image_token(self) -> str | None:
        """The prompt text that stands for one image (`<|image|>`), or None for a model that
        takes no images."""
        return self.input_processor.image_token()

    @_one_thread
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; raises ValueError for bad input (a LoRA adapter that does not fit
        included), leaving the engine untouched."""
        self._check_open()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        for i in range(params.n):  # n > 1 names its sequences "<i>_<request_id>"
            child = child_id(request_id, i, params.n)
            if child in self.output_processor.child_to_parent:
                raise ValueError(
                    f"request_id {request_id!r} with n={params.n} needs sequence id {child!r}, "
                    f"which request {self.output_processor.child_to_parent[child]!r} is using"
                )
        lora_id, lora_digest = None, b""
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request needs an engine built with enable_lora=True")
            self.lora.add(lora_request)
            lora_id = lora_request.lora_int_id
            lora_digest = self.lora.digest[lora_id]
        if self.config.task in POOLED_TASKS:
            arch = self.config.model_spec.architecture
            kind = {
                "embed": "an embedding model: use LLM.embed",
                "classify": "a classifier: use LLM.classify or LLM.score",
            }[self.config.task]
            raise ValueError(f"model {self.config.model!r} ({arch}) is {kind}")
        prompt_in = self.input_processor.process(prompt, params)
        token_ids = prompt_in.token_ids
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        children = [
            Request(
                child_id(request_id, i, params.n),
                token_ids,
                params,
                self.eos_token_id,
                prompt_in.max_tokens,
                torch.Generator().manual_seed(base_seed + i),
                encoder_token_ids=prompt_in.encoder_token_ids,
                images=prompt_in.images,
                lora_id=lora_id,
                lora_digest=lora_digest,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, token_ids, params.skip_special_tokens
                ),
                other_eos_ids=self.other_eos_ids,
                controls=prompt_in.controls,
                grammar=self.input_processor.grammar_state(prompt_in),
                spec=SpecState() if self.scheduler.proposer is not None else None,
            )
            for i in range(params.n)
        ]
        self._add_parent(ParentRequest(request_id, prompt_in.text, token_ids, params, children))

    def _add_parent(self, parent: ParentRequest) -> None:
        for child in parent.children:
            self.scheduler.add_request(child)
        self.output_processor.add(parent)

    @_one_thread
    def abort_request(self, request_id: str) -> None:
        parent = self.output_processor.pop(request_id)
        if parent is None:
            return
        for child in parent.children:
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)

    @_one_thread
    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        """Finish a request's unfinished sequences with `error` (finish_reason "error"), freeing
        their blocks; returns its final output (tokens so far, `error` set), or None if the
        request is unknown or already forgotten."""
        parent = self.output_processor.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ERROR, error)
        return self.output_processor.output(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents or self._held)

    # ---- the loop -----------------------------------------------------------------------------
    @_one_thread
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return outputs of requests that got tokens or finished (as
        each request's `SamplingParams.output_kind` asks)."""
        held, self._held = self._held, []
        plan = self.scheduler.schedule()
        if not plan.requests:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests waiting")
            return held
        try:
            start = time.perf_counter()
            result = self.runner.execute(plan)
            self.scheduler.observe_step(plan, time.perf_counter() - start)
        except BaseException:
            # Nothing of this step is kept: its requests recompute on a later step, and blocks
            # it was to fill leave the prefix cache. The engine stays usable.
            self.scheduler.rollback(plan)
            raise
        updated, _ = self.scheduler.update(plan, result)
        return held + self.output_processor.outputs(updated)

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # ---- embeddings -------------------------------------------------------------------------
    @_one_thread
    def add_embed_request(self, request_id: str, prompt: PromptType, index: int = 0) -> None:
        """Queue an embedding request: its whole prompt runs in one step (no chunking: encoder
        attention is bidirectional) and is pooled. Raises ValueError naming prompt `index` and
        the limit for bad input."""
        self._add_parent(self._embed_parent(request_id, prompt, index))

    def _embed_parent(self, request_id: str, prompt: PromptType, index: int) -> ParentRequest:
        """The checked, tokenized embedding request (not queued)."""
        self._check_open()
        if self.config.task == "encdec":
            raise ValueError(
                "LLM.embed needs an encoder-only or causal model; this one is encoder-decoder"
            )
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.input_processor.process_embed(prompt, index)
        types = self._token_types(prompt, ids, index)
        params = SamplingParams(max_tokens=1)
        request = Request(
            request_id, with_token_types(ids, types), params, None, 1, torch.Generator(), pool=True
        )
        return ParentRequest(request_id, text, ids, params, [request])

    def _token_types(self, prompt: PromptType, ids: list[int], index: int) -> list[int] | None:
        """A pooled prompt's `token_type_ids` (a text pair's segments, for a cross-encoder),
        checked against its ids and the model's `type_vocab_size`."""
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is None:
            return None
        limit = int(getattr(self.config.model_spec.hf_config, "type_vocab_size", 0) or 0)
        if not limit:
            raise ValueError(f"prompt {index}: this model takes no token_type_ids")
        if len(types) != len(ids) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limit for t in types
        ):
            raise ValueError(
                f"prompt {index}: token_type_ids must hold one id in [0, {limit}) per token "
                f"({len(ids)})"
            )
        return list(types)

    @_one_thread
    def embed(
        self, request_ids: Sequence[str], prompts: Sequence[PromptType]
    ) -> list[EmbeddingRequestOutput]:
        """One pooled, (by default) L2-normalised embedding per prompt, in input order.

        Prompts are batched by the scheduler like any request, under max_num_seqs /
        max_num_batched_tokens and the free KV blocks, which are freed when each finishes;
        they are queued longest first (as sentence-transformers sorts its batches), so each
        step holds prompts of similar length and its padded attention wastes little
        (all-MiniLM-L6-v2, 1024 texts of 10-60 words: SDPA 0.68 -> 0.29 s, the call 3.2 -> 2.6 s).
        Raises ValueError naming the prompt and the limit for bad input, before any work.
        """
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must be unique")
        parents = [
            self._embed_parent(rid, prompt, i)
            for i, (rid, prompt) in enumerate(zip(request_ids, prompts, strict=True))
        ]
        added: list[str] = []
        try:
            for parent in sorted(parents, key=lambda p: -len(p.prompt_token_ids)):
                self._add_parent(parent)
                added.append(parent.request_id)
            wanted = set(added)
            outputs: dict[str, EmbeddingRequestOutput] = {}
            while len(outputs) < len(added):
                for out in self.step():
                    if isinstance(out, EmbeddingRequestOutput) and out.request_id in wanted:
                        outputs[out.request_id] = out
                    else:  # a request in flight beside the embeddings: keep it for step()
                        self._held.append(out)
        except BaseException:
            for rid in added:
                self.abort_request(rid)
            raise
        return [outputs[rid] for rid in request_ids]

    @_one_thread
    def close(self) -> None:
        """Abort all requests and drop the KV cache, the compiled graphs and the model; adding
        requests or stepping afterwards raises RuntimeError."""
        for request_id in list(self.output_processor.parents):
            self.abort_request(request_id)
        if self.prefix_store is not None:
            self.prefix_store.close()  # what the last steps filled is written first
        self.runner.close()
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.close()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed; create a new one to run more requests")


def _load(config: EngineConfig) -> LoadedModel:
    lora = None
    if config.enable_lora:
        lora = LoRAShape(config.max_loras, config.max_lora_rank, config.max_num_batched_tokens)
    return load_model(
        config.model_spec,
        config.dtype,
        get_backend(config.attention_backend),
        config.quantization,
        lora,
        weight_dtype=config.weight_dtype,
        kernel_linears=not config.freeze_weights,
        cpu_isa=config.cpu_isa,
        load_format=config.load_format,
        quantize_activations=config.quantize_activations,
    )


def _num_blocks(config: EngineConfig, loaded: LoadedModel, gib: float) -> int:
    """KV blocks of `loaded`'s geometry in `gib`; at least one max_model_len sequence."""
    num_blocks = KVCacheSpec.num_blocks_for(
        gib, loaded.kv_layer_shapes, config.block_size, config.kv_dtype
    )
    # One block is the reserved null block for padding.
    if num_blocks - 1 < config.max_blocks_per_seq:
        raise ValueError(
            f"kv_cache_gib={config.kv_cache_gib} holds "
            f"{max(num_blocks - 1, 0) * config.block_size} tokens of {config.model!r}, fewer "
            f"than max_model_len={config.max_model_len}; raise kv_cache_gib or lower "
            "max_model_len"
        )
    return num_blocks


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [int(v) for v in value]
    return [int(value)]


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> tuple[int | None, frozenset[int]]:
    """(the model's EOS, the other EOS ids that stop it), as vLLM reads them: the tokenizer's
    EOS (else the generation config's first), and every id of the generation config's
    `eos_token_id` (generation_config.json, else the model config's), which may be a list
    (Llama 3 instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>)."""
    gen = getattr(model, "generation_config", None)
    listed = _as_ids(getattr(gen, "eos_token_id", None) if gen is not None else None)
    listed = listed or _as_ids(getattr(model.config, "eos_token_id", None))
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if primary is None:
        primary = listed[0] if listed else None
    return primary, frozenset(listed) - {primary}


# The generation-config fields that become default SamplingParams (vLLM's list).
_SAMPLING_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _sampling_defaults(model: torch.nn.Module, source: str) -> dict[str, Any]:
    """The SamplingParams fields the model's generation config sets away from transformers'
    defaults (`generation_config="auto"`), or those of a generation config in the directory
    `source`; none for "vllm" (SamplingParams' own defaults)."""
    if source == "vllm":
        return {}
    if source == "auto":
        gen = getattr(model, "generation_config", None)
    else:
        from transformers import GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(source, local_files_only=True)
        except OSError as e:
            raise ValueError(
                f"generation_config={source!r} must be auto, vllm or a directory with a "
                f"generation_config.json: {e}"
            ) from e
    if gen is None:
        return {}
    diff = gen.to_diff_dict()
    return {ours: diff[theirs] for theirs, ours in _SAMPLING_DEFAULTS.items() if theirs in diff}
