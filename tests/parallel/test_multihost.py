"""Multi-host serving (`weld serve --nnodes`, `weld.engine.distributed`) on one machine: two
processes with one CPU device each stand for two hosts; rank 0 serves HTTP, rank 1 runs headless.

Their answers must be the one-process engine's; a rank that dies must take the other down at
once with one line on stderr; SIGTERM on rank 0 must stop rank 1 cleanly; ranks that built
different engines, bad flag combinations and unreachable ranks are one-line errors. The plan
channel's framing and its pickle allowlist are checked on their own, against fake peers.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from weld.utils.interrupts import exit_status

REPO = pathlib.Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--max-model-len", "96", "--block-size", "4", "--kv-cache-memory-gb", "0.004", "--max-num-seqs", "4",
                "--dtype", "float32"]
ENGINE = dict(dtype="float32", max_model_len=96, page_size=4, kv_cache_memory_gb=0.004, max_num_seqs=4)
PROMPT = "The quick brown fox jumps over the lazy dog."
START_TIMEOUT_S = 120.0
ERROR_LINE = "weld: error: "


def _port_is_free(port: int) -> bool:
    try:
        with socket.create_server(("", port)):
            return True
    except OSError:
        return False


def free_port(pair: bool = False) -> int:
    """A free TCP port (with pair, one whose successor is free too: the plan channel's)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair or (port < 65534 and _port_is_free(port + 1)):
            return port
    raise RuntimeError("no free port pair")


def child_env() -> dict[str, str]:
    """One CPU device per process (no inherited device count), no progress bars."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "WELD_DISTRIBUTED_TIMEOUT")}
    env.update(JAX_PLATFORMS="cpu", WELD_PROGRESS="0", PYTHONUNBUFFERED="1", WELD_DISTRIBUTED_TIMEOUT="60",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


@pytest.fixture
def spawn(tmp_path):
    """spawn(name, argv) -> Popen, its stderr in tmp_path/name.log; every process is killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                cwd=REPO, start_new_session=True)
        log.close()
        proc.log = tmp_path / f"{name}.log"  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def output(proc) -> str:
    return proc.log.read_text(errors="replace")


def start_pair(spawn, model_dir, headless_flags=(),
               layout=("--tensor-parallel-size", "2")) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    """Rank 0 (HTTP) and rank 1 (headless) of `weld serve --nnodes 2` with the layout flags
    (default -tp 2); returns them and the base URL."""
    master, http = free_port(pair=True), free_port()
    common = [sys.executable, "-m", "weld.cli", "serve", "--model", str(model_dir), *ENGINE_FLAGS,
              "--nnodes", "2", *layout, "--master-addr", "127.0.0.1", "--master-port", str(master)]
    headless = spawn("rank1", [*common, "--node-rank", "1", "--headless", *headless_flags])
    rank0 = spawn("rank0", [*common, "--node-rank", "0", "--port", str(http)])
    return rank0, headless, f"http://127.0.0.1:{http}"


def wait_healthy(url: str, procs) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"a rank exited with {proc.returncode} while starting:\n{output(proc)}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail("the two ranks did not come up in time:\n" + "\n".join(output(p) for p in procs))


