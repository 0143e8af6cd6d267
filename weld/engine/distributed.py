"""Multi-host serving: one model over the devices of several hosts (vLLM's `--nnodes`).

Every rank runs the same SPMD program for every device call (`jax.distributed`: the devices of
all hosts form one mesh). Rank 0 schedules, serves HTTP and sends each call it makes, before
making it, to the other ranks; they run headless and replay it on their own weights and cache
(`ModelRunner.on_call` / `ModelRunner.replay`), so that the calls match on every host.

Ports, both on rank 0 (`--master-addr`):

    master_port       the JAX coordinator (`jax.distributed.initialize`; rank 0 hosts it)
    master_port + 1   the plan channel below (rank 0 listens, every other rank connects)

The plan channel is TCP, one connection per headless rank. A frame is

    b"WELD" | kind: 1 byte | length: 4 bytes, big-endian | payload: length bytes

with the payload bounded (`MAX_CALL_BYTES` for a call, `MAX_SMALL_BYTES` for the rest), so a
stray peer cannot make a process allocate gigabytes. Kinds, in the order they happen:

    HELLO  rank r -> 0  JSON {"rank", "nnodes"}: right after connecting, before the JAX runtime starts
    READY  rank r -> 0  JSON {"fingerprint"}: rank r built its LLM (the hash of its weight and cache
                        layouts and model config, which must equal rank 0's)
    CALL   0 -> rank r  pickle of (program name, arguments, static arguments): numpy arrays, the host
                        batch's dataclasses of them, tuples, None, `Own` markers; checked on load
                        against a short list of allowed types
    STOP   0 -> rank r  empty: rank 0 is exiting normally (or on SIGTERM); rank r exits 0
    ERROR  0 -> rank r  UTF-8 text: rank 0 refuses rank r (bad rank, other settings); rank r exits 1

Failures end the processes at once (`os._exit`: the main thread may be blocked in a collective that
will never complete), with one line on stderr and exit status 1: rank 0 when a headless rank's
connection drops, a headless rank when rank 0's drops. The plan channel carries pickles: it is
meant for the hosts' private network, like the JAX coordinator itself.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import pickle
import queue
import re
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from weld.config import ParallelConfig
from weld.utils.errors import WeldError

# Seconds every rank has to reach rank 0 (the plan channel and the JAX coordinator);
# $WELD_DISTRIBUTED_TIMEOUT overrides it.
CONNECT_TIMEOUT_S = 300.0
# Seconds rank 0 waits, once its own LLM is built, for the other ranks to build theirs.
READY_TIMEOUT_S = 1800.0
HEARTBEAT_TIMEOUT_S = 30  # jax.distributed: a rank silent this long is dead
SHUTDOWN_TIMEOUT_S = 10  # jax.distributed: how long a clean exit waits for the other ranks

MAGIC = b"WELD"
HEADER = struct.Struct("!4sBI")
HELLO, READY, CALL, STOP, ERROR = range(1, 6)
MAX_SMALL_BYTES = 64 << 10
MAX_CALL_BYTES = 1 << 30


class DistributedError(WeldError):
    """The ranks of a multi-host run could not meet, or disagree on what they run."""


class _OwnConfig:
    """Stands in a sent call for the model config (a static argument): each rank has its own, equal
    to rank 0's (the READY fingerprint says so)."""


# ----- frames -----

