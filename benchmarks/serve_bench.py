"""Load generator for OpenAI-compatible servers: streaming clients at given concurrencies.

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --concurrency 1 8 32
    python benchmarks/serve_bench.py --launch weld --launch llama-cpp --concurrency 1 8 32   # side by side

Each level runs `--num-requests` streaming /v1/completions requests (greedy, `--max-tokens` new
tokens each, prompts cycled from a fixed list) with at most `concurrency` in flight, after a
short warm-up run of the same requests (so weld's compiles for those shapes are not timed).
Reported per level, medians and p99 over requests or gaps:

- TTFT: request sent -> first chunk with text;
- ITL: the gap between two chunks with text, as the client sees it (a server that sends several
  tokens per chunk, like weld's fused decode, has fewer, longer gaps);
- TPOT: (end - first text) / (output tokens - 1) per request, comparable across chunkings;
- throughput: output tokens / wall time of the level, and requests / s.

Output tokens come from the final `usage` chunk (`stream_options.include_usage`) when the server
sends one, else from the number of chunks with text. `--launch` starts the server itself
(`weld serve`, or `python -m llama_cpp.server` on the same GGUF) on a free port and stops it after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue in simple terms.",
    "def quicksort(items):",
    "The three most important inventions of the twentieth century are",
    "Once upon a time, in a small village by the sea,",
    "A recipe for a simple tomato soup:",
    "The main differences between cats and dogs are",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    times, usage_tokens = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            if any(c.get("text") for c in chunk.get("choices") or []):
                times.append(time.perf_counter())
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else len(times)
    if not times:
        return {"ttft": end - start, "itl": [], "tpot": None, "tokens": tokens, "e2e": end - start}
    return {"ttft": times[0] - start, "itl": [b - a for a, b in zip(times, times[1:])],
            "tpot": (end - times[0]) / (tokens - 1) if tokens > 1 else None, "tokens": tokens, "e2e": end - start}


async def run_level(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int,
                    ignore_eos: bool, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as client:
        async def burst(n: int, tokens: int) -> tuple[list[dict], float]:
            sem = asyncio.Semaphore(concurrency)

            async def worker(i: int) -> dict | None:
                async with sem:
                    try:
                        return await one_request(client, url, model, PROMPTS[i % len(PROMPTS)], tokens, ignore_eos)
                    except (httpx.HTTPError, RuntimeError) as err:  # counted, not fatal
                        print(f"# request {i} failed: {type(err).__name__}: {err}", file=sys.stderr)
                        return None

            t0 = time.perf_counter()
            results = await asyncio.gather(*(worker(i) for i in range(n)))
            return results, time.perf_counter() - t0

        await burst(num_requests, min(max_tokens, 8))  # warm-up: the same prompts and batch sizes, short
        results, wall = await burst(num_requests, max_tokens)
    errors = sum(r is None for r in results)
    results = [r for r in results if r is not None] or [{"ttft": float("nan"), "itl": [], "tpot": None,
                                                           "tokens": 0, "e2e": float("nan")}]
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": num_requests, "errors": errors, "output_tokens": tokens,
            "wall_s": wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 0.5) if tpot else float("nan"),
            "output_tok_s": tokens / wall, "req_s": num_requests / wall,
            "median_e2e_s": statistics.median(r["e2e"] for r in results)}


# ----- launching servers -----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_gguf() -> str:
    from weld.weights import default_model_path

    return str(default_model_path())


def launch(kind: str, model: str | None, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    if kind == "weld":
        cmd = [sys.executable, "-m", "weld.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"] + (["--model", model] if model else []) + extra
    elif kind == "llama-cpp":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model or _default_gguf(), "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(threads), "--n_ctx", "2048",
               "--interrupt_requests", "False"] + extra  # queue concurrent requests, do not cut them off
    else:
        raise SystemExit(f"unknown server kind {kind!r}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url + "/v1/models", 600, f"{kind} server ({' '.join(cmd)})")
    return proc, url


def wait_until_up(proc: subprocess.Popen, probe: str, timeout: float, name: str) -> None:
    """Polls `probe` until it answers 200; a server that exits or stays down `timeout` s ends the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(probe, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{name} did not come up in {timeout:.0f} s")


def served_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def print_table(rows: list[dict]) -> None:
    cols = ["server", "concurrency", "requests", "errors", "output_tokens", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms", "tpot_p50_ms", "output_tok_s", "req_s"]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in cols))


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a launched server, and SIGKILL it if it has not exited a minute later."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=[], help="a running server (repeatable)")
    p.add_argument("--launch", action="append", default=[], choices=["weld", "llama-cpp"],
                   help="start this server for the run (repeatable)")
    p.add_argument("--model", default=None, help="model path for --launch (default: the bundled SmolLM2 GGUF)")
    p.add_argument("--weld-args", default="", help="extra flags for `weld serve` (one string)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default: 2)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-requests", type=int, default=None, help="per level (default: max(8, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers that reject it)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if not args.url and not args.launch:
        args.url = ["http://127.0.0.1:8000"]
    rows = []
    targets = [(url, url, None) for url in args.url]
    for kind in args.launch:
        targets.append((kind, None, kind))
    for label, url, kind in targets:
        proc = None
        if kind:
            print(f"# starting {kind} ...", file=sys.stderr)
            proc, url = launch(kind, args.model, args.threads, args.weld_args.split() if kind == "weld" else [])
        try:
            model = served_model(url, args.api_key)
            for c in args.concurrency:
                n = args.num_requests or max(8, 2 * c)
                row = asyncio.run(run_level(url, model, c, n, args.max_tokens,
                                            ignore_eos=not args.no_ignore_eos, api_key=args.api_key))
                row["server"] = label
                rows.append(row)
                print(f"# {label} c={c}: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})}",
                      file=sys.stderr)
        finally:
            if proc is not None:
                stop_server(proc)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
