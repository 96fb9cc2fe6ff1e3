"""Speculative decoding's `draft_model` method: a smaller model with the target's vocabulary,
run by the same machinery as the target (an `LLMEngine` of its own: its compiled graphs, paged
KV cache and runner; its scheduler is unused), proposes k tokens greedily for each decoding
request.

The draft keeps its own K/V of each request's tokens between proposals. At a proposal it
computes the tokens it has not seen (the whole prompt the first time, in chunks of the step
budget; afterwards the target's accepted and corrected tokens, its rejected drafts being
overwritten), which gives the first draft token, then decodes the others one step per token,
all requests of the step batched together. Its KV budget is the target's `kv_cache_gib` shared
so that both caches hold the same number of tokens (`LLMEngine.from_config`). A request the
draft has no room for gets no drafts (it decodes plainly); finished requests free their draft
blocks (`Proposer.forget`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.runtime.batch import ScheduledRequest, StepPlan
from ember.runtime.request import SamplingParams
from ember.runtime.speculative import Proposer, SpeculativeConfig

if TYPE_CHECKING:
    from ember.runtime.config import EngineArgs, EngineConfig
    from ember.runtime.engine import LLMEngine


def draft_engine_args(config: EngineConfig, spec: SpeculativeConfig) -> EngineArgs:
    """The draft's engine knobs: the target's step shape, cache layout and compile settings,
    its own model and dtype (`kv_cache_gib` is set when both models are loaded)."""
    from ember.runtime.config import EngineArgs  # noqa: PLC0415  (config imports this module)

    assert spec.model is not None
    return EngineArgs(
        model=spec.model,
        kv_cache_gib=config.kv_cache_gib,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        seed=config.seed,
        compile=config.compile,
        compile_cache_dir=config.compile_cache_dir or "",
        freeze_weights=config.freeze_weights,
        background_compile=config.background_compile,
        token_buckets=config.token_buckets,
        cpu_isa=config.cpu_isa,
        load_format=config.load_format,
        generation_config="vllm",
    )


class DraftProposer(Proposer):
    """Greedy drafts from `engine` (the draft model's engine) for the target's requests."""

    def __init__(self, engine: LLMEngine, spec: SpeculativeConfig, target_vocab: int) -> None:
        if engine.vocab_size != target_vocab:
            raise ValueError(
                f"speculative_config.model={spec.model!r} has a vocabulary of "
                f"{engine.vocab_size} ids; the target model's has {target_vocab}: a draft "
                "model must share the target's tokenizer"
            )
        self.engine = engine
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.budget = engine.config.max_num_batched_tokens
        self.blocks = engine.block_manager
        self.greedy = SamplingParams(temperature=0.0, max_tokens=1)
        self.computed: dict[str, list[int]] = {}  # tokens whose K/V the draft holds

    def forget(self, request_id: str) -> None:
        self.blocks.free(request_id)
        self.computed.pop(request_id, None)

    def close(self) -> None:
        self.engine.close()

    def _item(self, rid: str, start: int, tokens: list[int], sample: bool) -> ScheduledRequest:
        return ScheduledRequest(
            rid, start, tuple(tokens), self.blocks.block_ids(rid), sample, self.greedy
        )

    def propose(self, wanted: list[tuple[Any, int]]) -> dict[str, tuple[int, ...]]:
        jobs: dict[str, tuple[list[int], int]] = {}  # rid -> (tokens, room)
        progress: dict[str, int] = {}  # rid -> tokens the draft holds K/V of
        for request, room in wanted:
            rid, tokens = request.request_id, request.all_token_ids
            held = self.computed.get(rid, [])
            start = min(len(held), len(tokens) - 1)  # the last token is always run
            while start and held[start - 1] != tokens[start - 1]:
                start -= 1  # drafts the target rejected
            # K/V for the tokens and every draft but the last.
            if self.blocks.allocate(rid, tokens, len(tokens) + room - 1, cache=False) is None:
                self.forget(rid)  # no room: this request decodes plainly this step
                continue
            jobs[rid] = (list(tokens), room)
            progress[rid] = start
        drafts: dict[str, list[int]] = {rid: [] for rid in jobs}
        # Catch up on the unseen tokens, in steps of at most the step budget.
        pending = list(jobs)
        while pending:
            budget, items, later = self.budget, [], []
            for rid in pending:
                tokens, start = jobs[rid][0], progress[rid]
                n = min(len(tokens) - start, budget)
                if n == 0:
                    later.append(rid)
                    continue
                end = start + n
                items.append(self._item(rid, start, tokens[start:end], end == len(tokens)))
                budget -= n
                progress[rid] = end
                if end < len(tokens):
                    later.append(rid)
            self._run(items, drafts)
            pending = later
        # Then one decode step per further draft token, all requests together.
        for j in range(1, max((room for _, room in jobs.values()), default=0)):
            items = [
                self._item(rid, len(tokens) + j - 1, [drafts[rid][-1]], True)
                for rid, (tokens, room) in jobs.items()
                if len(drafts[rid]) == j and room > j
            ]
            if not items:
                break
            self._run(items, drafts)
        for rid, (tokens, _) in jobs.items():
            self.computed[rid] = tokens + drafts[rid][:-1]
        return {rid: tuple(d) for rid, d in drafts.items() if d}

    def _run(self, items: list[ScheduledRequest], drafts: dict[str, list[int]]) -> None:
        if not items:
            return
        output = self.engine.runner.execute(StepPlan(tuple(items)))
        for rid, token in output.sampled.items():
            drafts[rid].append(token)
