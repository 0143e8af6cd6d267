"""AsyncLLM: the engine on a background thread, streaming outputs to asyncio callers.

    engine = AsyncLLM(model=None)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)          # cumulative text so far, as in vLLM
    await engine.abort("r1")                 # or just stop iterating: the request is aborted
    engine.shutdown()

One thread owns the engine loop (`step()` = schedule, run, postprocess). Callers never wait
for a step: adds and aborts go into a pending list (under a short lock) that the engine thread
applies before its next step, so an event loop serving many streams is never blocked for the
length of a device call. Each request has an asyncio queue that the loop fills through
`call_soon_threadsafe`; a request the engine refuses gets its error through that queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, AsyncIterator

from weld.engine.llm import LLM, PromptType
from weld.engine.outputs import RequestOutput
from weld.engine.sampling_params import SamplingParams
from weld.utils.errors import InvalidInputError, WeldError


logger = logging.getLogger("weld.engine")


class EngineDeadError(WeldError):
    """The engine loop stopped (shut down, or crashed: the cause is chained)."""


class AsyncLLM:
    def __init__(self, model: str | None = None, dtype: Any = "auto", **engine_kwargs: Any):
        # The LLM's engine belongs to the loop thread from here on: use this object's methods,
        # never self.llm.generate, while it runs.
        self.llm = LLM(model=model, dtype=dtype, **engine_kwargs)
        self.tokenizer = self.llm.tokenizer
        self.engine = self.llm.engine
        self._lock = threading.Lock()  # the engine: held for a whole step
        self._wake = threading.Condition(threading.Lock())  # guards _pending and _stopping only
        self._pending: list[tuple] = []  # ("add", id, token_ids, params, text, stream) | ("abort", id)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._has_work = False  # the engine has unfinished requests (written by the engine thread)
        # request id -> time.monotonic() at the start of the step that gave its first output
        self._first_step_start: dict[str, float] = {}
        self._error: BaseException | None = None
        self.engine.on_stream = self._deliver_all  # streamed requests' tokens, from inside each device call
        self._thread = threading.Thread(target=self._loop, name="weld-engine", daemon=True)
        self._thread.start()

    def warmup(self, full: bool = False) -> None:
        """`LLM.warmup`, between the engine thread's steps (before serving requests)."""
        with self._lock:
            self.llm.warmup(full=full)

    # ----- the engine thread -----

    def _apply_pending(self) -> None:
        """Applies queued adds and aborts; the caller holds the engine lock."""
        with self._wake:
            pending, self._pending = self._pending, []
        for op, request_id, *rest in pending:
            if op == "add":
                token_ids, params, text, stream = rest
                try:
                    self.engine.add_request(request_id, token_ids, params, prompt=text, stream=stream)
                except WeldError as err:
                    self._deliver(err, request_id)
            else:
                out = self.engine.abort(request_id)
                if out is not None:
                    self._deliver(out)

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self._pending and not self._has_work:
                        self._wake.wait()
                    if self._stopping:
                        return
                with self._lock:
                    self._apply_pending()
                    started = time.monotonic()
                    outputs = self.engine.step() if self.engine.has_unfinished() else []
                    self._has_work = self.engine.has_unfinished()
                for out in outputs:
                    if out.request_id in self._streams:
                        self._first_step_start.setdefault(out.request_id, started)
                    self._deliver(out)
        except BaseException as err:  # a bug: fail every open stream instead of hanging them
            logger.exception("the engine loop failed; failing every open request")
            self._error = err
            for request_id in list(self._streams):
                self._deliver(err, request_id)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out)

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

    @property
    def error(self) -> BaseException | None:
        """What ended the engine thread, if a failure did."""
        return self._error

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Streams cumulative outputs of one request until it finishes: with stream, one every
        `stream_interval` tokens (from inside the device calls), else one per device call.

        Leaving the loop early (break, cancellation, a client disconnect) aborts the request
        and frees its pages.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._error
        text, token_ids = self.llm.encode_prompt(prompt)
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            if request_id in self._streams:
                raise InvalidInputError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._pending.append(("add", request_id, token_ids, sampling_params, text, stream))
            self._wake.notify()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, WeldError):
                    finished = True  # refused by the engine: it never held the request
                    raise item
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
            self._pending.append(("abort", request_id))
            self._wake.notify()

    def first_step_start(self, request_id: str) -> float | None:
        """`time.monotonic()` at the start of the engine step that produced the request's first
        output (for a prompt prefilled in one step: when it left the waiting queue), or None."""
        return self._first_step_start.get(request_id)

    async def abort(self, request_id: str) -> None:
        """Stops a request; its stream ends with finish_reason 'abort'."""
        self._abort(request_id)

    def stats(self) -> dict[str, Any]:
        """Engine counters, after any queued adds and aborts (waits for a running step)."""
        with self._lock:
            self._apply_pending()
            return self.engine.stats()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts whatever is left and stops the engine thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        with self._lock:
            self._apply_pending()
            for request_id in list(self.engine.requests):
                out = self.engine.abort(request_id)
                if out is not None:
                    self._deliver(out)
        self._thread.join(timeout)
