"""Output processing: the user requests in flight (a parent per request, a child `Request` per
parallel sample, `n`) and the outputs built from their children's state after each step, as
each request's `output_kind` asks (cumulative, delta, final only), with n > 1 aggregated and a
failed sequence named."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.runtime.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from ember.runtime.request import Request, RequestOutputKind, SamplingParams


@dataclass
class ParentRequest:
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


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    """The parents of the requests in flight, by id, and each child's parent. The engine adds
    and removes them; the scheduler owns the children's state."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, parent: ParentRequest) -> None:
        for child in parent.children:
            self.child_to_parent[child.request_id] = parent.request_id
        self.parents[parent.request_id] = parent

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forget the parent `request_id` (and its children); None if unknown."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for child in parent.children:
                self.child_to_parent.pop(child.request_id, None)
        return parent

    def outputs(
        self, updated: list[Request]
    ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """The outputs of the parents of `updated` children (each parent once)."""
        touched = dict.fromkeys(self.child_to_parent[r.request_id] for r in updated)
        return [out for pid in touched if (out := self.output(pid)) is not None]

    def output(self, parent_id: str) -> RequestOutput | EmbeddingRequestOutput | None:
        """The parent's output as its kind asks (None: nothing to emit this step); a finished
        parent is forgotten."""
        parent = self.parents[parent_id]
        finished = all(c.status.finished for c in parent.children)
        if finished:
            del self.parents[parent_id]
            for child in parent.children:
                self.child_to_parent.pop(child.request_id, None)
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


def _embedding_output(parent: ParentRequest) -> EmbeddingRequestOutput:
    embedding = parent.children[0].embedding
    assert embedding is not None
    return EmbeddingRequestOutput(
        parent.request_id, parent.prompt, parent.prompt_token_ids, EmbeddingOutput(embedding)
    )
