"""`AsyncLLMEngine`: one engine loop on a background thread, requests from any thread or
coroutine, a stream of outputs per request.

`LLMEngine` is not thread-safe, so only the loop thread touches it: `add_request` and `abort`
post commands to the loop, which applies them between steps. With no request in flight the
loop sleeps on a condition variable (no busy waiting). Each request's outputs (DELTA kind:
only what is new) go to its own `asyncio.Queue` on the caller's event loop; `generate` yields
them and aborts the request when its consumer stops early (a client that disconnects), so its
KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from ember.errors import EngineOverloadedError
from ember.lora.adapter import LoRARequest
from ember.runtime.admission import HostMemoryBudget, request_bytes
from ember.runtime.engine import LLMEngine
from ember.runtime.input_processor import PromptType
from ember.runtime.outputs import RequestOutput
from ember.runtime.request import RequestOutputKind, SamplingParams
from ember.serve.metrics import EngineMetrics

logger = logging.getLogger("ember")

_DONE = object()  # end of a request's stream


class AsyncLLMEngine:
    """`budget`: admission by host memory (`HostMemoryBudget`): a request that would take the
    process past it is refused with `EngineOverloadedError` before it is queued."""

    def __init__(self, engine: LLMEngine, budget: HostMemoryBudget | None = None) -> None:
        self.engine = engine
        self.budget = budget
        self._cond = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.errored: BaseException | None = None
        self.metrics = EngineMetrics()
        self.metrics.step(engine)
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._thread.start()

    # ---- API (any thread / coroutine) ------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (only the new tokens and text of each step);
        the last one has `finished` set. Raises ValueError for bad input before yielding.
        Closing the iterator early (a cancelled task, a client gone) aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        added: Future = Future()
        self._post("add", (request_id, prompt, params, lora_request, loop, queue, added))
        await asyncio.wrap_future(added)  # raises the engine's ValueError
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def embed(self, request_id: str, prompt: PromptType) -> Any:
        """One prompt's embedding (`EmbeddingRequestOutput`); ValueError for bad input."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added: Future = Future()
        self._post("embed", (request_id, prompt, None, None, loop, queue, added))
        await asyncio.wrap_future(added)
        try:
            item = await queue.get()
        except BaseException:
            self.abort(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        if item is _DONE:
            raise RuntimeError(f"embedding request {request_id!r} was aborted")
        return item

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)
        store = self.engine.prefix_store
        if store is not None and not self._thread.is_alive():
            store.flush()  # the blocks of the last steps reach the disk before the exit

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # ---- the loop thread -------------------------------------------------------------------
    def _post(self, kind: str, payload: Any) -> None:
        with self._cond:
            if self._stopped:
                raise EngineOverloadedError("the server is shutting down")
            if self.errored is not None:
                raise RuntimeError("the engine loop is not running")
            self._commands.append((kind, payload))
            self._cond.notify()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while (
                    not self._stopped
                    and not self._commands
                    and not engine.has_unfinished_requests()
                ):
                    self._cond.wait()
                if self._stopped:
                    break
                commands, self._commands = self._commands, []
            for kind, payload in commands:
                self._apply(kind, payload)
            if not engine.has_unfinished_requests():
                self.metrics.step(engine)
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001  (the step was rolled back; fail its requests)
                logger.exception("engine step failed")
                for request_id in list(self._streams):
                    failed = engine.fail_request(request_id, f"{type(e).__name__}: {e}")
                    self._deliver(request_id, failed if failed is not None else _DONE)
                continue
            except BaseException as e:  # a fatal error: every stream learns of it
                self.errored = e
                for request_id in list(self._streams):
                    self._deliver(request_id, RuntimeError(f"the engine stopped: {e!r}"))
                raise
            for out in outputs:
                self._deliver(out.request_id, out)
            self.metrics.step(engine)

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "abort":
            self.engine.abort_request(payload)
            self.metrics.forget(payload, aborted=True)
            if payload in self._streams:
                self._deliver(payload, _DONE)
            return
        request_id, prompt, params, lora, loop, queue, added = payload
        try:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._admit(request_id, prompt, params)
            try:
                if kind == "embed":
                    self.engine.add_embed_request(request_id, prompt)
                else:
                    self.engine.add_request(request_id, prompt, params, lora)
            except BaseException:
                self._release(request_id)
                raise
        except Exception as e:  # noqa: BLE001  (bad input: the caller gets it, the loop goes on)
            added.set_exception(e)
            return
        self._streams[request_id] = (loop, queue)
        self.metrics.arrived(request_id)
        added.set_result(None)

    def _admit(self, request_id: str, prompt: PromptType, params: SamplingParams | None) -> None:
        """Reserve the request's host memory in the budget (EngineOverloadedError when full)."""
        if self.budget is None:
            return
        max_model_len = self.engine.config.max_model_len
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            size = len(ids) * 8 if isinstance(ids, list) else 0
            tokens = min(len(ids) if isinstance(ids, list) else 0, max_model_len)
        else:
            text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
            size = len(text.encode("utf-8", "replace")) if isinstance(text, str) else 0
            tokens = min(size, max_model_len)  # a token is one byte of text at the least
        params = params if params is not None else SamplingParams(max_tokens=1)
        self.budget.admit(request_id, request_bytes(params, size, tokens, max_model_len))

    def _release(self, request_id: str) -> None:
        if self.budget is not None:
            self.budget.release(request_id)

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        if isinstance(item, RequestOutput):
            self.metrics.output(item)
        done = item is _DONE or isinstance(item, BaseException) or item.finished
        if done:
            del self._streams[request_id]
            self._release(request_id)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            self.engine.abort_request(request_id)