def _send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(HEADER.pack(MAGIC, kind, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """(kind, payload) of the next frame; ValueError for anything that is not one."""
    magic, kind, length = HEADER.unpack(_recv_exact(sock, HEADER.size))
    if magic != MAGIC or not HELLO <= kind <= ERROR:
        raise ValueError(f"not a weld plan-channel frame (header {magic!r}, kind {kind})")
    limit = MAX_CALL_BYTES if kind == CALL else MAX_SMALL_BYTES
    if length > limit:
        raise ValueError(f"a frame of kind {kind} of {length} bytes exceeds the limit of {limit}")
    return kind, _recv_exact(sock, length)


# What a CALL may unpickle: numpy arrays and scalars, the host batch's dataclasses, the markers.
_ALLOWED = {
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("weld.engine.batch", "SamplingArrays"), ("weld.engine.batch", "PenaltyArrays"),
    ("weld.engine.batch", "StopArrays"), ("weld.engine.runner", "Own"),
    ("weld.engine.distributed", "_OwnConfig"),
}


class _CallUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "numpy.dtypes" and name.endswith("DType")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a plan may not hold {module}.{name}")


def encode_call(name: str, args: list, static: dict, cfg: Any) -> bytes:
    """The CALL payload of one device call: jax arrays become numpy, `cfg` a marker."""
    args = jax.tree_util.tree_map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, args)
    static = {k: _OwnConfig() if v is cfg else v for k, v in static.items()}
    return pickle.dumps((name, args, static), protocol=pickle.HIGHEST_PROTOCOL)


def decode_call(payload: bytes, cfg: Any) -> tuple[str, list, dict]:
    name, args, static = _CallUnpickler(io.BytesIO(payload)).load()
    return name, args, {k: cfg if isinstance(v, _OwnConfig) else v for k, v in static.items()}


# ----- ending a process -----

_dying = threading.Lock()


def _die(message: str) -> None:
    """One line on stderr, exit status 1, now: no atexit handlers, no waiting for threads or collectives."""
    with _dying:
        try:
            sys.stderr.write(f"weld: error: {message}\n")
            sys.stderr.flush()
        finally:
            os._exit(1)


def _timeout(default: float) -> float:
    value = os.environ.get("WELD_DISTRIBUTED_TIMEOUT")
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise DistributedError(f"WELD_DISTRIBUTED_TIMEOUT must be a number of seconds > 0, got {value!r}")
    return seconds


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# ----- the channel -----

class Channel:
    """This process's end of the plan channel: rank 0's connections to every other rank, or a
    headless rank's connection to rank 0. Made by `initialize`; `attach` once the LLM is built."""

    def __init__(self, parallel: ParallelConfig):
        self.parallel = parallel
        self.rank = parallel.node_rank
        self.plan_port = parallel.master_port + 1
        self.cfg: Any = None  # the model config, stood in for by _OwnConfig in calls
        self._stopping = False
        self._send_lock = threading.Lock()
        # rank 0: rank -> (socket, peer "host:port"), and the READY fingerprints as they come
        self.peers: dict[int, tuple[socket.socket, str]] = {}
        self._ready: dict[int, str] = {}
        self._ready_changed = threading.Condition()
        # a headless rank: the connection to rank 0 and the frames read from it
        self.sock: socket.socket | None = None
        self.inbox: queue.Queue = queue.Queue()

    # -- rank 0 --

    def listen(self, timeout: float) -> None:
        """Accepts every other rank's HELLO on master_port + 1, then watches their connections."""
        n = self.parallel.nnodes
        try:
            server = _listen(self.plan_port)
        except OSError as err:
            raise DistributedError(f"rank 0 cannot listen on the plan port {self.plan_port} (--master-port + 1): "
                                   f"{err.strerror or err}") from None
        deadline = time.monotonic() + timeout
        with server:
            while len(self.peers) < n - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, n)) - set(self.peers))
                    raise DistributedError(
                        f"headless {_ranks(missing)} did not connect to rank 0's plan port {self.plan_port} within "
                        f"{timeout:.0f} s: start `weld serve --headless --node-rank R --nnodes {n} --master-addr "
                        f"<rank 0's address> --master-port {self.parallel.master_port}` on every other host")
                server.settimeout(left)
                try:
                    conn, address = server.accept()
                except socket.timeout:
                    continue
                self._greet(conn, f"{address[0].removeprefix('::ffff:')}:{address[1]}")
        for rank, (sock, peer) in self.peers.items():
            threading.Thread(target=self._watch, args=(rank, sock, peer), name=f"weld-rank-{rank}",
                             daemon=True).start()

    def _greet(self, conn: socket.socket, peer: str) -> None:
        """Keeps conn as its rank's connection if its HELLO is in order; else refuses it."""
        conn.settimeout(5.0)
        try:
            kind, payload = _recv_frame(conn)
            hello = json.loads(payload) if kind == HELLO else None
            rank, nnodes = hello["rank"], hello["nnodes"]
        except (OSError, EOFError, ValueError, TypeError, KeyError):
            conn.close()  # not a weld rank, or one that went away: wait for the real ones
            return
        n = self.parallel.nnodes
        problem = (f"it runs --nnodes {nnodes}, rank 0 --nnodes {n}" if nnodes != n else
                   f"--node-rank must be in [1, {n - 1}], got {rank}" if not (isinstance(rank, int) and 0 < rank < n)
                   else f"rank {rank} is already connected" if rank in self.peers else None)
        if problem is not None:
            try:
                _send_frame(conn, ERROR, f"rank 0 refused this rank: {problem}".encode())
            except OSError:
                pass
            conn.close()
            print(f"weld: refused a rank from {peer}: {problem}", file=sys.stderr)
            return
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peers[rank] = (conn, peer)

    def _watch(self, rank: int, sock: socket.socket, peer: str) -> None:
        """Rank 0's monitor of one headless rank: READY once, then nothing but the end of the connection."""
        while True:
            try:
                kind, payload = _recv_frame(sock)
            except (OSError, EOFError, ValueError) as err:
                if not self._stopping:
                    why = "disconnected" if isinstance(err, (EOFError, ConnectionError)) else f"failed ({err})"
                    _die(f"headless rank {rank} ({peer}) {why}; stopping")
                return
            if kind == READY:
                try:
                    fingerprint = json.loads(payload)["fingerprint"]
                except (ValueError, TypeError, KeyError):
                    fingerprint = "?"
                with self._ready_changed:
                    self._ready[rank] = fingerprint
                    self._ready_changed.notify_all()

    def send(self, name: str, args: list, static: dict) -> None:
        """`ModelRunner.on_call` on rank 0: the call to every other rank, before rank 0 makes it."""
        payload = encode_call(name, args, static, self.cfg)
        if len(payload) > MAX_CALL_BYTES:
            raise DistributedError(f"a {name} call of {len(payload)} bytes exceeds the plan channel's limit of "
                                   f"{MAX_CALL_BYTES}: lower --max-num-seqs or --max-num-batched-tokens")
        self._broadcast(CALL, payload)

    def _broadcast(self, kind: int, payload: bytes = b"") -> None:
        with self._send_lock:
            self._send_all(kind, payload)

    def _send_all(self, kind: int, payload: bytes) -> None:
        for rank, (sock, peer) in self.peers.items():
            try:
                _send_frame(sock, kind, payload)
            except OSError:
                if not self._stopping:
                    _die(f"headless rank {rank} ({peer}) disconnected; stopping")

    def close(self) -> None:
        """Rank 0's normal exit: tells every other rank to stop (they exit 0) and leaves the JAX
        runtime with them."""
        if self._stopping:
            return
        self._stopping = True
        # A SIGTERM can land while this very thread sends a call: then the lock never comes, no
        # STOP goes out, and the other ranks see rank 0 go away instead.
        if not self._send_lock.acquire(timeout=5.0):
            return
        try:
            self._send_all(STOP, b"")
        finally:
            self._send_lock.release()
        _shutdown_runtime()

    # -- a headless rank --

    def connect(self, timeout: float) -> None:
        """Reaches rank 0's plan port (retrying until timeout) and says HELLO; then reads its frames."""
        addr, port = self.parallel.master_addr, self.plan_port
        deadline = time.monotonic() + timeout
        last: OSError | None = None
        while self.sock is None:
            try:
                self.sock = socket.create_connection((addr, port), timeout=5.0)
            except OSError as err:
                last = err
                if time.monotonic() > deadline:
                    raise DistributedError(
                        f"rank {self.rank} cannot reach rank 0's plan port at {addr}:{port} within {timeout:.0f} s "
                        f"({last.strerror or last}): start rank 0 (`weld serve --nnodes {self.parallel.nnodes} "
                        f"--node-rank 0 ...`) with the same --master-addr and --master-port") from None
                time.sleep(0.2)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_frame(self.sock, HELLO, json.dumps({"rank": self.rank, "nnodes": self.parallel.nnodes}).encode())
        threading.Thread(target=self._read, name="weld-plans", daemon=True).start()

    def _read(self) -> None:
        """A headless rank's reader: frames into the inbox; rank 0 going away ends the process."""
        peer = f"{self.parallel.master_addr}:{self.plan_port}"
        while True:
            try:
                kind, payload = _recv_frame(self.sock)
            except (OSError, EOFError, ValueError) as err:
                why = "disconnected" if isinstance(err, (EOFError, ConnectionError)) else f"failed ({err})"
                _die(f"rank 0 ({peer}) {why}; stopping")
                return
            if kind == ERROR:
                _die(payload.decode("utf-8", "replace"))
            self.inbox.put((kind, payload))
            if kind == STOP:
                return

    # -- every rank --

    def attach(self, llm: Any) -> None:
        """Once the LLM is built: a headless rank says READY; rank 0 waits for every READY,
        checks the fingerprints and sends the runner's calls from then on."""
        runner = llm.engine.runner
        self.cfg = runner.cfg
        mine = fingerprint(llm)
        if self.rank:
            _send_frame(self.sock, READY, json.dumps({"fingerprint": mine}).encode())
            return
        timeout = READY_TIMEOUT_S
        deadline = time.monotonic() + timeout
        with self._ready_changed:
            while len(self._ready) < len(self.peers):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(self.peers) - set(self._ready))
                    raise DistributedError(f"headless {_ranks(missing)} did not finish loading the model within "
                                           f"{timeout:.0f} s of rank 0")
                self._ready_changed.wait(left)
        other = sorted(r for r, f in self._ready.items() if f != mine)
        if other:
            message = (f"{_ranks(other)} built a different engine than rank 0 (model, dtype, cache or parallel "
                       "settings): every rank must run the same model with the same flags")
            # Before the refusals go out: a refused rank exits at once, and its watcher here must
            # already know that exit is not a failure of its own (else it reports a disconnect).
            self._stopping = True
            for rank in other:
                try:
                    _send_frame(self.peers[rank][0], ERROR, message.encode())
                except OSError:
                    pass
            raise DistributedError(message)
        runner.on_call = self.send
        atexit.register(self.close)
        self._close_on_sigterm()

    def _close_on_sigterm(self) -> None:
        """SIGTERM's default action ends a process without atexit handlers (uvicorn re-raises it after
        a graceful shutdown): tell the other ranks to stop first, then let the earlier handler act."""
        if threading.current_thread() is not threading.main_thread():
            return
        earlier = signal.getsignal(signal.SIGTERM)

        def handler(sig, frame):
            self.close()
            if callable(earlier):
                earlier(sig, frame)
            else:
                signal.signal(sig, signal.SIG_DFL)
                signal.raise_signal(sig)

        signal.signal(signal.SIGTERM, handler)

    def run_headless(self, llm: Any) -> None:
        """Replays rank 0's calls on this rank's runner until rank 0 says STOP."""
        runner = llm.engine.runner
        while True:
            kind, payload = self.inbox.get()
            if kind == STOP:
                _shutdown_runtime()
                return
            if kind == CALL:
                name, args, static = decode_call(payload, self.cfg)
                runner.replay(name, args, static)


