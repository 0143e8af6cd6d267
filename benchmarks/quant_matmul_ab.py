"""Two versions of the quantized matmul's sources side by side in one process: the working tree's
weld/kernels/cpu/ (quant_matmul.cc, parallel.h, half.h) against a git revision's, each built
into its own library and registered under its own FFI target, timed on interleaved rounds.

    python benchmarks/quant_matmul_ab.py --base HEAD~1 [--formats int4] [--rows 1,16] [--rounds 11] [--out F]

The chains are benchmarks/quant_matmul.py's: SmolLM2-135M's 30 layers of projections (distinct
copies, ~66 MB in int4, streamed from memory), and each projection's shape alone 30 times over
(the same weights: cache-resident, the per-call costs). Prints the median ms of a pass per
version and the median of the rounds' ratios to the base (below 1: the working tree is faster).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from weld.bench.roofline import machine_info
from weld.kernels import cpu as cpu_kernels
from weld.models.common import quant

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "weld" / "kernels" / "cpu"
FILES = ("quant_matmul.cc", "parallel.h", "half.h")
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def build(src: Path, out: Path, target: str) -> ctypes.CDLL:
    """Compiles src/quant_matmul.cc as weld does and registers its handler as `target`."""
    subprocess.run([cpu_kernels._compiler(), *cpu_kernels._FLAGS, "-march=native", "-shared", f"-I{jax.ffi.include_dir()}",
                    f"-I{src}", str(src / "quant_matmul.cc"), "-o", str(out)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.WeldQuantMatmul), platform="cpu")
    return lib


def matmul(target: str, x, w: quant.QuantWeight, isa: int):
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.n), jnp.float32))
    return call(x, w.codes, w.scales, jnp.zeros((0,), jnp.float16) if w.mins is None else w.mins,
                jnp.zeros((0,), jnp.int8) if w.lut is None else jnp.asarray(np.asarray(w.lut, np.int8)),
                bits=np.int64(w.bits), offset=np.float32(w.offset), isa=np.int64(isa), digits=np.int64(w.activation_digits),
                sub=np.int64(w.sub), group=np.int64(w.group), chunks=np.int64(cpu_kernels.STREAM_CHUNKS))


def chain(target: str, isa: int):
    def run(x, ws):
        for w in ws:
            y = matmul(target, x[:, :w.k], w, isa)
            x = x.at[:, :min(w.n, x.shape[1])].add(1e-6 * y[:, :min(w.n, x.shape[1])])
        return x
    return jax.jit(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision whose kernel sources are the base")
    ap.add_argument("--formats", default="int4")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows takes row counts separated by commas, got {args.rows!r}")
    if not 1 <= args.rounds <= 200 or any(not 1 <= r <= 256 for r in rows):
        ap.error("--rounds must be in [1, 200] and --rows in [1, 256]")
    formats = args.formats.split(",")
    if any(f not in ("int4", "int8") for f in formats):
        ap.error(f"--formats takes int4 and int8, got {args.formats!r}")
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"], cwd=ROOT,
                      capture_output=True).returncode != 0:
        ap.error(f"--base {args.base!r} is not a commit of this repository")
    if not cpu_kernels.available():
        ap.error(f"the CPU kernels are unavailable: {cpu_kernels._state.get('error')}")
    load_start = os.getloadavg()
    isa = cpu_kernels.ISAS.index(cpu_kernels.quant_isa())
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "base"
        base_dir.mkdir()
        for name in FILES:
            shown = subprocess.run(["git", "show", f"{args.base}:weld/kernels/cpu/{name}"], cwd=ROOT, check=True,
                                   capture_output=True)
            (base_dir / name).write_bytes(shown.stdout)
        targets = {"base": "weld_qm_ab_base", "tree": "weld_qm_ab_tree"}
        libs = [build(base_dir, Path(tmp) / "base.so", targets["base"]),  # noqa: F841 - kept loaded
                build(SRC, Path(tmp) / "tree.so", targets["tree"])]
        rng = np.random.default_rng(0)
        result = {"base": args.base, "isa": cpu_kernels.quant_isa(), "rounds": args.rounds, "cases": {}}
        for fmt in formats:
            one = {k: quant.quantize(rng.standard_normal(s, np.float32) * 0.05, fmt) for k, s in SHAPES.items()}
            copy = lambda a: None if a is None else jnp.array(a, copy=True)  # noqa: E731
            cases = {"30 layers": [quant.QuantWeight(copy(w.codes), copy(w.scales), copy(w.mins), w.n, w.k, w.fmt)
                                   for _ in range(LAYERS) for w in one.values()],
                     **{f"{k} x30 cached": [w] * LAYERS for k, w in one.items()}}
            for m in rows:
                x = jnp.ones((m, 3072), jnp.float32)
                progs = {}
                for case, ws in cases.items():
                    outs = {}
                    for version, target in targets.items():
                        progs[case, version] = chain(target, isa)
                        outs[version] = np.asarray(progs[case, version](x, ws))
                    np.testing.assert_allclose(outs["tree"], outs["base"], rtol=1e-4, atol=1e-5)
                times: dict = {}
                for _ in range(args.rounds):
                    for (case, version), prog in progs.items():
                        start = time.perf_counter()
                        prog(x, cases[case]).block_until_ready()
                        times.setdefault((case, version), []).append((time.perf_counter() - start) * 1e3)
                for case in cases:
                    base, tree = times[case, "base"], times[case, "tree"]
                    entry = {"base_ms": round(statistics.median(base), 3), "tree_ms": round(statistics.median(tree), 3),
                             "tree_vs_base": round(statistics.median(t / b for t, b in zip(tree, base)), 3)}
                    result["cases"][f"{fmt} {m} rows {case}"] = entry
                    print(f"{fmt:5s} {m:3d} rows  {case:18s} base {entry['base_ms']:8.3f} ms  tree {entry['tree_ms']:8.3f} ms"
                          f"  {entry['tree_vs_base']:.3f}x", flush=True)
    result["machine"] = machine_info(load_start)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
