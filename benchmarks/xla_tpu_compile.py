"""How long XLA takes to compile a model's forward step for a TPU, measured on a machine without one.

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=.venv/libtpu \\
        python benchmarks/xla_tpu_compile.py [--model "SmolLM2-135M, 30 layers"] [--generation v5e] 256x1 8x1 1x256

libtpu (`make install-test` puts the version this JAX pins in .venv/libtpu) compiles for a TPU
topology with no chip attached (`jax.experimental.topologies`), so the XLA backend's compile time
per program shape can be read here: the engine compiles one program per batch and chunk bucket
it meets, and on an accelerator each costs seconds. Shapes are ROWSxTOKENS of the step's input
(decode: B x 1; a prefill chunk: 1 x T). Prints one JSON line per shape: lowering and compile
seconds. The model is one of `megakernel_tpu.WIDE`'s shapes (random weights: only shapes matter).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def shape(text: str) -> tuple[int, int]:
    """ROWSxTOKENS, each a positive integer within the engine's limits (4,096 rows, 32,768 tokens)."""
    try:
        rows, tokens = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxTOKENS (e.g. 256x1)") from None
    if not (1 <= rows <= 4096 and 1 <= tokens <= 32768):
        raise argparse.ArgumentTypeError(f"{text!r}: rows must be 1..4096 and tokens 1..32768")
    return rows, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+", type=shape, help="ROWSxTOKENS, e.g. 256x1 (decode) or 1x256 (a prefill chunk)")
    ap.add_argument("--model", default="SmolLM2-135M, 30 layers", help="one of megakernel_tpu.WIDE's names")
    ap.add_argument("--generation", default="v5e", help="a TPU generation libtpu knows: v4, v5e, v5p, v6e")
    ap.add_argument("--pages", type=int, default=4096, help="KV pages of 16 tokens in the cache, 1..1048576")
    args = ap.parse_args()
    from megakernel_tpu import WIDE, family_of

    if args.model not in WIDE:
        ap.error(f"--model {args.model!r} is not one of {', '.join(map(repr, WIDE))}")
    if not 1 <= args.pages <= 1 << 20:
        ap.error(f"--pages {args.pages} is not in 1..1048576")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import weld.kernels.cpu as cpu_kernels
    from weld.models.common.cache import AttentionBatch
    from weld.models.common.spec import abstract_weights
    from weld.models.family import WeightTarget

    cpu_kernels.available = lambda: False  # the program is a TPU's: no native CPU kernels in it
    try:
        device = topologies.get_topology_desc(f"{args.generation}:2x2", "tpu").devices[0]
    except RuntimeError as err:  # no libtpu, or a generation it does not know
        ap.error(f"no TPU topology {args.generation}:2x2 ({err}); run with JAX_PLATFORMS=cpu "
                 "ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=.venv/libtpu (make install-test installs it)")
    one = NamedSharding(Mesh(np.array([device]), ("one",)), PartitionSpec())
    cfg = WIDE[args.model]
    family = family_of(cfg)
    weights = jax.eval_shape(lambda w: family.prepare_weights(w, cfg, WeightTarget(backend="xla")),
                             abstract_weights(family.weight_specs(cfg), jnp.float32))
    spec = family.cache_spec(cfg)
    cache = jax.eval_shape(lambda: spec.create(args.pages, 16, jnp.float32))
    place = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)  # noqa: E731
    step = jax.jit(lambda w, t, p, c, bt: family.forward(w, cfg, t, p, c, AttentionBatch(bt))[0:3:2],
                   donate_argnums=(3,))
    for rows, tokens in args.shapes:
        ids = jax.ShapeDtypeStruct((rows, tokens), jnp.int32, sharding=one)
        tables = jax.ShapeDtypeStruct((rows, 32 * len(spec.page_groups())), jnp.int32, sharding=one)
        start = time.perf_counter()
        lowered = step.trace(place(weights), ids, ids, place(cache), tables).lower()
        lowered_at = time.perf_counter()
        lowered.compile()
        print(json.dumps({"model": args.model, "generation": args.generation, "shape": [rows, tokens],
                          "lower_s": round(lowered_at - start, 1),
                          "compile_s": round(time.perf_counter() - lowered_at, 1)}), flush=True)


if __name__ == "__main__":
    main()
