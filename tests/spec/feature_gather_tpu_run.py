"""Compiles training's feature gather (`train.gather_features`) for a TPU v5e with libtpu and no
TPU, in a process of its own, over the features as `train.resident_features` lays them on the
device (columns padded to LANES) and, as the control, as stored (SmolLM2's 1,728 columns):

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=.venv/libtpu python tests/spec/feature_gather_tpu_run.py

Prints one JSON line per layout: {"columns", "source_bytes", "temp_bytes"} (XLA's memory analysis
of the compiled program), then the same for the in-place copy of a slab of rows that builds the
padded array (`train.put_rows`; "program": "put_rows")."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from weld.engine.spec import train

ROWS, COLUMNS = 400_000, 1728  # 3 target layers of 576


def main() -> None:
    device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    one = NamedSharding(Mesh(np.array([device]), ("one",)), PartitionSpec())
    padded = -(-COLUMNS // train.LANES) * train.LANES
    rows = jax.ShapeDtypeStruct((16, 448), jnp.int32, sharding=one)
    for width in (padded, COLUMNS):
        source = jax.ShapeDtypeStruct((ROWS, width), jnp.float16, sharding=one)
        gather = jax.jit(train.gather_features, static_argnames="columns")
        compiled = gather.trace(source, rows, columns=COLUMNS).lower().compile()
        memory = compiled.memory_analysis()
        print(json.dumps({"columns": width, "source_bytes": ROWS * width * 2,
                          "temp_bytes": int(memory.temp_size_in_bytes)}), flush=True)
    out = jax.ShapeDtypeStruct((ROWS, padded), jnp.float16, sharding=one)
    slab = jax.ShapeDtypeStruct((1 << 16, padded), jnp.float16, sharding=one)
    start = jax.ShapeDtypeStruct((), jnp.int32, sharding=one)
    memory = train.put_rows.trace(out, slab, start).lower().compile().memory_analysis()
    print(json.dumps({"program": "put_rows", "columns": padded, "source_bytes": ROWS * padded * 2,
                      "temp_bytes": int(memory.temp_size_in_bytes)}), flush=True)


if __name__ == "__main__":
    main()
