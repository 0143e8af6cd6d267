"""The quantized matmul kernel (weld/kernels/cpu/quant_matmul.cc) at the row counts decoding and
speculative verification use: how its time grows with the rows it multiplies at once.

    python benchmarks/quant_matmul.py [--formats int4,int8] [--rows 1,2,4,8,16] [--isa avx512vnni] [--runs 9]
        [--chunks 1,8] [--out F]

Each format's weights are SmolLM2-135M's 30 layers of projections (qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536; random values quantized by weld's own rule: "int4" is Q4_1's layout,
"int8" Q8_0's), ~66 MB in int4, so they stream from memory. One jitted chain multiplies x [rows,
in] by every matrix in turn (each product feeds the next input, so nothing overlaps or is
skipped), 4 passes per call. Prints, per row count, the median ms of a pass, the weight bytes streamed per second,
the multiply-adds per second and the time as a multiple of one row's: the figure a (k + 1)-row
verification step pays over a decode step (issue 18's target: at most ~1.3x for k <= 7).
--chunks: the pieces each thread's run of panels is claimed in (`cpu_kernels.STREAM_CHUNKS`);
several values run interleaved in one process, each row count's time then also as a multiple of
the first value's (the median of the rounds' ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from weld.bench.roofline import machine_info, measure_bandwidth
from weld.kernels import cpu as cpu_kernels
from weld.models.common import quant

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
MAX_ROWS, MAX_RUNS, MAX_CHUNKS = 256, 1000, 64
PASSES = 4  # passes over the weights per timed call


def weights(fmt: str, seed: int = 0) -> list[quant.QuantWeight]:
    """Every layer's projections, quantized once per shape and copied (distinct buffers, so a
    pass streams them all from memory)."""
    rng = np.random.default_rng(seed)
    one = {name: quant.quantize(rng.standard_normal(shape, np.float32) * 0.05, fmt) for name, shape in SHAPES.items()}
    copy = lambda a: None if a is None else jnp.array(a, copy=True)  # noqa: E731
    return [quant.QuantWeight(copy(w.codes), copy(w.scales), copy(w.mins), w.n, w.k, w.fmt)
            for _ in range(LAYERS) for w in one.values()]


def chain(isa: str, chunks: int = cpu_kernels.STREAM_CHUNKS):
    def mm(x, w):
        return cpu_kernels.quant_matmul(x[:, :w.k], w.codes, w.scales, w.mins, w.n, w.bits, w.offset, isa=isa,
                                        digits=w.activation_digits, sub=w.sub, lut=w.lut, group=w.group,
                                        chunks=chunks)

    def one_pass(_, x, ws):
        for w in ws:
            y = mm(x, w)
            x = x.at[:, :min(w.n, x.shape[1])].add(1e-6 * y[:, :min(w.n, x.shape[1])])
        return x

    @jax.jit
    def run(x, ws):  # PASSES passes per call: the call's own cost (360 arguments) is spread over them
        return jax.lax.fori_loop(0, PASSES, lambda i, x: one_pass(i, x, ws), x)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--isa", default=None, help=f"one of {', '.join(cpu_kernels.ISAS)} (default: the fastest this CPU runs)")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--chunks", default=str(cpu_kernels.STREAM_CHUNKS))
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
        chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        ap.error("--rows and --chunks take comma-separated integers")
    if (not rows or not all(1 <= r <= MAX_ROWS for r in rows) or not 1 <= args.runs <= MAX_RUNS
            or not chunks or not all(1 <= c <= MAX_CHUNKS for c in chunks)):
        ap.error(f"--rows must be in 1..{MAX_ROWS}, --chunks in 1..{MAX_CHUNKS} and --runs in 1..{MAX_RUNS}")
    if not cpu_kernels.available():
        ap.error("the native CPU kernels are off or unavailable")
    isa = args.isa or cpu_kernels.quant_isa()
    load = os.getloadavg()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(load), "isa": isa,
              "bandwidth": measure_bandwidth(), "command": "python benchmarks/quant_matmul.py " +
              f"--formats {args.formats} --rows {args.rows} --isa {isa} --runs {args.runs} --chunks {args.chunks}",
              "formats": {}}
    runs = {c: chain(isa, c) for c in chunks}
    for fmt in args.formats.split(","):
        ws = weights(fmt)
        nbytes = sum(w.nbytes for w in ws)
        macs = sum(w.n * w.k for w in ws)
        table = {}
        xs = {r: jnp.asarray(np.random.default_rng(r).standard_normal((r, 1536), np.float32)) for r in rows}
        cases = [(c, r) for c in chunks for r in rows]
        for c, r in cases:
            jax.block_until_ready(runs[c](xs[r], ws))  # compile
        times = {case: [] for case in cases}
        for _ in range(args.runs):  # interleaved: each round runs every case once
            for c, r in cases:
                t = time.perf_counter()
                jax.block_until_ready(runs[c](xs[r], ws))
                times[c, r].append(time.perf_counter() - t)
        for c, r in cases:
            s = float(np.median(times[c, r])) / PASSES
            base = float(np.median(times[c, rows[0]])) / PASSES
            paired = float(np.median(np.array(times[c, r]) / np.array(times[chunks[0], r])))  # round by round
            key = str(r) if len(chunks) == 1 else f"{r} chunks {c}"
            table[key] = {"ms": round(s * 1e3, 3), "weight_gb_s": round(nbytes / s / 1e9, 1),
                          "gmac_s": round(r * macs / s / 1e9, 1), f"x_rows_{rows[0]}": round(s / base, 2)}
            vs = ""
            if len(chunks) > 1:
                table[key][f"x_chunks_{chunks[0]}"] = round(paired, 3)
                vs = f"  {paired:5.3f}x chunks {chunks[0]}"
            print(f"{fmt:5s} rows {r:3d} chunks {c:2d}: {s * 1e3:7.2f} ms  {nbytes / s / 1e9:5.1f} GB/s  "
                  f"{r * macs / s / 1e9:6.1f} GMAC/s  {s / base:5.2f}x rows {rows[0]}{vs}", flush=True)
        result["formats"][fmt] = {"weight_mb": round(nbytes / 2**20, 1), "rows": table}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
