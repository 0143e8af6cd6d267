"""Runs a script of tests/parallel in a subprocess (the device count is fixed when JAX starts,
and the test process has one device) and returns the JSON lines it printed, one dict each."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def run_script(name: str, *args: str, timeout: int = 900) -> list[dict]:
    proc = subprocess.run([sys.executable, str(HERE / name), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def interpret_races_found() -> bool:
    """The interpret-mode race detector's verdict in this process (tests/kernels/interpret_mode.py)."""
    sys.path.insert(0, str(HERE.parent / "kernels"))
    from interpret_mode import races_found

    return races_found()
