"""One builder for the choices of `/v1/completions` and `/v1/chat/completions`, whole or
streamed, and the logprobs they carry.

`ChoiceBuilder` turns a request's engine outputs into the typed answer of `protocol`: `whole`
joins every output into one response, `chunks` turns each step's output into stream chunks.
Both build a text choice with `_text_choice` and a chat choice's logprobs and finish reason
with `_chat_logprobs` and `_finish_reason`. The chat message itself comes from
`ChatTools.answer` (whole) or `ChatStream.feed` (streamed), which `chat_outputs` keeps equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.runtime.outputs import Logprob, RequestOutput
from ember.serve.chat_outputs import ChatStream, ChatTools
from ember.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)

Chunk = CompletionChunk | ChatCompletionChunk


@dataclass
class ChoiceBuilder:
    """How one request's answer is written: a text completion, or a chat completion through
    `chat` (the server's tools and the request's tool mode). One per request: `chunks` keeps
    each streamed choice's state (its text offset or `ChatStream`) from step to step.
    Choice `p * n + i` is sequence `i` of prompt `p`."""

    rid: str
    model: str
    created: int
    n: int
    logprobs: int | None  # top logprobs per generated token (None: no logprobs)
    chat: tuple[ChatTools, Any] | None
    tokenizer: Any  # decodes an echoed token-id prompt (None: no tokenizer)
    # The stream's state: each text choice's offset of its next token, each chat choice's
    # answer so far, the prompts whose echo has been sent.
    _offsets: dict[int, int] = field(default_factory=dict, init=False)
    _answers: dict[int, ChatStream] = field(default_factory=dict, init=False)
    _echoed: set[int] = field(default_factory=set, init=False)

    # ---- whole ---------------------------------------------------------------------------
    def whole(
        self, outputs: list[list[RequestOutput]], echo: bool
    ) -> CompletionResponse | ChatCompletionResponse:
        """The response of every prompt's outputs (`outputs[p]`: prompt p's, in order);
        `echo`: each text choice starts with its prompt."""
        texts: dict[int, list[str]] = {}
        reasons: dict[int, str | None] = {}
        entries: dict[int, list[dict[int, Logprob]]] = {}
        echoes: dict[int, RequestOutput] = {}  # the output whose prompt each choice echoes
        prompt_tokens = completion_tokens = cached_tokens = 0
        for p, outs in enumerate(outputs):
            if outs:
                prompt_tokens += len(outs[0].prompt_token_ids)
                cached_tokens += outs[0].num_cached_tokens
            for out in outs:
                for c in out.outputs:
                    idx = p * self.n + c.index
                    texts.setdefault(idx, []).append(c.text)
                    entries.setdefault(idx, []).extend(c.logprobs or [])
                    completion_tokens += len(c.token_ids)
                    reasons[idx] = c.finish_reason
            if echo and outs:  # once per prompt, from its last output
                echoes.update((p * self.n + i, outs[-1]) for i in range(self.n))
        joined = {i: ("".join(texts[i]), entries[i], reasons[i]) for i in sorted(texts)}
        head = {"id": self.rid, "created": self.created, "model": self.model,
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}  # fmt: skip
        if self.chat:
            chat = [self._chat_choice(i, *joined[i]) for i in joined]
            return ChatCompletionResponse(**head, choices=chat)
        text = [self._echoed_choice(i, *joined[i], echoes.get(i)) for i in joined]
        return CompletionResponse(**head, choices=text)

    def _chat_choice(
        self, index: int, text: str, entries: list[dict[int, Logprob]], finish_reason: str | None
    ) -> ChatChoice:
        assert self.chat is not None
        message, called = self.chat[0].answer(self.chat[1], text)
        return ChatChoice(index=index, message=message, logprobs=self._chat_logprobs(entries),
                          finish_reason=_finish_reason(called, finish_reason))  # fmt: skip

    def _echoed_choice(
        self,
        index: int,
        text: str,
        entries: list[dict[int, Logprob]],
        finish_reason: str | None,
        echo: RequestOutput | None,
    ) -> CompletionChoice:
        """A whole text choice, after its prompt where `echo` gives one."""
        prompt = _prompt_text(self.tokenizer, echo) if echo is not None else ""
        prompt_lps = self._echo_logprobs(echo) if echo is not None else None
        return self._text_choice(index, prompt + text, entries, finish_reason, len(prompt),
                                 prompt_lps)  # fmt: skip

    # ---- streamed ------------------------------------------------------------------------
    def first_chunks(self) -> list[Chunk]:
        """What a stream opens with: a chat's assistant role, one choice per sequence."""
        if not self.chat:
            return []
        role = {"role": "assistant", "content": ""}
        return [self.chunk([ChatChunkChoice(index=i, delta=role) for i in range(self.n)])]

    def chunks(self, p: int, out: RequestOutput, echo: bool) -> list[Chunk]:
        """The stream chunks of prompt `p`'s output `out` (one engine step): its echoed
        prompt first (`echo`, once per prompt), each chat delta as a chunk of its own, then
        one chunk with the step's text choices or the chat choices that finished."""
        chunks: list[Chunk] = []
        if echo and p not in self._echoed:  # as vLLM streams echo
            self._echoed.add(p)
            chunks += [self.chunk([choice]) for choice in self._echo_choices(p, out)]
        together: list[CompletionChoice | ChatChunkChoice] = []
        for c in out.outputs:
            new_logprobs = self.logprobs is not None and bool(c.logprobs)
            if not c.text and c.finish_reason is None and not new_logprobs:
                continue
            idx = p * self.n + c.index
            if not self.chat:
                together.append(self._text_piece(idx, c.text, c.logprobs, c.finish_reason))
                continue
            alone, last = self._chat_pieces(idx, c.text, c.logprobs, c.finish_reason)
            chunks += [self.chunk([choice]) for choice in alone]
            if last is not None:
                together.append(last)
        return chunks + ([self.chunk(together)] if together else [])

    def chunk(
        self, choices: list[CompletionChoice | ChatChunkChoice], used: Usage | None = None
    ) -> Chunk:
        head = {"id": self.rid, "created": self.created, "model": self.model, "usage": used}
        if self.chat:
            return ChatCompletionChunk(**head, choices=choices)
        return CompletionChunk(**head, choices=choices)

    def _echo_choices(self, p: int, out: RequestOutput) -> list[CompletionChoice]:
        prompt = _prompt_text(self.tokenizer, out)
        prompt_lps = self._echo_logprobs(out)
        choices = []
        for idx in range(p * self.n, (p + 1) * self.n):
            self._offsets[idx] = len(prompt)
            choices.append(self._text_choice(idx, prompt, [], None, len(prompt), prompt_lps))
        return choices

    def _text_piece(
        self,
        index: int,
        text: str,
        entries: list[dict[int, Logprob]] | None,
        finish_reason: str | None,
    ) -> CompletionChoice:
        offset = self._offsets.get(index, 0)
        choice = self._text_choice(index, text, entries or [], finish_reason, offset)
        if choice.logprobs is not None:
            self._offsets[index] = offset + sum(len(t) for t in choice.logprobs.tokens)
        return choice

    def _chat_pieces(
        self,
        index: int,
        text: str,
        entries: list[dict[int, Logprob]] | None,
        finish_reason: str | None,
    ) -> tuple[list[ChatChunkChoice], ChatChunkChoice | None]:
        """(the step's deltas, one choice each; the closing choice once the answer ends)."""
        assert self.chat is not None
        if index not in self._answers:
            self._answers[index] = self.chat[0].stream(self.chat[1])
        answer = self._answers[index]
        final = finish_reason is not None
        deltas = answer.feed(text, final)
        lps = self._chat_logprobs(entries) if entries else None
        if lps is not None:  # the step's logprobs ride on its first delta
            deltas = deltas or [{}]
        pieces = [
            ChatChunkChoice(index=index, delta=delta, logprobs=lps if i == 0 else None)
            for i, delta in enumerate(deltas)
        ]
        if not final:
            return pieces, None
        reason = _finish_reason(answer.called, finish_reason)
        return pieces, ChatChunkChoice(index=index, delta={}, finish_reason=reason)

    # ---- one choice, whole or streamed ---------------------------------------------------
    def _text_choice(
        self,
        index: int,
        text: str,
        entries: list[dict[int, Logprob]],
        finish_reason: str | None,
        offset: int,
        prompt_lps: CompletionLogprobs | None = None,
    ) -> CompletionChoice:
        """A text choice: `text` with the logprobs of `entries` (the tokens after the first
        `offset` characters), after the echoed prompt's `prompt_lps`."""
        lps = None
        if self.logprobs is not None:
            lps = _completion_logprobs(entries, offset)
            if prompt_lps is not None:
                lps = _merge_logprobs(prompt_lps, lps)
        return CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=finish_reason)

    def _chat_logprobs(self, entries: list[dict[int, Logprob]]) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        return ChatLogprobs(content=_chat_logprobs(entries, self.logprobs))

    def _echo_logprobs(self, out: RequestOutput) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        return _prompt_logprobs(self.tokenizer, out.prompt_token_ids, out.prompt_logprobs)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens` as OpenAI (and vLLM)
    report the prompt tokens a cache held."""
    details = PromptTokensDetails(cached_tokens=cached_tokens)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=details)  # fmt: skip


def _finish_reason(called: bool, finish_reason: str | None) -> str | None:
    """A chat answer that holds tool calls finishes with "tool_calls"."""
    return "tool_calls" if called else finish_reason


def _prompt_text(tokenizer: Any, out: RequestOutput) -> str:
    """The prompt as text, for `echo` (a token-id prompt decoded)."""
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def _token_text(entry: dict[int, Logprob], token: int) -> str:
    lp = entry.get(token)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else ""


def _completion_logprobs(entries: list[dict[int, Logprob]], offset: int) -> CompletionLogprobs:
    """OpenAI's legacy completion logprobs of generated tokens: each entry's first key is
    the sampled token (ember's order), the rest its top alternatives; `offset`: where the
    first token's text starts in the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry in entries:
        sampled = next(iter(entry))
        text = _token_text(entry, sampled)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_lps.append(entry[sampled].logprob)
        tops.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                              text_offset=offsets)  # fmt: skip


def _prompt_logprobs(
    tokenizer: Any, prompt_ids: list[int], entries: list[dict[int, Logprob] | None] | None
) -> CompletionLogprobs:
    """The echoed prompt's legacy logprobs: its first token has none (None), as in vLLM."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for i, token in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        text = tokenizer.decode([token]) if tokenizer is not None else ""
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(entry[token].logprob if token in entry else None)
            tops.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                              text_offset=offsets)  # fmt: skip


def _merge_logprobs(prompt: CompletionLogprobs, out: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=prompt.tokens + out.tokens,
        token_logprobs=prompt.token_logprobs + out.token_logprobs,
        top_logprobs=prompt.top_logprobs + out.top_logprobs,
        text_offset=prompt.text_offset + out.text_offset,
    )


def _chat_logprobs(entries: list[dict[int, Logprob]], k: int) -> list[ChatTokenLogprob]:
    """OpenAI's chat logprobs: per generated token its text, logprob and bytes, and the
    `k` most likely tokens (by rank) in `top_logprobs`."""

    def item(lp: Logprob) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for entry in entries:
        sampled = next(iter(entry))
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        top_logprobs = [ChatTopLogprob(**item(lp)) for lp in top]
        content.append(ChatTokenLogprob(**item(entry[sampled]), top_logprobs=top_logprobs))
    return content
