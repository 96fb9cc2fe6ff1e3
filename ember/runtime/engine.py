"""LLMEngine: add_request / step / abort_request. The only outer loop.

One step: `plan = scheduler.schedule()`, `result = runner.execute(plan)`,
`scheduler.update(plan, result)`, then detokenize and check stop strings.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ember import kernels
from ember.compiler.capture import kv_layer_shapes, load_model
from ember.lora.adapter import LoRARequest
from ember.lora.layers import install_lora
from ember.lora.manager import LoRAManager
from ember.quant import quantize_int8_, use_bf16_gemv_
from ember.runtime.batch import TokenLogprobs
from ember.runtime.block_manager import BlockManager
from ember.runtime.config import EngineConfig, KVCacheSpec
from ember.runtime.model_runner import ModelRunner
from ember.runtime.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    IncrementalDetokenizer,
    Logprob,
    RequestOutput,
    find_stop_string,
)
from ember.runtime.pooling import load_pooling_config, pool
from ember.runtime.request import Request, RequestStatus, SamplingParams
from ember.runtime.scheduler import Scheduler

logger = logging.getLogger("ember")

PromptType = str | dict[str, Any] | list[int]


@dataclass
class _ParentState:
    """A user request: its prompt and one child per parallel sample (`n`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    child_ids: list[str]
    completions: list[CompletionOutput]
    detokenizers: list[IncrementalDetokenizer]
    num_cached_tokens: int = 0


def _child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class LLMEngine:
    """Continuous-batching engine over one model. Not thread-safe."""

    def __init__(
        self,
        config: EngineConfig,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        num_blocks: int,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model.config
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator, index]
        self.pooling = load_pooling_config(config.model, config.task)
        self.eos_token_id = _eos_id(model, tokenizer)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            config.max_loras if config.enable_lora else 0,
        )
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            wrapped, token_slots = install_lora(
                model, config.max_loras, config.max_lora_rank, config.max_num_batched_tokens
            )
            self.lora = LoRAManager(wrapped, token_slots, config.max_loras, config.max_lora_rank)
        self.runner = ModelRunner(model, config, num_blocks, self.lora)
        self.compile_cache_hit = False
        self._rng = random.Random(config.seed)
        self._parents: dict[str, _ParentState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = True) -> LLMEngine:
        """Load the model, size the KV cache and compile every bucket before returning."""
        model = load_model(config.model, config.dtype, config.attention_backend)
        if config.quantization == "int8":
            quantize_int8_(model)
        elif config.dtype == torch.bfloat16 and kernels.available():
            use_bf16_gemv_(model)
        try:
            tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            logger.warning("no tokenizer in %s (%s); only token-id prompts work", config.model, e)
            tokenizer = None
        num_blocks = KVCacheSpec.num_blocks_for(
            config.kv_cache_gib, kv_layer_shapes(model), config.block_size, config.dtype
        )
        # One block is the reserved dummy block for padding.
        if num_blocks - 1 < config.max_blocks_per_seq:
            raise ValueError(
                f"kv_cache_gib={config.kv_cache_gib} holds "
                f"{max(num_blocks - 1, 0) * config.block_size} tokens, fewer than "
                f"max_model_len={config.max_model_len}; raise kv_cache_gib or lower max_model_len"
            )
        engine = cls(config, model, tokenizer, num_blocks)
        engine.compile_cache_hit = engine.runner.warmup(show_progress)
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
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt)}")

    def _tokenize_encoder_decoder(
        self, prompt: PromptType
    ) -> tuple[str | None, list[int], list[int]]:
        """(encoder text, decoder prompt ids, encoder ids) of an encoder-decoder prompt.

        A string / token list / `{"prompt": ...}` is the encoder input; or
        `{"encoder_prompt": ..., "decoder_prompt": ...}` with either part a string, a token list
        or `{"prompt_token_ids": [...]}`. The decoder prompt always starts with the model's
        decoder_start_token_id; a text decoder prompt is tokenized without special tokens.
        """
        decoder: Any = None
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            encoder, decoder = prompt["encoder_prompt"], prompt.get("decoder_prompt")
        else:
            encoder = prompt
        text, encoder_ids = self.tokenize(encoder)
        start = getattr(self.model_config, "decoder_start_token_id", None)
        if start is None:
            raise ValueError(f"model {self.config.model!r} has no decoder_start_token_id")
        decoder_ids = [int(start)]
        if isinstance(decoder, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            decoder_ids += list(self.tokenizer(decoder, add_special_tokens=False)["input_ids"])
        elif decoder is not None:
            decoder_ids += self.tokenize(decoder)[1]
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
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} token ids must be in [0, {self.vocab_size}); got {bad[:5]}")

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.config.max_model_len} "
                "leaves no room for output (prompt must be shorter than max_model_len)"
            )
        self._check_token_ids(token_ids, "prompt")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs={self.config.max_logprobs}")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; raises ValueError for bad input (a LoRA adapter that does not fit
        included), leaving the engine untouched."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        lora_id = None
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request needs an engine built with enable_lora=True")
            self.lora.add(lora_request)
            lora_id = lora_request.lora_int_id
        if self.config.task == "embed":
            arch = (getattr(self.model_config, "architectures", None) or ["?"])[0]
            raise ValueError(
                f"model {self.config.model!r} ({arch}) is an embedding model: use LLM.embed"
            )
        encoder_ids = None
        if self.config.task == "encdec":
            text, token_ids, encoder_ids = self._tokenize_encoder_decoder(prompt)
        else:
            text, token_ids = self.tokenize(prompt)
        self._validate_prompt(token_ids, params)
        max_tokens = min(
            params.max_tokens or self.config.max_model_len,
            self.config.max_model_len - len(token_ids),
        )
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        child_ids = [_child_id(request_id, i, params.n) for i in range(params.n)]
        parent = _ParentState(
            request_id,
            text,
            token_ids,
            params,
            child_ids,
            completions=[CompletionOutput(i, "", [], None, None) for i in range(params.n)],
            detokenizers=[
                IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                for _ in range(params.n)
            ],
        )
        for i, cid in enumerate(child_ids):
            generator = torch.Generator().manual_seed(base_seed + i)
            request = Request(
                cid,
                token_ids,
                params,
                self.eos_token_id,
                max_tokens,
                generator,
                encoder_token_ids=encoder_ids,
                lora_id=lora_id,
            )
            self.scheduler.add_request(request)
            self._child_to_parent[cid] = (request_id, i)
        self._parents[request_id] = parent

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for cid in parent.child_ids:
            self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
            self._child_to_parent.pop(cid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return outputs of requests that got tokens or finished."""
        plan = self.scheduler.schedule()
        if not plan.requests:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests waiting")
            return []
        result = self.runner.execute(plan)
        updated, finished = self.scheduler.update(plan, result)
        touched: dict[str, None] = {}
        for request in updated:
            self._process_token(request, result.logprobs.get(request.request_id))
            touched[self._child_to_parent[request.request_id][0]] = None
        return [out for pid in touched if (out := self._parent_output(pid)) is not None]

    def _process_token(self, request: Request, logprobs: TokenLogprobs | None) -> None:
        parent_id, index = self._child_to_parent[request.request_id]
        parent = self._parents[parent_id]
        completion = parent.completions[index]
        detok = parent.detokenizers[index]
        token = request.output_token_ids[-1]
        num_new_chars = detok.append(token)
        completion.token_ids = list(request.output_token_ids)
        if index == 0:
            parent.num_cached_tokens = max(request.num_cached_tokens, 0)
        if logprobs is not None:
            self._append_logprobs(completion, logprobs)
        stop = find_stop_string(
            detok.text,
            num_new_chars,
            request.params.stop_strings,
            request.params.include_stop_str_in_output,
        )
        if stop is not None and not request.status.finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            request.stop_reason = stop[1]
        if request.status.finished:
            if stop is None:
                detok.flush()
            completion.finish_reason = (
                "stop" if request.status == RequestStatus.FINISHED_STOPPED else "length"
            )
            completion.stop_reason = request.stop_reason
        completion.text = stop[0] if stop is not None else detok.text

    def _append_logprobs(self, completion: CompletionOutput, lp: TokenLogprobs) -> None:
        entry = {
            t: Logprob(
                v, r, str(self.tokenizer.decode([t])) if self.tokenizer is not None else None
            )
            for t, v, r in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True)
        }
        if completion.logprobs is None:
            completion.logprobs = []
        completion.logprobs.append(entry)
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + lp.logprobs[0]

    def _parent_output(self, parent_id: str) -> RequestOutput | None:
        parent = self._parents.get(parent_id)
        if parent is None:
            return None
        finished = all(c.finish_reason is not None for c in parent.completions)
        out = RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            [
                CompletionOutput(
                    c.index,
                    c.text,
                    list(c.token_ids),
                    c.cumulative_logprob,
                    list(c.logprobs) if c.logprobs is not None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
                for c in parent.completions
            ],
            finished,
            parent.num_cached_tokens,
        )
        if finished:
            del self._parents[parent_id]
            for cid in parent.child_ids:
                self._child_to_parent.pop(cid, None)
        return out

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # ---- embeddings -------------------------------------------------------------------------
    def embed(
        self, request_ids: Sequence[str], prompts: Sequence[PromptType]
    ) -> list[EmbeddingRequestOutput]:
        """One pooled, (by default) L2-normalised embedding per prompt, in input order.

        Prompts run whole (no chunking: encoder attention is bidirectional), batched up to
        max_num_seqs / max_num_batched_tokens and the free KV blocks; their blocks are freed
        after each batch. Raises ValueError naming the prompt and the limit for bad input,
        before any work.
        """
        if self.config.task == "encdec":
            raise ValueError(
                "LLM.embed needs an encoder-only or causal model; this one is encoder-decoder"
            )
        limit = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        items = []
        for i, (rid, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
            text, ids = self.tokenize(prompt)
            if len(ids) > limit:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; embedding inputs must have at most "
                    f"min(max_model_len, max_num_batched_tokens)={limit}"
                )
            self._check_token_ids(ids, f"prompt {i}")
            items.append((rid, text, ids))
        # Encoder blocks must never be matched by a causal prefix: hash them apart.
        extra = b"" if self.config.task == "generate" else b"bidirectional"
        bs = self.config.block_size
        outputs: list[EmbeddingRequestOutput] = []
        start = 0
        while start < len(items):
            end, tokens, blocks = start, 0, 0
            while end < len(items) and end - start < self.config.max_num_seqs:
                n = len(items[end][2])
                if end > start and (
                    tokens + n > self.config.max_num_batched_tokens
                    or blocks + -(-n // bs) > self.block_manager.num_free_blocks
                ):
                    break
                tokens, blocks, end = tokens + n, blocks + -(-n // bs), end + 1
            batch = items[start:end]
            keys = [f"embed-{rid}" for rid, _, _ in batch]
            try:
                block_ids = []
                for key, (_, _, ids) in zip(keys, batch, strict=True):
                    if self.block_manager.allocate(key, ids, len(ids), extra=extra) is None:
                        raise ValueError(
                            f"a {len(ids)}-token prompt does not fit the free KV cache "
                            f"({self.block_manager.num_free_blocks} blocks of {bs}); raise "
                            "kv_cache_gib"
                        )
                    block_ids.append(self.block_manager.block_ids(key))
                hidden = self.runner.hidden_states([ids for _, _, ids in batch], block_ids)
            finally:
                for key in keys:
                    self.block_manager.free(key)
            vectors = pool(hidden, [len(ids) for _, _, ids in batch], self.pooling)
            for (rid, text, ids), vec in zip(batch, vectors, strict=True):
                outputs.append(
                    EmbeddingRequestOutput(rid, text, ids, EmbeddingOutput(vec.tolist()))
                )
            start = end
        return outputs

    def close(self) -> None:
        """Abort all requests and drop the KV cache, the compiled graphs and the model."""
        for request_id in list(self._parents):
            self.abort_request(request_id)
        self.runner.close()


def _eos_id(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> int | None:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, Sequence):
        eos = eos[0] if eos else None
    return eos
