"""Compiles megakernel decode steps for a TPU with libtpu and no TPU, in a process of its own:
libtpu must be importable (`make install-test` puts it in .venv/libtpu, off the main
site-packages so that every other JAX start stays quiet) and JAX must stay on the CPU.

    JAX_PLATFORMS=cpu PYTHONPATH=.venv/libtpu python tests/kernels/megakernel_compile_run.py NAME...

NAME is a family of benchmarks/megakernel_lowering.py's TPU-width configs ("llama",
"deepseek_v3", ...; `megakernel.compile_for_tpu`, batch 8, bf16, v5e), "llama-verify" (a
4-token verify block), "llama-int8" (int8 weights with a short last row tile), or "control": a kernel whose DMA writes a slice off the 128-lane tiles,
which Mosaic rejects (the check can fail). Prints one JSON line per name: {"name", "ok",
"seconds", "error"}.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))


def control() -> None:
    """A DMA into a VMEM buffer's first 200 of 256 lanes: interpret mode and the lowering take
    it, Mosaic does not (the shape of the bug that SmolLM2's 576-wide tiles hit in a 1536-wide
    ring)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental import topologies
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf.at[:, pl.ds(0, 200)], sem.at[0])
        copy.start()
        copy.wait()
        o_ref[...] = buf[...]

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 256), jnp.float32),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          scratch_shapes=[pltpu.VMEM((8, 256), jnp.float32), pltpu.SemaphoreType.DMA((1,))])
    device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    sharding = NamedSharding(Mesh([device], ("one",)), PartitionSpec())
    jax.jit(call).trace(jax.ShapeDtypeStruct((8, 200), jnp.float32, sharding=sharding)).lower().compile()


def compile_one(name: str) -> None:
    from megakernel_lowering import CASES

    from weld.models import megakernel

    if name == "control":
        return control()
    family, _, variant = name.partition("-")
    cfg = next(c for key, (c, _) in CASES.items() if key.split(" ")[0] == family)
    weights = None
    if variant == "int8":  # int8 per channel, an MLP of 320 rows: a last row tile of 64 (its scales
        # under one lane tile), as SmolLM2's 576 outputs make
        cfg = dataclasses.replace(cfg, intermediate_size=320)
        weights = _int8_weights(cfg)
    megakernel.compile_for_tpu(cfg, batch=8, generation="v5e", weights=weights,
                               tokens_per_row=4 if variant == "verify" else 1)


def _int8_weights(cfg):
    """cfg's tree as `--quantization int8_channel` prepares it for the kernel (random values: only
    the shapes and dtypes reach the compiler)."""
    import jax.numpy as jnp
    import numpy as np
    from megakernel_tpu import family_of, int8_weights

    from weld.models.common.spec import map_specs
    from weld.models.family import WeightTarget

    family, rng = family_of(cfg), np.random.default_rng(0)
    raw = map_specs(lambda _, spec: jnp.asarray(rng.normal(0, 0.1, spec.shape), jnp.bfloat16), family.weight_specs(cfg))
    return family.prepare_weights(int8_weights(cfg, raw), cfg, WeightTarget(backend="megakernel"))


def main() -> None:
    for name in sys.argv[1:]:
        start = time.perf_counter()
        try:
            compile_one(name)
            error = None
        except Exception as e:  # reported, not raised: the test names the family and Mosaic's message
            text = str(e)
            at = text.find("Mosaic failed")
            error = f"{type(e).__name__}: {text[at:at + 2000] if at >= 0 else text[:2000]}"
        print(json.dumps({"name": name, "ok": error is None, "seconds": round(time.perf_counter() - start, 1),
                          "error": error}), flush=True)


if __name__ == "__main__":
    main()
