"""Resident memory of a served model, side by side: `weld serve` (with the flags given) against
llama.cpp holding the same GGUF with the same context, each measured after one warm request.

    python benchmarks/serve_memory.py --ctx 8192 [--weld-flags "--kv-cache-dtype float16"] [--out F]

weld: `weld serve --max-model-len CTX --max-num-seqs N` in a subprocess, one /v1/completions
request of 16 tokens, then VmRSS from /proc. llama.cpp: llama-cpp-python's `Llama(n_ctx=CTX)` in a
subprocess (the library llama.cpp's server is built on; its Python interpreter adds ~20 MB), one
completion of 16 tokens, then VmRSS. Both count the mapped model pages they touched. Each figure
splits into shared libraries' pages, other mapped files and anonymous memory (/proc/PID/smaps).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

PROMPT = "The committee met on Tuesday to discuss the budget for next year. After a long debate,"


def rss_mb(pid: int) -> dict:
    """VmRSS of a process in MB, and how it splits (/proc/PID/smaps): shared libraries' pages
    (code the process touched, clean and shared with other processes), other mapped files (a
    memory-mapped model), and anonymous memory (the heap: arrays, compiled programs, Python)."""
    kinds = {"shared_libraries": 0, "mapped_files": 0, "anonymous": 0}
    kind = "anonymous"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if not head[0].endswith(":"):  # a mapping's header: address range, perms, offset, dev, inode[, path]
                path = head[5].strip() if len(head) > 5 else ""
                kind = ("anonymous" if not path.startswith("/") else
                        "shared_libraries" if ".so" in os.path.basename(path) else "mapped_files")
            elif head[0] == "Rss:":
                kinds[kind] += int(head[1])
    with open(f"/proc/{pid}/status") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_mb": round(total / 1024, 1), **{f"{k}_mb": round(v / 1024, 1) for k, v in kinds.items()}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weld_rss(model: str | None, ctx: int, seqs: int, flags: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from weld.cli import main; sys.exit(main())", "serve", "--port", str(port), "--max-model-len", str(ctx),
           "--max-num-seqs", str(seqs), *flags] + (["--model", model] if model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"weld serve did not start: {shlex.join(cmd)}") from None
                time.sleep(0.5)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=300).read()
        time.sleep(1)
        return {"command": "weld " + shlex.join(cmd[3:]), **rss_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


LLAMACPP = """
import os, sys, time
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=os.cpu_count(), verbose=False)
llm(sys.argv[3], max_tokens=16, temperature=0)
time.sleep(1)
print("ready", flush=True)
sys.stdin.read()  # measured from outside until stdin closes
"""


def llamacpp_rss(model: str, ctx: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", LLAMACPP, model, str(ctx), PROMPT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"llama.cpp did not load {model} (exit {proc.wait()})")
        return {"command": f"Llama({os.path.basename(model)!r}, n_ctx={ctx})", **rss_mb(proc.pid)}
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--weld-flags", action="append", default=[],
                    help="one weld configuration's extra flags (repeat for several; default: none)")
    ap.add_argument("--out")
    args = ap.parse_args()
    from weld.weights import default_model_path

    model = args.model or str(default_model_path())
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": os.path.basename(model), "ctx": args.ctx,
              "llama.cpp": llamacpp_rss(model, args.ctx), "weld": []}
    print(f"llama.cpp: {result['llama.cpp']['rss_mb']:.0f} MB ({result['llama.cpp']['command']})", flush=True)
    for flags in args.weld_flags or [""]:
        r = weld_rss(args.model, args.ctx, args.max_num_seqs, shlex.split(flags))
        r["ratio_to_llamacpp"] = round(r["rss_mb"] / result["llama.cpp"]["rss_mb"], 2)
        result["weld"].append(r)
        print(f"weld: {r['rss_mb']:.0f} MB = {r['ratio_to_llamacpp']:.2f}x ({r['command']})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