def fingerprint(llm: Any) -> str:
    """A hash of what every rank's programs depend on: the model config, the weights' and caches'
    shapes and dtypes, and the runner's settings."""
    runner = llm.engine.runner

    def layout(tree):
        return [(jax.tree_util.keystr(path), tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)))
                for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]

    parallel = llm.config.parallel
    parts = (repr(runner.cfg), layout(runner.weights), layout(runner.cache), layout(runner.draft_params),
             layout(runner.draft_state), type(runner.drafter).__name__, runner.steps_per_call, runner.num_spec_tokens,
             runner.spec_rounds, runner.eos_token_ids.tolist(), llm.config.backend,
             (parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.enable_expert_parallel,
              parallel.expert_tensor_parallel_size, parallel.nnodes))
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(parts))  # an object's address differs from rank to rank
    return hashlib.sha256(text.encode()).hexdigest()


_left = threading.Event()  # this process left the JAX runtime in step with the other ranks


def _shutdown_runtime() -> None:
    """Leaves the JAX runtime together with the other ranks (a barrier, at most SHUTDOWN_TIMEOUT_S):
    a rank that just exits takes the coordinator with it (rank 0) or is reported dead, and JAX
    aborts the ranks still running."""
    _left.set()
    try:
        jax.distributed.shutdown()
    except Exception as err:  # noqa: BLE001 - exiting anyway; say why it was not clean
        print(f"weld: warning: leaving the JAX runtime: {err}", file=sys.stderr)


