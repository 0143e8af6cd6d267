"""Cold and warm start of `make serve`: how long from the command to a server that answers.

    python benchmarks/startup.py --out benchmarks/results/startup_<date>.json

In a fresh clone of this repository (HEAD) it runs `make serve` three times, each until
`/health` answers 200 and one short completion comes back, then stops the server:

- cold: no `.venv`, empty compile and kernel caches (a new machine: venv, pip from the local
  package indexes, the native kernels' build, every compile);
- warm venv, cold caches (a new release of the caches: the kernels' build and the compiles);
- warm: everything from the runs before (what a user sees every day after the first).

Each row splits the time into install (until make starts `weld serve`), process start to the
model loaded (imports, reading weights), and loaded to ready (the KV pool, warm-up compiles),
from weld's own start-up log, plus the first completion's latency.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from serve_bench import _free_port  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_make_serve(clone: pathlib.Path, env: dict, timeout: float) -> dict:
    port = _free_port()
    start = time.monotonic()
    proc = subprocess.Popen(["make", "serve", f"PORT={port}"], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    marks: dict[str, float] = {}
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            now = time.monotonic() - start
            lines.append(line.rstrip())
            if "weld serve" in line and "bin/weld" in line:
                marks.setdefault("install_s", now)
            elif line.startswith("weld: loaded "):
                marks.setdefault("loaded_at_s", now)
            elif line.startswith("weld: ready in"):
                marks.setdefault("ready_at_s", now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("make serve exited early:\n" + "\n".join(lines[-30:]))
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"make serve did not answer within {timeout:.0f} s:\n" + "\n".join(lines[-30:]))
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        marks["health_s"] = time.monotonic() - start
        t = time.monotonic()
        reply = httpx.post(url + "/v1/completions", timeout=120,
                           json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        reply.raise_for_status()
        marks["first_completion_s"] = time.monotonic() - t
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(5)
    log = "\n".join(lines)
    found = re.search(r"weld: loaded .* in ([0-9.]+) s", log)
    ready = re.search(r"weld: ready in ([0-9.]+) s \((\d+) programs compiled", log)
    return {"install_s": round(marks.get("install_s", 0.0), 1),
            "weld_start_to_loaded_s": round(marks["loaded_at_s"] - marks.get("install_s", 0.0), 1)
            if "loaded_at_s" in marks else None,
            "weights_read_s": float(found.group(1)) if found else None,
            "loaded_to_ready_s": round(marks["ready_at_s"] - marks["loaded_at_s"], 1)
            if {"ready_at_s", "loaded_at_s"} <= marks.keys() else None,
            "weld_ready_s": float(ready.group(1)) if ready else None,
            "programs_compiled": int(ready.group(2)) if ready else None,
            "to_health_s": round(marks["health_s"], 1),
            "first_completion_s": round(marks["first_completion_s"], 2)}


def cpu_flags() -> list[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "fma", "amx")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument("--out", help="write the rows (JSON) here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="weld-startup-") as tmp:
        tmp = pathlib.Path(tmp)
        clone = tmp / "weld"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        env = {**os.environ, "WELD_PROGRESS": "0"}
        env.pop("VIRTUAL_ENV", None)
        rows = {}
        for name, fresh_caches in (("cold", True), ("warm_venv_cold_caches", True), ("warm", False)):
            if fresh_caches:
                caches = tmp / f"caches-{name}"
                env["WELD_CACHE_DIR"], env["WELD_KERNEL_CACHE_DIR"] = str(caches / "xla"), str(caches / "kernels")
            print(f"startup: {name} ...", file=sys.stderr, flush=True)
            rows[name] = run_make_serve(clone, env, args.timeout)
            print(f"startup: {name}: {json.dumps(rows[name])}", file=sys.stderr, flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpu": platform.processor() or platform.machine(),
                                                             "cores": os.cpu_count(), "cpu_flags": cpu_flags()},
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip(),
              "runs": rows}
    print(json.dumps(report, indent=2))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
