"""Continuous-batching scheduler in vLLM V1's token-accounting style.

Each request's `num_computed_tokens` catches up to its `num_tokens` under one token budget
(`max_num_batched_tokens`) and one sequence budget (`max_num_seqs`). Running requests go first
(decodes before prefill chunks), then waiting ones in arrival order; prompts are chunked to fit
the budget; prefix-cache hits skip computation; when blocks run out, the most recently admitted
running request not yet scheduled this step is preempted and later recomputed.

Embedding requests (`Request.pool`) run whole in one step (bidirectional attention cannot be
chunked) and finish in it. The encoder inputs of encoder-decoder requests admitted in one step
share one encoder pass of at most `max_num_batched_tokens` tokens (a longer one runs alone);
so do the images of vision-language requests (counted in image tokens).

`update` is the only place that decides a request has finished: EOS, stop ids, length, stop
strings (found by the request's incremental detokenizer), or an error of its own (NaN/inf
logits). A step that fails as a whole is undone by `rollback` instead: its requests go back to
waiting and recompute, and the blocks it was to fill leave the prefix cache.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from ember.runtime.batch import RunnerOutput, ScheduledRequest, StepPlan, TokenLogprobs
from ember.runtime.block_manager import BlockManager
from ember.runtime.outputs import Logprob, find_stop_string
from ember.runtime.request import Request, RequestStatus
from ember.runtime.speculative import Proposer, StepCosts

logger = logging.getLogger("ember")


def cross_key(request_id: str) -> str:
    """Block-manager key of a request's cross-attention (encoder output) blocks."""
    return request_id + "/cross"


