"""Ctrl-C (SIGINT) and SIGTERM for the command line: at any moment, one line on stderr
(`weld: interrupted` / `weld: terminated`) and exit status 130 / 143.

Why not let KeyboardInterrupt do it. Python raises it in the main thread at the next bytecode,
and from there:
- a long C++ call (an XLA compile) must return first;
- it can land in a callback whose exceptions are printed and dropped (jax's gc callback): the
  run carries on to the end, status 0;
- it unwinds into interpreter finalization while XLA's threads still run: SIGSEGV (no Python
  frame left) in 2 tries of 10 on the bundled model (docs/reliability.md, "Interrupts").

So the handler does not raise (but under `raising()`, below); it leaves. Two paths see each signal: the Python handler, which
runs in the main thread once that thread runs Python again, and a watcher thread woken through
`signal.set_wakeup_fd`, which acts when the main thread has not handled the signal within
`GRACE_S` (it is inside a C++ call that released the GIL). Whichever acts first flushes stdout
and stderr (bounded in time), prints the line and calls `os._exit`, which skips finalization,
atexit handlers and C++ static destructors while other threads still run. Files are safe as
long as they are written under a temporary name and renamed (convert's shards, train-draft's
checkpoints and drafter): an exit leaves at most a stale temporary file.

Three commands need a signal to mean something else for a while: `raising()` (the main thread
raises `Interrupted`, so that `input()` under readline restores the terminal), `sigint_stops()`
(Ctrl-C stops a chat reply, not the chat) and `foreign()` (uvicorn's own handlers own the
signals while it serves and drains).
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterator, NoReturn

from weld.utils.progress import progress_enabled

MESSAGES = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
GRACE_S = 0.25  # how long the watcher leaves a signal to the main thread's handler
FLUSH_TIMEOUT_S = 2.0  # a flush blocked on a full pipe (or a lock the interrupted code holds) gives up


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


class Interrupted(BaseException):
    """Raised in the main thread under `raising()`. A BaseException, as KeyboardInterrupt, so
    that `except Exception` does not stop it; `weld.cli.main` turns it into `exit_now`."""

    def __init__(self, signum: int):
        super().__init__(MESSAGES.get(signum, f"signal {signum}"))
        self.signum = int(signum)


class Mode(enum.Enum):
    EXIT = "exit"  # the default: leave at once
    RAISE = "raise"  # the main thread raises Interrupted
    STOP = "stop"  # SIGINT sets the stop event; SIGTERM leaves
    FOREIGN = "foreign"  # another handler (uvicorn's) is installed; the watcher keeps out of its way


class _State:
    def __init__(self):
        self.lock = threading.RLock()  # reentrant: the handler may run while the main thread holds it
        self.mode = Mode.EXIT
        self.stop = threading.Event()
        self.seen = 0  # signals the watcher has read
        self.handled = 0  # signals the main thread's handler (or the watcher) has dealt with
        self.exit_lock = threading.Lock()  # taken by the thread that ends the process, never released
        self.exiting_thread: int | None = None


_state = _State()


def exit_now(signum: int) -> NoReturn:
    """Flushes stdout and stderr, prints `weld: interrupted` (or `terminated`) on stderr and ends
    the process with `exit_status(signum)`, without finalizing the interpreter."""
    if _state.exiting_thread == threading.get_ident():
        return  # a second signal while this thread is already on its way out: let it finish
    _state.exit_lock.acquire()  # another thread got here first: wait for it to end the process
    _state.exiting_thread = threading.get_ident()
    _flush(FLUSH_TIMEOUT_S)
    line = f"weld: {MESSAGES.get(signum, f'signal {signum}')}\n"
    try:
        if os.isatty(2) or progress_enabled():
            line = "\n" + line  # past the ^C the terminal echoed, or a progress line left open
        os.write(2, line.encode())
    except OSError:
        pass
    os._exit(exit_status(signum))


def _flush(timeout: float) -> None:
    """Flushes sys.stdout and sys.stderr in a helper thread, waiting at most `timeout` seconds:
    a reader that stopped reading, or a write the signal interrupted, must not turn into a hang."""

    def flush():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed pipe or a reentrant call: what was written is what's left
                pass

    helper = threading.Thread(target=flush, name="weld-flush", daemon=True)
    helper.start()
    helper.join(timeout)


def _on_signal(signum: int, frame) -> None:
    """The Python-level handler; runs in the main thread."""
    with _state.lock:
        _state.handled += 1
    mode = _state.mode
    if mode is Mode.STOP and signum == signal.SIGINT:
        _state.stop.set()
    elif mode is Mode.RAISE:
        raise Interrupted(signum)
    else:  # EXIT, STOP's SIGTERM, and FOREIGN's: uvicorn raises the signal again once it has drained
        exit_now(signum)


def _watch(reader: socket.socket) -> None:
    """The watcher thread: reads the signal numbers Python's C-level handler writes to the
    wakeup socket, and acts on those the main thread has not handled within GRACE_S."""
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:  # `handled()` closed the other end
            return
        for signum in data:
            if signum not in MESSAGES:
                continue
            with _state.lock:
                _state.seen += 1
                if _state.mode is Mode.FOREIGN:  # uvicorn's handler took it
                    _state.handled += 1
                    continue
            time.sleep(GRACE_S)
            with _state.lock:
                if _state.handled >= _state.seen:
                    continue
                _state.handled += 1
                mode = _state.mode
            if mode is Mode.STOP and signum == signal.SIGINT:
                _state.stop.set()
            elif mode is not Mode.RAISE and mode is not Mode.FOREIGN:  # RAISE: input() is about to raise
                exit_now(signum)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM end the process as `exit_now` does; on leaving,
    the previous handlers and wakeup fd come back. Only from the main thread (else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # set_wakeup_fd requires it
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = {signum: signal.signal(signum, _on_signal) for signum in MESSAGES}
    watcher = threading.Thread(target=_watch, args=(reader,), name="weld-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(previous_fd)
        writer.close()
        watcher.join(1.0)
        reader.close()


@contextlib.contextmanager
def _mode(mode: Mode) -> Iterator[None]:
    with _state.lock:
        earlier, _state.mode = _state.mode, mode
    try:
        yield
    finally:
        with _state.lock:
            _state.mode = earlier


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """In the block, SIGINT and SIGTERM raise `Interrupted` in the main thread rather than end
    the process there: around `input()`, so that readline puts the terminal back first."""
    with _mode(Mode.RAISE):
        yield


@contextlib.contextmanager
def sigint_stops() -> Iterator[threading.Event]:
    """In the block, SIGINT sets the event it yields (cleared on entry) instead of ending the
    process; SIGTERM still ends it. The block polls the event (a chat reply, between deltas)."""
    _state.stop.clear()
    with _mode(Mode.STOP):
        yield _state.stop


@contextlib.contextmanager
def foreign() -> Iterator[None]:
    """In the block another library's handlers own SIGINT and SIGTERM (uvicorn drains the
    server on them): the watcher leaves them alone. uvicorn puts our handler back afterwards and
    raises the signal again, which then ends the process with the signal's status."""
    with _mode(Mode.FOREIGN):
        yield
