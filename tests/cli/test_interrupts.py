"""Ctrl-C and SIGTERM end `weld` cleanly at every stage: status 130 / 143, `weld: interrupted` /
`weld: terminated` as stderr's last line, no traceback, no crash. Subprocesses on the tiny model
with a fresh compile cache each, the signal sent when stderr or stdout shows the stage (loading,
compiling, decoding, waiting for input, serving); then the handler modes, in this process."""

from __future__ import annotations

import os
import pty
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from weld.utils import interrupts

WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


class Run:
    """A `weld` subprocess whose stdout and stderr are read as they come, so that a test can
    wait for a stage's marker before it sends a signal. Every wait is bounded."""

    def __init__(self, *args: str, cache_dir, stdin=subprocess.DEVNULL):
        env = {**os.environ, "WELD_PROGRESS": "1", "JAX_PLATFORMS": "cpu", "WELD_CACHE_DIR": str(cache_dir)}
        self.proc = subprocess.Popen([sys.executable, "-m", "weld.cli", *args], stdin=stdin,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.out, self.err = bytearray(), bytearray()
        self._readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                         for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, into: bytearray) -> None:
        while chunk := stream.read1(65536):
            into += chunk

    def wait_for(self, test, timeout: float = 180) -> None:
        """Polls until test(self) holds; fails if the process ends first or time runs out."""
        deadline = time.monotonic() + timeout
        while not test(self):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the readers catch up, then look once more
                if test(self):
                    return
                pytest.fail(f"weld ended ({self.proc.returncode}) before the stage; stderr: {self.err.decode()[-2000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no stage after {timeout} s; stderr: {self.err.decode()[-2000:]}")
            time.sleep(0.02)

    def send(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def finish(self, timeout: float = 60) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            pytest.fail(f"weld still ran {timeout} s after the signal; stderr: {self.err.decode()[-2000:]}")
        for reader in self._readers:
            reader.join(10)
        return self.proc.returncode


def in_err(needle: bytes):
    return lambda run: needle in run.err


def compiled(run: Run) -> bool:
    """The compile status line is complete: `Compiling ... 6.4s`."""
    return re.search(rb"Compiling \.\.\.[^\n]* \d+\.\ds\n", run.err) is not None


def assert_clean_exit(run: Run, signum: int) -> str:
    status = run.finish()
    err = run.err.decode(errors="replace")
    assert status == 128 + signum, f"status {status}; stderr: {err[-3000:]}"
    assert err.splitlines()[-1] == f"weld: {WORDS[signum]}", err[-3000:]
    for bad in ("Traceback", "Exception ignored", "Segmentation fault", "KeyboardInterrupt"):
        assert bad not in err, err[-3000:]
    return err


def generate(model, cache_dir, *flags: str) -> Run:
    return Run("generate", "The quick brown fox", "--model", str(model), "--max-model-len", "256",
               "--temperature", "0", *flags, cache_dir=cache_dir)


def test_generate_interrupted_while_loading(tiny_llama_dir, tmp_path):
    run = generate(tiny_llama_dir[0], tmp_path / "cache")
    run.wait_for(in_err(b"loading"))
    run.send(signal.SIGINT)
    assert_clean_exit(run, signal.SIGINT)
    assert run.out == b""


def test_generate_interrupted_during_the_first_compile(tiny_llama_dir, tmp_path):
    """The crash this guards against was a race (SIGSEGV in 2 of 10 tries on the bundled model):
    three runs, each compiling from scratch, signalled at different points of the compile."""
    for i, (signum, delay) in enumerate([(signal.SIGINT, 0.0), (signal.SIGTERM, 0.2), (signal.SIGINT, 0.5)]):
        run = generate(tiny_llama_dir[0], tmp_path / f"cache{i}")
        run.wait_for(in_err(b"Compiling"))
        time.sleep(delay)
        run.send(signum)
        err = assert_clean_exit(run, signum)
        assert run.out == b"" and not compiled(run), f"run {i} was past compiling: {err[-1000:]}"


def test_generate_interrupted_while_decoding_keeps_the_text_so_far(tiny_llama_dir, tmp_path):
    # one token per device call: ~200 steps of decoding to land in
    run = generate(tiny_llama_dir[0], tmp_path / "cache", "--max-tokens", "200", "--steps-per-call", "1")
    run.wait_for(lambda r: len(r.out) > 0)
    run.send(signal.SIGINT)
    assert_clean_exit(run, signal.SIGINT)
    assert len(run.out) > 0


def test_piped_chat_terminated_while_waiting_for_input(tiny_llama_dir, tmp_path):
    run = Run("chat", "--model", str(tiny_llama_dir[0]), "--max-model-len", "256", stdin=subprocess.PIPE,
              cache_dir=tmp_path / "cache")
    try:
        run.wait_for(compiled)
        time.sleep(0.3)  # into input()
        run.send(signal.SIGTERM)
        assert_clean_exit(run, signal.SIGTERM)
    finally:
        run.proc.stdin.close()


def test_interactive_chat_ctrl_c_stops_the_reply_then_leaves_at_the_prompt(tiny_llama_dir, tmp_path):
    """On a terminal, Ctrl-C during a reply stops the reply and the chat goes on (the next prompt
    is answered); at the prompt it ends the chat with 130."""
    controller, terminal = pty.openpty()
    try:
        run = Run("chat", "--model", str(tiny_llama_dir[0]), "--max-model-len", "256", "--max-tokens", "200",
                  "--temperature", "0", "--steps-per-call", "1", stdin=terminal, cache_dir=tmp_path / "cache")
        run.wait_for(lambda r: r.out.endswith(b"> "))  # compiled, at the prompt
        os.write(controller, b"The quick brown fox\n")
        run.wait_for(lambda r: len(r.out) > len(b"> "))
        run.send(signal.SIGINT)
        run.wait_for(lambda r: b" [stopped]\n> " in r.out, timeout=60)
        os.write(controller, b"Paris\n")
        run.wait_for(lambda r: r.out.count(b"\n> ") == 2 and r.out.endswith(b"\n> "), timeout=120)
        time.sleep(0.3)  # into input()
        run.send(signal.SIGINT)
        assert_clean_exit(run, signal.SIGINT)
    finally:
        os.close(controller)
        os.close(terminal)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_interrupted_while_compiling_and_terminated_while_serving(tiny_llama_dir, tmp_path):
    """Before uvicorn runs, weld's handler ends `serve` at once; while it serves, uvicorn's own
    handler drains the server, and the exit still says so with 143."""
    flags = ("serve", "--model", str(tiny_llama_dir[0]), "--max-model-len", "256", "--log-level", "warning")
    run = Run(*flags, "--port", str(_free_port()), cache_dir=tmp_path / "cache0")
    run.wait_for(in_err(b"loading"))
    time.sleep(1.0)  # into the warmup's compile (serve prints no stage of its own until it serves)
    run.send(signal.SIGINT)
    assert_clean_exit(run, signal.SIGINT)
    assert b"serving" not in run.err

    run = Run(*flags, "--port", str(_free_port()), cache_dir=tmp_path / "cache1")
    run.wait_for(in_err(b"weld: serving"))
    time.sleep(1.0)  # into uvicorn's loop
    run.send(signal.SIGTERM)
    assert_clean_exit(run, signal.SIGTERM)


# ----- the handler's modes, in this process (no signal here ends the process) -----

def test_handled_restores_the_previous_handlers():
    before = {signum: signal.getsignal(signum) for signum in WORDS}
    with interrupts.handled():
        assert all(signal.getsignal(signum) is not before[signum] for signum in WORDS)
    assert {signum: signal.getsignal(signum) for signum in WORDS} == before
    assert signal.set_wakeup_fd(-1) == -1  # and no wakeup fd left behind


def test_sigint_stops_sets_the_event_and_the_process_goes_on():
    with interrupts.handled(), interrupts.sigint_stops() as stop:
        assert not stop.is_set()
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set()
        time.sleep(2 * interrupts.GRACE_S)  # the watcher, too, leaves it alone once handled


def test_raising_raises_interrupted_with_the_signal():
    with interrupts.handled():
        with pytest.raises(interrupts.Interrupted) as caught, interrupts.raising():
            signal.raise_signal(signal.SIGTERM)
        assert caught.value.signum == signal.SIGTERM
        time.sleep(2 * interrupts.GRACE_S)
