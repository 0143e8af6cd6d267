"""Peak host memory of loading the default model: streaming one tensor at a time keeps the growth
of peak RSS over a started-backend baseline at about 1x the loaded f32 weights, and the test holds
it under 1.25x.

Measured on the 2-core CPU box (SmolLM2-135M, 513 MiB of f32 weights, 7 runs): extra 512-520 MiB,
i.e. 1.00-1.01x; RSS noise between runs is about +-5 MiB. 1.25x is the measured maximum plus ~25%
(about 128 MiB of slack, roughly one transient copy of the largest tensor, the 113 MiB tied
embedding): robust to the noise, and it fails for a loader that keeps a second copy of the weights
(tried by holding a numpy copy of every leaf after the load: 1.70x; a load-everything-then-convert
loader needs 2-3x)."""

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
    model = weld.weights.load_model(None, dtype="float32", progress=False, quantization="none")
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
    assert extra < 1.25 * loaded, f"peak RSS grew {extra / loaded:.2f}x the loaded weights (measured ~1.01x)"


# The same for a weld checkpoint, with the peak of the load alone (VmHWM reset just before it,
# Linux's clear_refs): the mapped shards' pages are dropped as each tensor is copied out
# (weld.utils.memory.release_mapped), so the process holds the quantized weights about once.
WELD_SCRIPT = """
import json, sys
import jax, numpy as np
from weld.weights import load_model
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
jax.block_until_ready(jax.device_put(np.ones(8, np.float32)) * 2)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
model = load_model(sys.argv[1], progress=False)
leaves = jax.tree.leaves(model.weights)
jax.block_until_ready(leaves)
print(json.dumps({"extra": status("VmHWM:") - before, "loaded": sum(x.nbytes for x in leaves)}))
"""


def test_peak_rss_of_loading_a_weld_checkpoint(tmp_path):
    """Measured: +114-118 MiB for 97 MB of Q4_1/Q8_0 blocks (1.17-1.22x, benchmarks/load_memory.py);
    without dropping the mapped pages it was 2.14x. The bound is the issue's 1.3x plus noise."""
    from weld.weights import native

    native.convert(None, tmp_path / "w", progress=False)
    out = subprocess.run([sys.executable, "-c", WELD_SCRIPT, str(tmp_path / "w")], capture_output=True, text=True,
                         check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=REPO, timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nloaded {result['loaded'] / 1e6:.0f} MB; peak grew {result['extra'] / 1e6:.0f} MB = "
          f"{result['extra'] / result['loaded']:.2f}x")
    assert result["loaded"] > 90e6  # the blocks really were loaded
    assert result["extra"] < 1.4 * result["loaded"]


# Loading and preparing the bundled GGUF (kept quantized, as `weld serve` holds it) compiles no XLA
# program. Until 2026-12-07 it compiled 13 (`jnp.asarray` of each shape of packed codes,
# `jnp.concatenate` of each fused projection's parts): ~0.3 s of the load, and ~20 MB an `LLM`
# held until JAX's caches were next cleared.
COMPILES_SCRIPT = """
import json, logging
import jax
from weld.engine.llm import WeightTarget
from weld.weights import load_model
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("jax").addHandler(handler)
jax.config.update("jax_log_compiles", True)
model = load_model(None, dtype="float32", progress=False)
weights = model.family.prepare_weights(model.weights, model.cfg, WeightTarget.on_this_host("xla", "float32", True))
jax.block_until_ready(jax.tree.leaves(weights))
print(json.dumps([m.split(" with ")[0] for m in records if m.startswith("Compiling")]))
"""


def test_loading_the_default_gguf_compiles_no_program(default_gguf):
    out = subprocess.run([sys.executable, "-c", COMPILES_SCRIPT], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=REPO, timeout=120)
    programs = json.loads(out.stdout.strip().splitlines()[-1])
    assert programs == [], f"the loader compiled {len(programs)} programs: {programs}"