def _exit_unless_left() -> None:
    """At exit, a rank that did not stop in step with the others (an error before rank 0's STOP)
    ends now with status 1: JAX's own exit would wait for the other ranks at its shutdown
    barrier, then abort the process with pages of logs."""
    if not _left.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# ----- the entry points -----

def _listen(port: int) -> socket.socket:
    """A socket listening on every address (IPv4 and IPv6 where the host has both), as JAX's coordinator does."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _check_port_free(port: int) -> None:
    try:
        with _listen(port):
            pass
    except OSError as err:
        raise DistributedError(f"rank 0 cannot host the JAX coordinator on --master-port {port}: "
                               f"{err.strerror or err}") from None


def initialize(parallel: ParallelConfig) -> Channel:
    """Meets the other ranks on the plan channel, then starts the JAX runtime over every host
    (`jax.distributed.initialize`). Call it before anything touches a JAX backend."""
    if jax.distributed.is_initialized():
        raise DistributedError("jax.distributed is already initialized in this process: one multi-host LLM "
                               "per process")
    timeout = _timeout(CONNECT_TIMEOUT_S)
    channel = Channel(parallel)
    if parallel.node_rank == 0:
        _check_port_free(parallel.master_port)
        channel.listen(timeout)
    else:
        channel.connect(timeout)
    # Every rank has reached rank 0, which starts the coordinator next: this connects at once
    # (JAX aborts the process, with no way to catch it, when it cannot).
    try:
        jax.distributed.initialize(f"{parallel.master_addr}:{parallel.master_port}", num_processes=parallel.nnodes,
                                   process_id=parallel.node_rank, initialization_timeout=max(1, round(timeout)),
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                                   shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    except RuntimeError as err:  # e.g. this process already ran JAX computations
        raise DistributedError(f"cannot start the JAX runtime over {parallel.nnodes} hosts: {err}") from None
    atexit.register(_exit_unless_left)  # before any handler registered later, which run first
    devices = jax.device_count()
    if parallel.world_size != devices:
        raise DistributedError(
            f"over {parallel.nnodes} hosts the model must use every device: tensor_parallel_size x "
            f"data_parallel_size is {parallel.world_size}, the hosts have {devices} "
            f"({jax.local_device_count()} on this one)")
    return channel


def run_headless(llm: Any) -> None:
    """The loop of a rank > 0: replays every call rank 0 sends on this rank's own weights and
    cache, until rank 0 stops."""
    channel = getattr(llm, "channel", None)
    if channel is None or channel.rank == 0:
        raise DistributedError("run_headless needs the LLM of a rank > 0 of a multi-host run (nnodes > 1)")
    channel.run_headless(llm)
