"""Loading and converting, side by side: wall time and peak resident memory of each load path of
one model, against llama.cpp loading the same GGUF, each in a fresh interpreter.

    python benchmarks/load_memory.py [--model GGUF] [--runs 3] [--out results/load_memory_DATE.json]

Cases (weld's with the JAX CPU backend started first, so the baseline holds the runtime):
  gguf-kept       load_model(GGUF): the file's Q4_*/Q5_*/Q8_0 blocks kept
  gguf-int8       load_model(GGUF, quantization="int8"): dequantized and quantized tensor by tensor
  weld-kept       load_model(weld checkpoint of the kept blocks)   (`weld convert`)
  weld-int4       load_model(weld checkpoint quantized int4)
  weld-f32>int8   load_model(weld checkpoint of f32 tensors, quantization="int8"): a float
                  checkpoint quantized as it is read (the HF int8 path)
  convert-int8    weld convert GGUF -> int8 checkpoint
  llama.cpp       llama_cpp.Llama(GGUF, n_ctx=512), the load only
Peak memory is the peak resident set during the load (VmHWM, reset just before it) minus the
resident set before it (after importing and starting JAX, or importing llama_cpp); it counts the
mapped file pages a load touched. The ratio
column divides it by the bytes of the weights the load leaves on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

SCRIPT = r"""
import json, sys, time
case, model, path = sys.argv[1], sys.argv[2], sys.argv[3]
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
def reset_peak():  # VmHWM := VmRSS (Linux clear_refs "5"), so the peak is this load's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS:")
def rss(): return status("VmHWM:")
if case == "llama.cpp":
    import llama_cpp
    before = reset_peak(); t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_threads=2, verbose=False)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "peak_extra": rss() - before, "weights": None}))
    sys.exit(0)
import jax, numpy as np
jax.block_until_ready(jax.device_put(np.ones(8, np.float32)) * 2)
from weld.weights import load_model, native
before = reset_peak(); t = time.perf_counter()
if case.startswith("convert-"):
    native.convert(model, path, quantization=case.split("-", 1)[1], progress=False)
    weights = None
else:
    quantization = {"gguf-int8": "int8", "weld-f32>int8": "int8"}.get(case)
    loaded = load_model(path if case.startswith("weld") else model, quantization=quantization, progress=False)
    leaves = jax.tree.leaves(loaded.weights)
    jax.block_until_ready(leaves)
    weights = sum(x.nbytes for x in leaves)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "peak_extra": rss() - before, "weights": weights}))
"""


def run(case: str, model: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, case, model, path], capture_output=True, text=True,
                         check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from weld.bench.roofline import machine_info
    from weld.weights import default_model_path, native

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_start = os.getloadavg()
    model = str(args.model or default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {mode: str(pathlib.Path(tmp) / mode) for mode in ("kept", "int4", "none", "scratch")}
        for mode in ("kept", "int4", "none"):
            native.convert(model, dirs[mode], quantization=None if mode == "kept" else mode, dtype="auto",
                           progress=False)
        cases = {"gguf-kept": "", "gguf-int8": "", "weld-kept": dirs["kept"], "weld-int4": dirs["int4"],
                 "weld-f32>int8": dirs["none"], "convert-int8": dirs["scratch"], "llama.cpp": ""}
        results = {}
        for case, path in cases.items():
            runs = []
            for _ in range(args.runs):
                if case.startswith("convert-"):
                    subprocess.run(["rm", "-rf", path], check=True)
                runs.append(run(case, model, path))
            results[case] = {"seconds_median": statistics.median(r["seconds"] for r in runs),
                             "peak_extra_mb_median": statistics.median(r["peak_extra"] for r in runs) / 1e6,
                             "weights_mb": None if runs[0]["weights"] is None else runs[0]["weights"] / 1e6,
                             "runs": runs}
    for case, r in results.items():
        ratio = f"{r['peak_extra_mb_median'] / r['weights_mb']:.2f}x" if r["weights_mb"] else "-"
        weights = f"{r['weights_mb']:.0f}" if r["weights_mb"] else "-"
        print(f"{case:14s} {r['seconds_median']:7.2f} s  peak +{r['peak_extra_mb_median']:6.0f} MB  "
              f"weights {weights:>5s} MB  {ratio}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"model": model, "machine": machine_info(load_start), "runs": args.runs,
                                                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
