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
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from ember.attention import get_backend
from ember.compile.capture import prewarm_graph_imports
from ember.host.memory import collapse_to_huge_pages
from ember.lora.adapter import LoRARequest
from ember.lora.manager import LoRAManager
from ember.model.loader import LoadedModel, LoRAShape, load_model
from ember.runtime.block_manager import BlockManager
from ember.runtime.config import EngineConfig, KVCacheSpec
from ember.runtime.draft import DraftProposer, draft_engine_args
from ember.runtime.logits import resolve as resolve_controls
from ember.runtime.model_runner import ModelRunner
from ember.runtime.multimodal import ImageInputs, as_image_list, build_image_inputs, is_image
from ember.runtime.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    IncrementalDetokenizer,
    RequestOutput,
)
from ember.runtime.pooling import load_pooling_config
from ember.runtime.request import Request, RequestOutputKind, RequestStatus, SamplingParams
from ember.runtime.scheduler import Scheduler
from ember.runtime.speculative import NgramProposer, Proposer, SpecState, SpeculativeConfig
from ember.runtime.structured import GrammarCompiler

logger = logging.getLogger("ember")

PromptType = str | dict[str, Any] | list[int]


@dataclass
class _ParentState:
    """A user request: its prompt and one child `Request` per parallel sample (`n`).
    `sent`: per child, how many tokens / characters / logprobs earlier DELTA outputs held."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    sent: list[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.sent = [(0, 0)] * len(self.children)


def _check_image_count(num_tokens: int, processor: Any, images: list[Any]) -> None:
    if num_tokens != len(images):
        raise ValueError(
            f"the prompt has {num_tokens} image tokens ({processor.image_token!r}, id "
            f"{processor.image_token_id}) for {len(images)} images; they must be equal"
        )


def _child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


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
        self._processor: Any = None  # a vision-language model's HF processor, on first use
        self.eos_token_id, self.other_eos_ids = _eos_ids(model, self.tokenizer)
        # Every id that ends a request as EOS (masked by min_tokens, allowed at a grammar's end).
        self._all_eos_ids = sorted(
            self.other_eos_ids | ({self.eos_token_id} if self.eos_token_id is not None else set())
        )
        self.default_sampling = _sampling_defaults(model, config.generation_config)
        self._grammar_compiler: GrammarCompiler | None = None
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            config.max_loras if config.enable_lora else 0,
            self._proposer(config.speculative_config, draft),
        )
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
        self.compile_cache_hit = False
        self._rng = random.Random(config.seed)
        self._parents: dict[str, _ParentState] = {}
        self._child_to_parent: dict[str, str] = {}
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
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            if self.config.model_spec.multimodal is not None:
                # A vision-language model's text-only prompt goes through its HF processor, as
                # its image prompts do (Mllama's puts the BOS in where the tokenizer does not).
                return prompt, self._processor_token_ids(prompt)
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt)}")

    def _truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """`truncate_prompt_tokens`: the last `keep` tokens (-1: the last max_model_len - 1,
        which leaves room for one output token)."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.config.max_model_len - 1
        return token_ids[-keep:]

    def _tokenize_encoder_decoder(
        self, prompt: PromptType, truncate: int | None = None
    ) -> tuple[str | None, list[int], list[int]]:
        """(encoder text, decoder prompt ids, encoder ids) of an encoder-decoder prompt.

        A string / token list / `{"prompt": ...}` is the encoder input; or
        `{"encoder_prompt": ..., "decoder_prompt": ...}` with either part a string, a token list
        or `{"prompt_token_ids": [...]}`. The decoder prompt starts with the model's
        decoder_start_token_id: it is prepended unless the decoder prompt already starts with
        it (HF `generate`'s rule for `decoder_input_ids`); a text decoder prompt is tokenized
        without special tokens. `truncate` (`truncate_prompt_tokens`) cuts the encoder input.
        """
        decoder: Any = None
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            encoder, decoder = prompt["encoder_prompt"], prompt.get("decoder_prompt")
        else:
            encoder = prompt
        text, encoder_ids = self.tokenize(encoder)
        encoder_ids = self._truncate(encoder_ids, truncate)
        start = getattr(self.model_config, "decoder_start_token_id", None)
        if start is None:
            raise ValueError(f"model {self.config.model!r} has no decoder_start_token_id")
        decoder_ids: list[int] = []
        if isinstance(decoder, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            decoder_ids = list(self.tokenizer(decoder, add_special_tokens=False)["input_ids"])
        elif decoder is not None:
            decoder_ids = self.tokenize(decoder)[1]
        if not decoder_ids or decoder_ids[0] != int(start):
            decoder_ids.insert(0, int(start))
        limit = self.model_config.max_position_embeddings
        if len(encoder_ids) > limit:
            raise ValueError(
                f"encoder prompt has {len(encoder_ids)} tokens; it must have at most "
                f"max_position_embeddings={limit}"
            )
        self._check_token_ids(encoder_ids, "encoder prompt")
        return text, decoder_ids, encoder_ids

    def _check_token_ids(self, token_ids: list[int], what: str) -> None:
        """`what` ("prompt", "prompt 3", ...) must be non-empty ids in the vocabulary."""
        if not token_ids:
            raise ValueError(f"{what} is empty: it must have at least 1 token")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.num_input_ids]
        if bad:
            raise ValueError(
                f"{what} token ids must be in [0, {self.num_input_ids}); got {bad[:5]}"
            )

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.config.max_model_len} "
                "leaves no room for output (prompt must be shorter than max_model_len)"
            )
        self._check_token_ids(token_ids, "prompt")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs={self.config.max_logprobs}")

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
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        for i in range(params.n):  # n > 1 names its sequences "<i>_<request_id>"
            child = _child_id(request_id, i, params.n)
            if child in self._child_to_parent:
                raise ValueError(
                    f"request_id {request_id!r} with n={params.n} needs sequence id {child!r}, "
                    f"which request {self._child_to_parent[child]!r} is using"
                )
        lora_id, lora_generation = None, 0
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request needs an engine built with enable_lora=True")
            self.lora.add(lora_request)
            lora_id = lora_request.lora_int_id
            lora_generation = self.lora.generation[lora_id]
        if self.config.task == "embed":
            arch = self.config.model_spec.architecture
            raise ValueError(
                f"model {self.config.model!r} ({arch}) is an embedding model: use LLM.embed"
            )
        encoder_ids = images = None
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data is not None:
            text, token_ids, images = self._process_images(prompt, mm_data)  # type: ignore[arg-type]
            token_ids = self._truncate(token_ids, params.truncate_prompt_tokens)
            if len(token_ids) != len(images.starts):
                raise ValueError(
                    "truncate_prompt_tokens cannot cut a prompt with images (it would cut the "
                    "images' place in the prompt)"
                )
        elif self.config.task == "encdec":
            text, token_ids, encoder_ids = self._tokenize_encoder_decoder(
                prompt, params.truncate_prompt_tokens
            )
        else:
            text, token_ids = self.tokenize(prompt)
            token_ids = self._truncate(token_ids, params.truncate_prompt_tokens)
        self._validate_prompt(token_ids, params)
        stop_ids = [*params.stop_ids, *self._all_eos_ids]
        controls = resolve_controls(params, self.vocab_size, self.tokenizer, stop_ids)
        grammar, wait_for = None, None
        if params.structured_outputs is not None:
            grammar = self._grammars().compile(params.structured_outputs)
            after = params.structured_outputs.start_after
            if after:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs.start_after needs a tokenizer")
                wait_for = list(self.tokenizer.encode(after, add_special_tokens=False))
        max_tokens = min(
            params.max_tokens or self.config.max_model_len,
            self.config.max_model_len - len(token_ids),
        )
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        children = [
            Request(
                _child_id(request_id, i, params.n),
                token_ids,
                params,
                self.eos_token_id,
                max_tokens,
                torch.Generator().manual_seed(base_seed + i),
                encoder_token_ids=encoder_ids,
                images=images,
                lora_id=lora_id,
                lora_generation=lora_generation,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, token_ids, params.skip_special_tokens
                ),
                other_eos_ids=self.other_eos_ids,
                controls=controls,
                grammar=self._grammars().matcher(grammar, wait_for)
                if grammar is not None
                else None,
                spec=SpecState() if self.scheduler.proposer is not None else None,
            )
            for i in range(params.n)
        ]
        self._add_parent(_ParentState(request_id, text, token_ids, params, children))

    def _process_images(
        self, prompt: dict[str, Any], mm_data: Any
    ) -> tuple[str | None, list[int], ImageInputs]:
        """(prompt text, prompt ids, images) of a prompt with `multi_modal_data`: a text prompt
        goes through the checkpoint's HF processor (which also places the BOS token as HF
        does), a token-id prompt's images through its image processor."""
        spec = self.config.model_spec
        if spec.multimodal is None:
            raise ValueError(
                f"multi_modal_data: model {self.config.model!r} ({spec.architecture}) takes "
                "no images or other multimodal inputs"
            )
        if not isinstance(mm_data, dict) or not mm_data or set(mm_data) - {"image"}:
            raise ValueError(
                f'multi_modal_data must be {{"image": image or list of images}} for this model, '
                f"got {mm_data!r:.100}"
            )
        pictures = as_image_list(mm_data["image"])
        for picture in pictures:
            if not is_image(picture):
                raise ValueError(
                    "multi_modal_data['image'] takes PIL images (or HWC/CHW arrays and "
                    f"tensors), got {type(picture).__name__}"
                )
        limit = self.config.limit_mm_per_prompt.get("image", 0)
        if not 1 <= len(pictures) <= limit:
            raise ValueError(
                f"multi_modal_data has {len(pictures)} images; a prompt takes 1 to "
                f"limit_mm_per_prompt['image']={limit}"
            )
        processor = self._image_processor()
        geometry = self.runner.vision_geometry
        assert geometry is not None
        try:
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
                features = processor.image_processor(images=[pictures], return_tensors="np")
            else:
                text = prompt.get("prompt")
                if not isinstance(text, str):
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
                _check_image_count(text.count(processor.image_token), processor, pictures)
                features = processor(images=[pictures], text=[text], return_tensors="np")
                token_ids = [int(t) for t in features["input_ids"][0]]
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001  (PIL and the processor raise their own types)
            raise ValueError(
                f"multi_modal_data: the image processor failed: {type(e).__name__}: {e}"
            ) from e
        image_token = processor.image_token_id
        _check_image_count(sum(1 for t in token_ids if t == image_token), processor, pictures)
        if features["pixel_values"].shape[2] != geometry.tiles:
            raise ValueError(
                f"the image processor makes {features['pixel_values'].shape[2]} tiles per image, "
                f"the model's vision tower takes {geometry.tiles}"
            )
        return text, token_ids, build_image_inputs(token_ids, image_token, features, geometry)

    def _processor_token_ids(self, text: str) -> list[int]:
        """The ids the checkpoint's HF processor makes of a text with no images."""
        try:
            ids = self._image_processor()(text=[text])["input_ids"][0]
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001  (the processor raises its own types)
            raise ValueError(f"the processor failed on the prompt: {type(e).__name__}: {e}") from e
        return [int(t) for t in ids]

    def image_token(self) -> str | None:
        """The prompt text that stands for one image (`<|image|>`), or None for a model that
        takes no images."""
        if self.config.model_spec.multimodal is None:
            return None
        return str(self._image_processor().image_token)

    def _image_processor(self) -> Any:
        """The checkpoint's HF processor (tokenizer + image processor), loaded on first use."""
        if self._processor is None:
            from transformers import AutoProcessor  # noqa: PLC0415

            try:
                self._processor = AutoProcessor.from_pretrained(
                    self.config.model_spec.model_dir,
                    local_files_only=True,
                    trust_remote_code=False,
                )
            except Exception as e:  # noqa: BLE001
                raise ValueError(
                    f"model {self.config.model!r} has no usable image processor "
                    f"(processor_config.json / preprocessor_config.json): {e}"
                ) from e
        return self._processor

    def _grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler, made on first use (xgrammar's tokenizer
        info takes ~0.2 s for a 150k vocabulary)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.vocab_size, self._all_eos_ids
            )
        return self._grammar_compiler

    def _add_parent(self, parent: _ParentState) -> None:
        for child in parent.children:
            self.scheduler.add_request(child)
            self._child_to_parent[child.request_id] = parent.request_id
        self._parents[parent.request_id] = parent

    @_one_thread
    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for child in parent.children:
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)
            self._child_to_parent.pop(child.request_id, None)

    @_one_thread
    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        """Finish a request's unfinished sequences with `error` (finish_reason "error"), freeing
        their blocks; returns its final output (tokens so far, `error` set), or None if the
        request is unknown or already forgotten."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ERROR, error)
        return self._parent_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents or self._held)

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
        touched = dict.fromkeys(self._child_to_parent[r.request_id] for r in updated)
        return held + [out for pid in touched if (out := self._parent_output(pid)) is not None]

    def _parent_output(self, parent_id: str) -> RequestOutput | Any | None:
        """The parent's output as its kind asks (None: nothing to emit this step); a finished
        parent is forgotten."""
        parent = self._parents[parent_id]
        finished = all(c.status.finished for c in parent.children)
        if finished:
            del self._parents[parent_id]
            for child in parent.children:
                self._child_to_parent.pop(child.request_id, None)
        if parent.children[0].pool:
            return _embedding_output(parent) if finished else None
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for i, child in enumerate(parent.children):
            start, text_start = parent.sent[i] if kind == RequestOutputKind.DELTA else (0, 0)
            completions.append(_completion(i, child, start, text_start))
            parent.sent[i] = (len(child.output_token_ids), len(child.text))
        errors = [(i, c.error) for i, c in enumerate(parent.children) if c.error]
        error = None
        if errors:  # a failed sequence of n > 1 is named by its index
            error = "; ".join(
                e if len(parent.children) == 1 else f"sequence {i}: {e}" for i, e in errors
            )
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            completions,
            finished,
            max(parent.children[0].num_cached_tokens, 0),
            error=error,
            prompt_logprobs=parent.children[0].prompt_logprobs,
        )

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # ---- embeddings -------------------------------------------------------------------------
    @_one_thread
    def add_embed_request(self, request_id: str, prompt: PromptType, index: int = 0) -> None:
        """Queue an embedding request: its whole prompt runs in one step (no chunking: encoder
        attention is bidirectional) and is pooled. Raises ValueError naming prompt `index` and
        the limit for bad input."""
        self._add_parent(self._embed_parent(request_id, prompt, index))

    def _embed_parent(self, request_id: str, prompt: PromptType, index: int) -> _ParentState:
        """The checked, tokenized embedding request (not queued)."""
        self._check_open()
        if self.config.task == "encdec":
            raise ValueError(
                "LLM.embed needs an encoder-only or causal model; this one is encoder-decoder"
            )
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise ValueError(f"prompt {index}: LLM.embed takes no multi_modal_data")
        text, ids = self.tokenize(prompt)
        limit = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        if len(ids) > limit:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; embedding inputs must have at most "
                f"min(max_model_len, max_num_batched_tokens)={limit}"
            )
        self._check_token_ids(ids, f"prompt {index}")
        params = SamplingParams(max_tokens=1)
        request = Request(request_id, ids, params, None, 1, torch.Generator(), pool=True)
        return _ParentState(request_id, text, ids, params, [request])

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
        for request_id in list(self._parents):
            self.abort_request(request_id)
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


def _completion(index: int, request: Request, start: int, text_start: int) -> CompletionOutput:
    """A snapshot of `request`'s output from token `start` / character `text_start` on."""
    logprobs = request.logprobs[start:] if request.logprobs is not None else None
    return CompletionOutput(
        index,
        request.text[text_start:],
        request.output_token_ids[start:],
        request.cumulative_logprob,
        logprobs,
        request.status.finish_reason,
        request.stop_reason,
    )


def _embedding_output(parent: _ParentState) -> EmbeddingRequestOutput:
    embedding = parent.children[0].embedding
    assert embedding is not None
    return EmbeddingRequestOutput(
        parent.request_id, parent.prompt, parent.prompt_token_ids, EmbeddingOutput(embedding)
    )


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
