"""The soak (benchmarks/soak.py), short: concurrent streaming clients over a mixed workload with
n-gram speculation on, a fifth of them hanging up mid-stream; afterwards nothing runs, no KV page
is held, RSS is back near its warm level, and every completed request equals its serial result."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.server.conftest import run_server

SOAK = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_soak_with_disconnects(tiny_tool_model_dir, tmp_path):
    with run_server("--model", str(tiny_tool_model_dir), "--dtype", "float32", "--max-model-len", "512",
                    "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--kv-cache-memory-gb", "0.02",
                    "--steps-per-call", "4",
                    "--spec", "ngram", "--spec-k", "3", "--warmup", "full", "--served-model-name", "soak",
                    tmp_path=tmp_path, timeout=600) as server:
        out = tmp_path / "soak.json"
        run = subprocess.run([sys.executable, str(SOAK), "--url", server.url, "--pid", str(server.proc.pid),
                              "--requests", "80", "--concurrency", "8", "--max-words", "80", "--max-tokens", "24",
                              "--out", str(out)], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PYTHONPATH": str(SOAK.parents[1])})
        report = json.loads(out.read_text()) if out.exists() else None
        assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:], server.logs()[-3000:])
    assert report["passed"] and all(v is not False for v in report["checks"].values())
    assert report["disconnected"] >= 5 and report["compared"] >= 50
    assert all(report["kinds"][k] > 0 for k in ("completion", "chat", "json", "tools"))
    assert report["num_server_errors"] == report["num_client_errors"] == report["num_mismatches"] == 0
