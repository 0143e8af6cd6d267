"""Peak host memory of loading the default model: streaming one tensor at a time must keep it well
under 3x the loaded weights (a load-everything-then-convert loader needs about 3x or more)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

# Run in a fresh interpreter so that ru_maxrss is this load's peak and nothing else's.
SCRIPT = """
import json, resource, sys
import jax, numpy as np
import weld.weights, weld.weights.gguf
jax.block_until_ready(jax.device_put(np.ones(8, np.float32)) * 2)  # start the backend: part of the baseline
loaded = 0
if sys.argv[1] == "load":
    model = weld.weights.load_model(None, dtype="float32", progress=False)
    leaves = jax.tree.leaves(model.weights)
    jax.block_until_ready(leaves)
    loaded = sum(x.nbytes for x in leaves)
print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "loaded": loaded}))
"""


def peak(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=REPO, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_of_loading_default_model(default_gguf):
    base, load = peak("baseline"), peak("load")
    loaded = load["loaded"]
    extra = (load["peak_kib"] - base["peak_kib"]) * 1024
    print(f"\nloaded {loaded / 2**20:.0f} MiB of f32 weights; peak RSS {load['peak_kib'] / 1024:.0f} MiB, "
          f"baseline {base['peak_kib'] / 1024:.0f} MiB, extra {extra / 2**20:.0f} MiB = {extra / loaded:.2f}x")
    assert loaded > 500 * 2**20  # 135M parameters at 4 bytes: the load really happened
    assert extra < 3 * loaded