def wait_exit(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {timeout:.0f} s later:\n{output(proc)}")


def assert_one_error_line(text: str, expected: str) -> None:
    errors = [line for line in text.splitlines() if line.startswith(ERROR_LINE)]
    assert len(errors) == 1 and expected in errors[0], text
    assert "Traceback" not in text and "Check failure" not in text, text


def test_two_ranks_answer_as_one_process_and_stop_when_a_rank_dies(spawn, tiny_llama_dir):
    import httpx

    from weld import LLM, SamplingParams

    model_dir, _ = tiny_llama_dir
    rank0, headless, url = start_pair(spawn, model_dir)
    # the one-process reference, computed while the ranks start
    llm = LLM(str(model_dir), **ENGINE)
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logprobs=1, prompt_logprobs=1))[0]
    wait_healthy(url, [rank0, headless])

    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    lp = choice["logprobs"]
    n_prompt, out = len(ref.prompt_token_ids), ref.outputs[0]
    assert choice["text"] == PROMPT + out.text
    assert len(lp["tokens"]) == n_prompt + len(out.token_ids) == n_prompt + 8
    want_prompt = [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ref.prompt_token_ids) if i > 0]
    want_out = [lps[t].logprob for t, lps in zip(out.token_ids, out.logprobs)]
    assert lp["token_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], want_prompt + want_out, atol=1e-4, rtol=0)
    want_top = [max(x.logprob for x in lps.values()) for lps in out.logprobs]
    got_top = [max(d.values()) for d in lp["top_logprobs"][n_prompt:]]
    np.testing.assert_allclose(got_top, want_top, atol=1e-4, rtol=0)

    headless.send_signal(signal.SIGKILL)
    code = wait_exit(rank0, 15.0)
    assert code == 1, output(rank0)
    assert_one_error_line(output(rank0), "headless rank 1 (127.0.0.1:")
    assert "disconnected; stopping" in output(rank0)


def test_data_parallel_over_two_hosts_answers_as_one_process(spawn, tiny_llama_dir):
    """-dp 2 over two hosts: each host's device is a data-parallel rank with its own sequences
    and its own pages; two prompts in one request land one on each and match one process."""
    import httpx

    from weld import LLM, SamplingParams

    model_dir, _ = tiny_llama_dir
    rank0, headless, url = start_pair(spawn, model_dir, layout=("--data-parallel-size", "2"))
    prompts = [PROMPT, "Paris is the capital of France. Paris is"]
    llm = LLM(str(model_dir), **ENGINE)
    refs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1))
    wait_healthy(url, [rank0, headless])
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    for choice, ref in zip(choices, refs):
        out = ref.outputs[0]
        assert choice["text"] == out.text
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"],
                                   [lps[t].logprob for t, lps in zip(out.token_ids, out.logprobs)], atol=1e-4, rtol=0)
    usage = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines()
             if line.startswith(("weld:kv_cache_usage_perc{", "weld:kv_cache_usage_perc "))]
    assert usage == [0.0]  # every page of both ranks came back


def test_sigterm_on_rank_0_stops_every_rank_cleanly(spawn, tiny_llama_dir):
    rank0, headless, url = start_pair(spawn, tiny_llama_dir[0])
    wait_healthy(url, [rank0, headless])
    rank0.send_signal(signal.SIGTERM)
    assert wait_exit(rank0, 30.0) == exit_status(signal.SIGTERM), output(rank0)  # as a one-host `weld serve`
    assert wait_exit(headless, 15.0) == 0, output(headless)
    assert ERROR_LINE not in output(headless) and "Check failure" not in output(headless), output(headless)


def test_ranks_with_other_engine_settings_are_refused(spawn, tiny_llama_dir):
    rank0, headless, _ = start_pair(spawn, tiny_llama_dir[0], headless_flags=["--kv-cache-memory-gb", "0.008"])
    expected = "rank 1 built a different engine than rank 0"
    for proc in (rank0, headless):
        assert wait_exit(proc, START_TIMEOUT_S) == 1, output(proc)
        assert_one_error_line(output(proc), expected)


@pytest.mark.parametrize("flags, expected", [
    (["--nnodes", "2", "--node-rank", "1"], "--node-rank 1 runs headless"),
    (["--nnodes", "2", "--node-rank", "2", "--headless"], "node_rank must be an integer in [0, 1], got 2"),
    (["--nnodes", "2", "--headless"], "--headless is for the ranks > 0"),
    (["--headless"], "--headless is for the ranks > 0"),
    (["--nnodes", "2", "--node-rank", "1", "--headless", "--master-port", "{port}"],
     "rank 1 cannot reach rank 0's plan port at 127.0.0.1:{plan}"),
    (["--nnodes", "3", "--master-port", "{port}"], "headless ranks 1, 2 did not connect to rank 0's plan port {plan}"),
])
def test_bad_multihost_flags_are_one_line_errors(flags, expected, tiny_llama_dir, capsys, monkeypatch):
    from weld.cli import main

    port = free_port(pair=True)
    monkeypatch.setenv("WELD_DISTRIBUTED_TIMEOUT", "0.5")
    fill = lambda s: s.format(port=port, plan=port + 1)  # noqa: E731
    code = main(["serve", "--model", str(tiny_llama_dir[0]), *ENGINE_FLAGS, *map(fill, flags)])
    assert code == 1
    assert_one_error_line(capsys.readouterr().err, fill(expected))


# ----- the plan channel on its own -----

