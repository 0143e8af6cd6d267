"""Training's feature gather compiled for a TPU v5e on this machine (libtpu, no TPU): laid out as
`train.resident_features` puts the features on the device (columns padded to whole 128-lane
tiles) it needs no temporary memory, where the features as stored (1,728 columns) make every
call copy the whole array (the control: 9 GB of them ran a v5e out of memory on 2026-12-07).
libtpu lives in .venv/libtpu (`make install-test`), used by a subprocess only."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
LIBTPU = pathlib.Path(sys.prefix) / "libtpu"

pytestmark = pytest.mark.skipif(not (LIBTPU / "libtpu").is_dir(),
                                reason=f"no libtpu in {LIBTPU} (`make install-test` installs it)")


def test_the_padded_features_gather_without_copying_them_and_the_stored_layout_would():
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               PYTHONPATH=f"{LIBTPU}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(HERE / "feature_gather_tpu_run.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    padded, stored, put = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert padded["columns"] % 128 == 0 and padded["temp_bytes"] < padded["source_bytes"] // 100, padded
    assert stored["columns"] % 128 and stored["temp_bytes"] >= stored["source_bytes"], stored  # the control
    assert put["program"] == "put_rows" and put["temp_bytes"] < put["source_bytes"] // 100, put
