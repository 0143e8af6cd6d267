"""Hand-overs: a decode or verify call's outputs so far, from inside its device loop to the host
(`programs.hand_over`), so that a streamed request's tokens go out as they are sampled.

Two ways out of the loop:
- on CPU with the native kernels, the loop queues a copy of its buffers in a C++ mailbox
  (`weld.kernels.cpu.stream_put`) and goes on without waiting; a reader thread here takes them
  in order (late, when the GIL or the cores are busy, but none is lost);
- elsewhere, an `io_callback` runs `HandOvers.deliver` from inside the loop, which waits for it.
  JAX keeps programs that hold Python callbacks out of its persistent compile cache, so there the
  decode and verify programs compile at every start, and it dispatches them through Python on
  every call, not jit's C++ path (milliseconds for a model's hundreds of weight arrays);
  `--stream-interval` >= `--steps-per-call` leaves the hand-over out of them. The native put
  has neither cost (`weld.kernels.cpu.stream_put`).

A call that streams opens a hand-over (`HANDOVERS.open`: the layout of the buffers it will hand
over, and a handler for them) before it runs, and closes it once its outputs are on the host.
`close` first lets the reader deliver what the loop already put (up to a second), so every
hand-over reaches its handler; once `close` returns, the handler never runs again for that call.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable, Sequence

import numpy as np

logger = logging.getLogger("weld.engine")

Layout = Sequence[tuple[tuple[int, ...], np.dtype]]  # each handed-over buffer's shape and dtype


class HandOvers:
    """The process's open hand-overs, by call id (every runner's calls: ids are unique here)."""

    def __init__(self):
        self._lock = threading.Lock()  # held by open and close, and while a handler runs
        self._open: dict[int, tuple[Layout, Callable[[list[np.ndarray]], None]]] = {}
        self._ids = itertools.count(1)
        self._reader: threading.Thread | None = None
        self._done = threading.Condition()  # the reader delivered up to self._done_seq
        self._done_seq = 0

    def open(self, layout: Layout, handler: Callable[[list[np.ndarray]], None], native: bool) -> int:
        """Registers a call about to run; returns its id (the program's `stream` argument)."""
        with self._lock:
            call_id = next(self._ids) & 0x7FFFFFFF
            self._open[call_id] = ([(tuple(s), np.dtype(d)) for s, d in layout], handler)
            if native and self._reader is None:
                self._reader = threading.Thread(target=self._read, name="weld-stream", daemon=True)
                self._reader.start()
        return call_id

    def close(self, call_id: int) -> None:
        if self._reader is not None:
            from weld.kernels import cpu

            put = cpu.stream_seq()
            with self._done:
                self._done.wait_for(lambda: self._done_seq >= put, timeout=1.0)
        with self._lock:
            self._open.pop(call_id, None)

    def deliver(self, call_id, *arrays: np.ndarray) -> None:
        """A hand-over of call `call_id` (the io_callback's host side, and the reader's)."""
        with self._lock:
            entry = self._open.get(int(call_id))
            if entry is None:  # closed: the call's outputs are already on the host
                return
            layout, handler = entry
            if [(a.shape, a.dtype) for a in arrays] != layout:  # e.g. one device's shard of a split batch
                return
            try:
                handler(list(arrays))
            except Exception:  # a bug: the call's end still brings every token
                logger.exception("handing over the outputs of a call in flight failed")

    def _parse(self, call_id: int, data: bytes) -> list[np.ndarray] | None:
        with self._lock:
            entry = self._open.get(call_id)
        if entry is None:
            return None
        arrays, offset = [], 0
        for shape, dtype in entry[0]:
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if offset + size > len(data):
                return None
            arrays.append(np.frombuffer(data, dtype, count=size // dtype.itemsize, offset=offset).reshape(shape))
            offset += size
        return arrays if offset == len(data) else None

    def _read(self) -> None:
        """The reader thread: never ends (a dead reader would make each streamed call wait for it)."""
        from weld.kernels import cpu

        take = cpu.stream_taker()
        while True:
            try:
                taken = take(timeout_s=1.0)
                if taken is None:
                    continue
                seq, call_id, data = taken
                arrays = self._parse(call_id, data)
                if arrays is not None:
                    self.deliver(call_id, *arrays)
            except Exception:  # a bug: keep reading
                logger.exception("reading the streaming mailbox failed")
                continue
            with self._done:
                self._done_seq = seq
                self._done.notify_all()


HANDOVERS = HandOvers()


def sink(native: bool) -> Callable:
    """The traced side, inside a device program: put(call_id, *buffers) -> call_id (see the
    module doc); a loop passes each put the id the last one returned, which keeps them in order."""
    if native:
        from weld.kernels import cpu

        return cpu.stream_put
    import jax
    from jax.experimental import io_callback

    def deliver(call_id, *arrays):
        HANDOVERS.deliver(call_id, *arrays)
        return np.asarray(call_id, np.int32)

    def put(call_id, *buffers):
        return io_callback(deliver, jax.ShapeDtypeStruct((), np.int32), call_id, *buffers)
    return put
