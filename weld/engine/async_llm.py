"""AsyncLLM: the engine on a background thread, streaming outputs to asyncio callers.

    engine = AsyncLLM(model=None)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)          # cumulative text so far, as in vLLM
    await engine.abort("r1")                 # or just stop iterating: the request is aborted
    engine.shutdown()

One thread owns the engine loop (`step()` = schedule, run, postprocess); callers add and
abort requests under a lock, so the engine is never touched by two threads at once. Each
request has an asyncio queue that the loop fills through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator

from weld.engine.llm import LLM, PromptType
from weld.engine.outputs import RequestOutput
from weld.engine.sampling_params import SamplingParams
from weld.utils.errors import InvalidInputError, WeldError


class EngineDeadError(WeldError):
    """The engine loop stopped (shut down, or crashed: the cause is chained)."""


class AsyncLLM:
    def __init__(self, model: str | None = None, dtype: Any = "auto", **engine_kwargs: Any):
        # The LLM's engine belongs to the loop thread from here on: use this object's methods,
        # never self.llm.generate, while it runs.
        self.llm = LLM(model=model, dtype=dtype, **engine_kwargs)
        self.tokenizer = self.llm.tokenizer
        self.engine = self.llm.engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        # request id -> time.monotonic() at the start of the step that gave its first output
        self._first_step_start: dict[str, float] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="weld-engine", daemon=True)
        self._thread.start()

    # ----- the engine thread -----

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self.engine.has_unfinished():
                        self._wake.wait()
                    if self._stopping:
                        return
                    started = time.monotonic()
                    outputs = self.engine.step()
                for out in outputs:
                    if out.request_id in self._streams:
                        self._first_step_start.setdefault(out.request_id, started)
                    self._deliver(out)
        except BaseException as err:  # a bug: fail every open stream instead of hanging them
            self._error = err
            for request_id in list(self._streams):
                self._deliver(err, request_id)

    def _deliver(self, item: RequestOutput | BaseException, request_id: str | None = None) -> None:
        request_id = request_id or item.request_id
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is gone
                self._streams.pop(request_id, None)

    # ----- the public API -----

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Streams cumulative outputs of one request until it finishes.

        Leaving the loop early (break, cancellation, a client disconnect) aborts the request
        and frees its pages.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._error
        text, token_ids = self.llm._prompt_ids(prompt)
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            if request_id in self._streams:
                raise InvalidInputError(f"request id {request_id!r} is already in use")
            self.engine.add_request(request_id, token_ids, sampling_params, prompt=text)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._wake.notify()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop failed") from item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            self._first_step_start.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        with self._wake:
            out = self.engine.abort(request_id)
        if out is not None:
            self._deliver(out)

    def first_step_start(self, request_id: str) -> float | None:
        """`time.monotonic()` at the start of the engine step that produced the request's first
        output (for a prompt prefilled in one step: when it left the waiting queue), or None."""
        return self._first_step_start.get(request_id)

    async def abort(self, request_id: str) -> None:
        """Stops a request; its stream ends with finish_reason 'abort'."""
        self._abort(request_id)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.engine.stats()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts whatever is left and stops the engine thread."""
        with self._wake:
            self._stopping = True
            for request_id in list(self.engine.requests):
                out = self.engine.abort(request_id)
                if out is not None:
                    self._deliver(out)
            self._wake.notify()
        self._thread.join(timeout)