def test_frames_are_bounded_and_calls_unpickle_only_allowed_types():
    from weld.engine import distributed
    from weld.engine.batch import StopArrays
    from weld.engine.runner import Own

    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!4sBI", b"WELD", distributed.HELLO, distributed.MAX_SMALL_BYTES + 1))
        with pytest.raises(ValueError, match="exceeds the limit"):
            distributed._recv_frame(b)
        a.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(ValueError, match="not a weld plan-channel frame"):
            distributed._recv_frame(b)

    cfg = object()
    ints = np.arange(3, dtype=np.int32)
    stop = StopArrays(max_steps=ints, num_output=ints, min_tokens=ints, ignore_eos=np.zeros(3, bool),
                      stop_ids=np.full((3, 2), -1, np.int32), eos_ids=np.array([2], np.int32))
    args = [Own(0), Own(1), np.arange(6, dtype=np.int32).reshape(2, 3), None, (np.ones(2, np.float32),), stop]
    name, got, static = distributed.decode_call(distributed.encode_call("decode", args, {"cfg": cfg, "steps": 4}, cfg),
                                                cfg)
    assert name == "decode" and static == {"cfg": cfg, "steps": 4}
    assert got[:2] == [Own(0), Own(1)] and got[3] is None
    np.testing.assert_array_equal(got[2], args[2])
    np.testing.assert_array_equal(got[5].stop_ids, stop.stop_ids)
    evil = pickle.dumps(("decode", [os.system], {}))
    with pytest.raises(pickle.UnpicklingError, match="may not hold"):
        distributed.decode_call(evil, cfg)


def test_rank_0_skips_stray_peers_and_refuses_bad_ranks():
    from weld.config import ParallelConfig
    from weld.engine import distributed

    port = free_port(pair=True)
    channel = distributed.Channel(ParallelConfig(nnodes=2, node_rank=0, master_port=port))
    done = threading.Event()
    failure: list[BaseException] = []

    def listen():
        try:
            channel.listen(timeout=20.0)
        except BaseException as err:  # noqa: BLE001
            failure.append(err)
        done.set()

    threading.Thread(target=listen, daemon=True).start()

    def connect() -> socket.socket:
        for _ in range(100):
            try:
                return socket.create_connection(("127.0.0.1", port + 1), timeout=5.0)
            except OSError:
                time.sleep(0.05)
        raise AssertionError("rank 0 never listened")

    def hello(sock, rank, nnodes=2):
        body = json.dumps({"rank": rank, "nnodes": nnodes}).encode()
        sock.sendall(struct.pack("!4sBI", b"WELD", distributed.HELLO, len(body)) + body)

    with connect() as stray:  # an HTTP client at the wrong port: dropped
        stray.sendall(b"GET / HTTP/1.1\r\n\r\n")
        try:
            assert stray.recv(100) == b""
        except ConnectionResetError:  # closed with the rest of the request unread
            pass
    for rank, nnodes, why in [(5, 2, "--node-rank must be in [1, 1], got 5"), (1, 3, "it runs --nnodes 3")]:
        with connect() as bad:
            hello(bad, rank, nnodes)
            kind, payload = distributed._recv_frame(bad)
            assert kind == distributed.ERROR and why in payload.decode()
    assert not done.is_set()
    good = connect()
    hello(good, 1)
    assert done.wait(10.0) and not failure, failure
    assert sorted(channel.peers) == [1]
    channel._stopping = True  # so that closing the test's end is not a rank dying
    good.close()


FAKE_HEADLESS = """
import sys
import types

from weld.config import ParallelConfig
from weld.engine import distributed
channel = distributed.Channel(ParallelConfig(nnodes=2, node_rank=1, master_port=int(sys.argv[1])))
channel.connect(20.0)
channel.run_headless(types.SimpleNamespace(engine=types.SimpleNamespace(runner=None)))
"""


def test_a_headless_rank_exits_at_once_when_rank_0_goes_away(spawn):
    port = free_port(pair=True)
    with socket.create_server(("127.0.0.1", port + 1)) as server:
        server.settimeout(60.0)
        headless = spawn("headless", [sys.executable, "-c", FAKE_HEADLESS, str(port)])
        conn, _ = server.accept()
        with conn:
            from weld.engine import distributed

            kind, payload = distributed._recv_frame(conn)
            assert kind == distributed.HELLO and json.loads(payload) == {"rank": 1, "nnodes": 2}
    assert wait_exit(headless, 15.0) == 1
    assert_one_error_line(output(headless), f"rank 0 (127.0.0.1:{port + 1}) disconnected; stopping")