class Scheduler:
    """Owns request state transitions. The only writer of `Request` fields."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int = 0,
        proposer: Proposer | None = None,
    ) -> None:
        self.block_manager = block_manager
        # Speculative decoding: proposes draft tokens for decoding requests at schedule time
        # (drafts live only in the plan, so preemption and rollback have nothing to undo).
        self.proposer = proposer
        self.num_drafts = 0  # steps of a request that carried draft tokens
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.spec_plan: dict[str, tuple[int, ...]] = {}  # this step's drafts, by request
        self.step_costs = StepCosts()  # decode steps' time against their token counts
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        bs = self.block_manager.block_size
        max_blocks = -(-self.max_model_len // bs) + -(-request.num_encoder_tokens // bs)
        if max_blocks > self.block_manager.num_usable_blocks:
            raise ValueError(
                "the KV cache is smaller than one max_model_len sequence (plus its encoder "
                "input or images)"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> Request | None:
        """End a request (an abort, a failure with `error`, or a stop condition in `update`);
        frees its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if error is not None:
            request.error = error
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._free_blocks(request)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        return request

    def _free_blocks(self, request: Request, keep_hashes: bool = False) -> None:
        self.block_manager.free(request.request_id, keep_hashes=keep_hashes)
        if request.num_encoder_tokens:
            self.block_manager.free(cross_key(request.request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        done: set[str] = set()
        preempted: list[str] = []
        loras: set[int] = set()  # distinct adapters in this step: at most max_loras
        # Decodes before prefill chunks; stable, so admission order holds within each group.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        drafts = self._propose(order)
        for request in order:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._lora_fits(request, loras):
                continue  # waits for a step with a free adapter slot
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            draft = drafts.get(request.request_id, ())[: budget - num_new]
            # Drafts never preempt anyone: without room for them the request decodes one
            # token. Draft positions are never hashed (only real tokens enter the prefix
            # cache: `BlockManager._cache_full_blocks`).
            if draft and self._allocate(request, request.num_computed_tokens + 1 + len(draft)):
                num_new += len(draft)
                self.spec_plan[request.request_id] = draft
            elif not self._allocate_or_preempt(request, num_new, done, preempted):
                continue
            scheduled.append((request, num_new))
            done.add(request.request_id)
            budget -= num_new
            if request.lora_id is not None:
                loras.add(request.lora_id)
        num_running = len(scheduled)
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, loras)
        # Requests admitted this step run their encoder (if any) before the decoder step.
        return StepPlan(
            tuple(self._scheduled(r, n, i >= num_running) for i, (r, n) in enumerate(scheduled)),
            tuple(preempted),
        )

    def _propose(self, order: list[Request]) -> dict[str, tuple[int, ...]]:
        """Draft tokens for the decoding requests of this step (none without a proposer).

        A request proposes at most as many tokens as its `max_tokens` and `max_model_len`
        leave room for after the target's own token, and none while it backs off
        (`SpecState`)."""
        self.spec_plan = {}
        if self.proposer is None:
            return {}
        wanted: list[tuple[Request, int]] = []
        decodes = [r for r in order if r.num_tokens - r.num_computed_tokens == 1]
        value = self.step_costs.token_value(len(decodes))
        for r in decodes:
            if r.pool or r.spec is None:
                continue
            room = min(
                r.max_tokens - len(r.output_token_ids) - 1,
                self.max_model_len - r.num_tokens - 1,
                self.proposer.num_speculative_tokens,
            )
            if room > 0:
                room = r.spec.num_drafts(room, value)
            if room > 0:
                wanted.append((r, room))
        if not wanted:
            return {}
        try:
            return self.proposer.propose(wanted)
        except Exception:  # noqa: BLE001  (drafts are an optimisation: the step goes on)
            logger.exception("speculative decoding: the proposer failed; decoding without drafts")
            for request, _ in wanted:
                self.proposer.forget(request.request_id)
            return {}

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """Time of a step that ran: decode-only steps (drafts or not) feed the step-cost fit
        that sizes drafts."""
        if self.proposer is not None and all(
            r.num_new_tokens - len(r.spec_token_ids) == 1 and not r.pool for r in plan.requests
        ):
            self.step_costs.observe(plan.num_tokens, seconds)

    def _allocate(self, request: Request, total: int) -> bool:
        """Blocks for the request's first `total` positions, if free ones are there."""
        allocated = self.block_manager.allocate(
            request.request_id, request.all_token_ids, total, extra=request.cache_salt
        )
        return allocated is not None

    def _allocate_or_preempt(
        self, request: Request, num_new: int, done: set[str], preempted: list[str]
    ) -> bool:
        total = request.num_computed_tokens + num_new
        while True:
            if self._allocate(request, total):
                return True
            victim = next(r for r in reversed(self.running) if r.request_id not in done)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False

    def _preempt(self, request: Request, count: bool = True) -> None:
        self.running.remove(request)
        self._free_blocks(request, keep_hashes=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if count:
            request.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(request)

    def rollback(self, plan: StepPlan) -> None:
        """Undo `plan`, whose step failed before `update` (an exception in the model, a
        `MemoryError`, a `KeyboardInterrupt`): the K/V it was to write are missing or partial.

        The blocks registered for it leave the prefix cache, and each of its requests goes back
        to the front of the waiting queue (in plan order) without blocks, to recompute its
        tokens when it is next admitted, as a preempted request does. Requests outside the plan
        are untouched: their blocks were filled by steps that ran.
        """
        self.block_manager.drop_pending()
        for item in reversed(plan.requests):
            request = self.requests.get(item.request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self._preempt(request, count=False)

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        return request.lora_id is None or request.lora_id in loras or len(loras) < self.max_loras

    def _admit_waiting(
        self, budget: int, scheduled: list[tuple[Request, int]], loras: set[int]
    ) -> int:
        num_encoder_tokens = 0  # in this step's encoder pass
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self._lora_fits(request, loras):
                break  # arrival order: later requests wait too
            if request.pool and request.num_tokens > budget:
                break  # embeddings run whole: wait for a step with room
            rid, tokens, salt = request.request_id, request.all_token_ids, request.cache_salt
            num_enc = request.num_encoder_tokens
            if num_enc and num_encoder_tokens + num_enc > self.max_num_batched_tokens:
                if num_encoder_tokens:
                    break  # the next step's encoder pass
            # Cross blocks are the request's own: never a prefix hit, so not cached.
            enc = request.encoder_token_ids or [0] * num_enc
            if num_enc and (
                self.block_manager.allocate(cross_key(rid), enc, num_enc, cache=False) is None
            ):
                break
            # An embedding's hidden states, and prompt logprobs, need every token computed:
            # no prefix hits.
            recompute = request.pool or request.params.prompt_logprobs is not None
            hits = [] if recompute else self.block_manager.match_prefix(rid, tokens, salt)
            num_hit = len(hits) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_hit, budget)
            # An embedding's K/V are never a prefix hit (pool requests recompute; a bidirectional
            # encoder's K/V depend on the whole text): not cached, so its blocks are reused first.
            if (
                self.block_manager.allocate(
                    rid, tokens, num_hit + num_new, hits, salt, cache=not request.pool
                )
                is None
            ):
                if num_enc:
                    self.block_manager.free(cross_key(rid))
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
            num_encoder_tokens += num_enc
            if request.lora_id is not None:
                loras.add(request.lora_id)
        return budget

    def _scheduled(self, request: Request, num_new: int, admitted: bool) -> ScheduledRequest:
        start = request.num_computed_tokens
        enc = request.encoder_token_ids
        cross: dict[str, Any] = {}
        if request.num_encoder_tokens:
            cross = dict(
                encoder_token_ids=tuple(enc) if admitted and enc is not None else (),
                cross_block_ids=self.block_manager.block_ids(cross_key(request.request_id)),
                num_encoder_tokens=request.num_encoder_tokens,
                images=request.images,
                encode_images=admitted and request.images is not None,
            )
        draft = self.spec_plan.get(request.request_id, ())
        ends = start + num_new - len(draft) == request.num_tokens
        # Views of the request's own lists, not copies: a step must not cost time that grows
        # with the sequence (the scheduler changes them only in `update`, after the step).
        return ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=start,
            token_ids=tuple(request.all_token_ids[start : start + num_new - len(draft)]) + draft,
            spec_token_ids=draft,
            block_ids=self.block_manager.block_ids(request.request_id),
            sample=ends and not request.pool,
            params=request.params,
            generator=request.generator,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            lora_id=request.lora_id,
            pool=request.pool,
            controls=request.controls,
            grammar=request.grammar,
            **cross,
        )

    def update(self, plan: StepPlan, output: RunnerOutput) -> tuple[list[Request], list[Request]]:
        """Advance computed counts, store embeddings, append sampled tokens (detokenized, with
        logprobs), and finish requests on EOS, stop ids, stop strings, length, or their own
        error (`output.errors`). Also commits the step's pending prefix-cache blocks.

        Returns (requests that got a new token or an embedding, requests that finished).
        """
        self.block_manager.commit()  # the step ran: its blocks hold their K/V
        updated: list[Request] = []
        finished: list[Request] = []
        for item in plan.requests:
            request = self.requests[item.request_id]
            accepted = output.accepted.get(item.request_id, ())
            # Rejected draft tokens' K/V are not the sequence's: positions past the accepted
            # ones are computed again (overwritten) by later steps.
            rejected = len(item.spec_token_ids) - len(accepted)
            request.num_computed_tokens += item.num_new_tokens - rejected
            if item.spec_token_ids and request.spec is not None:
                request.spec.record(len(item.spec_token_ids), len(accepted))
                self.num_drafts += 1
                self.num_draft_tokens += len(item.spec_token_ids)
                self.num_accepted_tokens += len(accepted)
            error = output.errors.get(item.request_id)
            if error is not None:
                status: RequestStatus | None = RequestStatus.FINISHED_ERROR
            elif item.pool:
                request.embedding = output.pooled[item.request_id]
                status = RequestStatus.FINISHED_STOPPED
            else:
                prompt_lps = output.prompt_logprobs.get(item.request_id)
                if prompt_lps is not None:
                    self._append_prompt_logprobs(request, *prompt_lps)
                token = output.sampled.get(item.request_id)
                if token is None:
                    continue
                tokens = [*accepted, token]
                lps = output.spec_logprobs.get(item.request_id)
                if lps is None:
                    lps = [None] * len(accepted) + [output.logprobs.get(item.request_id)]
                # Accepted draft tokens, then the target's own: each checked for stops as if it
                # came from a step of its own; tokens after a stop are dropped.
                status = None
                for t, lp in zip(tokens, lps, strict=True):
                    request.append_output_token(t)
                    try:
                        status = self._process_token(request, t, lp)
                    except Exception as e:  # noqa: BLE001  (this request's tokenizer)
                        status = RequestStatus.FINISHED_ERROR
                        error = f"processing output token {t}: {type(e).__name__}: {e}"
                    if status is not None:
                        break
                if rejected and status is None:
                    # Blocks that held only rejected positions go back to the pool.
                    self.block_manager.trim(request.request_id, request.num_tokens)
            updated.append(request)
            if status is not None:
                self.finish_request(request.request_id, status, error)
                finished.append(request)
        return updated, finished

    def _process_token(
        self, request: Request, token: int, logprobs: TokenLogprobs | None
    ) -> RequestStatus | None:
        """Logprobs, stop checks and detokenization of a newly appended token; the status it
        finishes the request with, if any."""
        if logprobs is not None:
            self._append_logprobs(request, logprobs)
        if request.grammar is not None and not request.grammar.accept(token):
            raise ValueError(f"token {token} is outside the request's structured-output grammar")
        status = self._check_stop(request, token)
        # vLLM's V1 detokenizer: the text of the token a request stops on (EOS, a stop token
        # id, another EOS id of the generation config) is not part of `text` unless
        # include_stop_str_in_output; its id stays in the token ids.
        drop_text = (
            status is RequestStatus.FINISHED_STOPPED
            and not request.params.include_stop_str_in_output
        )
        if status is None and request.grammar is not None and request.grammar.terminated:
            status = RequestStatus.FINISHED_STOPPED  # the document is complete
        stop = None if drop_text else self._detokenize(request, token)
        if stop is not None and status is None:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if status is not None and stop is None and request.detokenizer is not None:
            request.detokenizer.flush()
            request.text = request.detokenizer.text
        return status

    @staticmethod
    def _detokenize(request: Request, token: int) -> str | None:
        """Append `token` to the request's text; returns the stop string it completed, if any
        (the text then ends before it, or after it with `include_stop_str_in_output`)."""
        detok = request.detokenizer
        if detok is None:
            return None
        num_new_chars = detok.append(token)
        params = request.params
        if len(request.output_token_ids) <= params.min_tokens:  # as vLLM: none matched yet
            request.text = detok.text
            return None
        stop = find_stop_string(
            detok.text, num_new_chars, params.stop_strings, params.include_stop_str_in_output
        )
        request.text = stop[0] if stop is not None else detok.text
        return stop[1] if stop is not None else None

    @staticmethod
    def _logprob_entry(request: Request, lp: TokenLogprobs) -> dict[int, Logprob]:
        tokenizer = request.detokenizer.tokenizer if request.detokenizer is not None else None
        return {
            t: Logprob(v, r, str(tokenizer.decode([t])) if tokenizer is not None else None)
            for t, v, r in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True)
        }

    def _append_prompt_logprobs(
        self, request: Request, first: int, entries: list[TokenLogprobs]
    ) -> None:
        """Prompt positions `first`, `first + 1`, ... (position 0 has none: None); positions
        already recorded (recomputed after a preemption) are skipped."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        for j, lp in enumerate(entries):
            if first + j == len(request.prompt_logprobs):
                request.prompt_logprobs.append(self._logprob_entry(request, lp))

    def _append_logprobs(self, request: Request, lp: TokenLogprobs) -> None:
        entry = self._logprob_entry(request, lp)
        if request.logprobs is None:
            request.logprobs = []
        request.logprobs.append(entry)
        request.cumulative_logprob = (request.cumulative_logprob or 0.0) + lp.logprobs[0]

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """vLLM's order: below min_tokens only the length limits apply; then the model's EOS,
        stop tokens (the generation config's other EOS ids among them), the length limits."""
        params = request.params
        if len(request.output_token_ids) >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_ids or (
                not params.ignore_eos and token in request.other_eos_ids
            ):
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
