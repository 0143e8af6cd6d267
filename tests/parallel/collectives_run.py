"""Runs the megakernel's in-kernel all-reduce (`weld.kernels.megakernel.collectives`) in Pallas
TPU interpret mode on N virtual CPU devices, in a process of its own (the device count is fixed
when JAX starts), and prints one JSON line per case: the largest difference from
`jax.lax.psum`, whether every device holds the same bits, and whether the race detector fired.

    python tests/parallel/collectives_run.py DEVICES '[null, "skip_barrier", ...]'
"""

from __future__ import annotations

import json
import os
import sys

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from json_runs import interpret_races_found  # noqa: E402
from weld.kernels.megakernel import collectives  # noqa: E402



def run(bug):
    pltpu.reset_tpu_interpret_mode_state()
    params = pltpu.InterpretParams(dma_execution_mode="on_wait", uninitialized_memory="nan", detect_races=True)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("tp",))
    rows, cols = 4, 256  # a decode step's partial outputs: 4 tokens of hidden 256
    partials = jax.random.normal(jax.random.key(0), (DEVICES * rows, cols), jnp.float32)

    def reduce(x):
        return collectives.all_reduce(x, axis="tp", devices=DEVICES, interpret=params, _bug=bug)

    out = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))(partials)
    ref = np.asarray(partials).reshape(DEVICES, rows, cols).sum(axis=0)
    got = np.asarray(out).reshape(DEVICES, rows, cols)
    return {"bug": bug, "max_err": float(np.nan_to_num(np.abs(got - ref[None]), nan=np.inf).max()),
            "replicas_equal": bool(all(np.array_equal(got[0], g, equal_nan=True) for g in got)),
            "races": interpret_races_found()}


for case in json.loads(sys.argv[2]):
    print(json.dumps(run(case)), flush=True)
