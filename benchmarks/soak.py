"""Soak: many concurrent streaming clients over a mixed workload, some hanging up mid-stream;
afterwards the server must hold nothing and every completed deterministic request must equal its
serial result.

    python benchmarks/soak.py --launch --requests 400 --concurrency 32 --out benchmarks/results/soak.json
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --requests 400

The workload (seeded): completions and chat, prompts of 1 to ~300 words, n 1-2, stop strings,
greedy and seeded sampling (both deterministic in weld: a row's noise is a function of its seed
and position), JSON-schema outputs, tool calls (auto and required), streamed (80%) or not, with
`--disconnect` of the clients (20% by default) closing their stream after a few chunks.

Phases: (0) the requests at `--concurrency`, to warm up, again until a pass compiles nothing new
(`weld:compiled_programs`; each batch shape and program variant the mix makes holds memory once
compiled); (1) every request alone, in order: the serial results, and the warm
level of the server's RSS afterwards; (2) the same requests again at
`--concurrency`, shuffled, with the disconnects; (3) checks, after the server settles:
`weld:num_requests_running` and `_waiting` 0, `weld:kv_cache_usage_perc` 0, the RSS within
`--rss-slack` (10%) of its warm level, no 5xx, and every completed request of phase 2 equal to its
phase-1 result (text, finish reason, tool calls). Exit status 1 when a check fails; the report
(JSON) says which. `--launch` starts `weld serve` itself (the bundled model, n-gram speculation
on, full warm-up) and stops it after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import httpx

from serve_bench import _free_port, stop_server, wait_until_up  # benchmarks/ is on the path when a script there runs

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has "
         "had not but what all when there can more one about if out so up into them some could time these two "
         "may then do first any like now my such new over only me even most made after also did many before "
         "must through years where much your way well down should because each just those people mr how").split()
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age"]}


def make_requests(count: int, seed: int, max_tokens: int, model: str, max_words: int = 300) -> list[dict]:
    """The mixed workload: (route, body, disconnect_after) dicts, deterministic in `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        length = int(rng.choice([0.01, 0.05, 0.2, 0.5, 1.0]) * max_words * rng.random()) + 1
        words = " ".join(rng.choice(WORDS) for _ in range(length))
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randrange(1, max_tokens + 1),
                                "n": rng.choice([1, 1, 1, 2])}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(10**6))
        if rng.random() < 0.2:
            body["stop"] = [rng.choice(["the", "and", ".", "\n"])]
        kind = rng.choices(["completion", "chat", "json", "tools"], [0.35, 0.35, 0.15, 0.15])[0]
        if kind == "completion":
            route, body["prompt"] = "/v1/completions", words
        else:
            route = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": words}]
            if kind == "json":
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
                body.pop("stop", None)
            elif kind == "tools":
                body["tools"] = [TOOL]
                body["tool_choice"] = rng.choice(["auto", "required"])
                body.pop("stop", None)
        body["stream"] = rng.random() < 0.8
        out.append({"id": i, "route": route, "body": body, "kind": kind})
    return out


def _choice_key(choice: dict) -> dict:
    msg = choice.get("message") or {}
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return {"text": choice.get("text", msg.get("content")), "finish_reason": choice["finish_reason"],
            "tool_calls": calls}


def _merge_stream(events: list[dict]) -> list[dict]:
    """Streamed chunks -> one result per choice index, shaped as `_choice_key` returns."""
    merged: dict[int, dict] = {}
    for ev in events:
        for ch in ev.get("choices", []):
            m = merged.setdefault(ch["index"], {"text": "", "finish_reason": None, "calls": {}})
            delta = ch.get("delta")
            if delta is None:  # completions
                m["text"] += ch.get("text") or ""
            else:
                m["text"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    c = m["calls"].setdefault(call["index"], ["", ""])
                    fn = call.get("function") or {}
                    c[0] += fn.get("name") or ""
                    c[1] += fn.get("arguments") or ""
            if ch.get("finish_reason"):
                m["finish_reason"] = ch["finish_reason"]
    out = []
    for index in sorted(merged):
        m = merged[index]
        text = m["text"] if m["text"] or not m["calls"] else None
        out.append({"text": text, "finish_reason": m["finish_reason"],
                    "tool_calls": [tuple(m["calls"][k]) for k in sorted(m["calls"])]})
    return out


async def run_one(client: httpx.AsyncClient, url: str, req: dict, disconnect_after: int | None) -> dict:
    """Sends one request; returns {status, choices | error, disconnected}."""
    body = req["body"]
    try:
        if not body["stream"]:
            r = await client.post(url + req["route"], json=body)
            if r.status_code != 200:
                return {"status": r.status_code, "error": r.text[:300]}
            return {"status": 200, "choices": [_choice_key(c) for c in sorted(r.json()["choices"],
                                                                             key=lambda c: c["index"])]}
        events = []
        async with client.stream("POST", url + req["route"], json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "error": (await r.aread()).decode(errors="replace")[:300]}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return {"status": 200, "error": event["error"]}
                events.append(event)
                if disconnect_after is not None and len(events) >= disconnect_after:
                    return {"status": 200, "disconnected": True}  # leaving the block closes the connection
        return {"status": 200, "choices": _merge_stream(events)}
    except httpx.HTTPError as err:
        return {"status": None, "error": f"{type(err).__name__}: {err}"}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def soak(url: str, pid: int | None, requests: list[dict], concurrency: int, disconnect: float, seed: int,
               rss_slack: float, settle_s: float = 60.0, max_warmup_passes: int = 4, log=print) -> dict:
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def pass_concurrently(order: list[int], cut: dict[int, int], label: str) -> dict[int, dict]:
            queue: asyncio.Queue = asyncio.Queue()
            for i in order:
                queue.put_nowait(i)
            results: dict[int, dict] = {}
            start = time.monotonic()

            async def worker():
                while not queue.empty():
                    i = queue.get_nowait()
                    results[i] = await run_one(client, url, requests[i], cut.get(i))
                    if len(results) % 50 == 0 or len(results) == len(order):
                        log(f"soak: {label} {len(results)}/{len(order)} ({time.monotonic() - start:.0f} s)")

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return results

        # warm-up: the batch shapes and program variants concurrency makes compile here, not later
        # (each compiled program holds memory), until a pass compiles nothing new
        warmup_passes = 0
        while warmup_passes < max_warmup_passes:
            before = metric(url, "weld:compiled_programs")
            await pass_concurrently(list(range(len(requests))), {}, "warm-up")
            warmup_passes += 1
            if metric(url, "weld:compiled_programs") == before:
                break
        t0 = time.monotonic()
        serial = []
        for i, req in enumerate(requests):
            serial.append(await run_one(client, url, req, None))
            if (i + 1) % 50 == 0 or i + 1 == len(requests):
                log(f"soak: serial {i + 1}/{len(requests)} ({time.monotonic() - t0:.0f} s)")
        serial_s = time.monotonic() - t0
        warm_rss = rss_bytes(pid) if pid else None
        warm_compiles = metric(url, "weld:compiled_programs")

        rng = random.Random(seed + 1)
        order = list(range(len(requests)))
        rng.shuffle(order)
        cut = {i: rng.randrange(1, 4) for i in order if requests[i]["body"]["stream"] and rng.random() < disconnect}
        t1 = time.monotonic()
        concurrent = await pass_concurrently(order, cut, "concurrent")
        concurrent_s = time.monotonic() - t1

    # settle: disconnected requests are aborted within the server's poll interval
    deadline = time.monotonic() + settle_s
    while True:
        running = metric(url, "weld:num_requests_running")
        waiting = metric(url, "weld:num_requests_waiting")
        kv = metric(url, "weld:kv_cache_usage_perc")
        if (running == waiting == kv == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    end_rss = rss_bytes(pid) if pid else None

    mismatches, server_errors, client_errors, disconnected, compared = [], [], [], 0, 0
    for i, req in enumerate(requests):
        for phase, result in (("serial", serial[i]), ("concurrent", concurrent[i])):
            status = result["status"]
            if status is None or status >= 500 or (status == 200 and "error" in result):
                server_errors.append({"id": i, "phase": phase, **result})
            elif status != 200:  # the workload is valid: a 4xx is a bug too
                client_errors.append({"id": i, "phase": phase, **result})
        if concurrent[i].get("disconnected"):
            disconnected += 1
            continue
        if "choices" in serial[i] and "choices" in concurrent[i]:
            compared += 1
            if serial[i]["choices"] != concurrent[i]["choices"]:
                mismatches.append({"id": i, "request": req["body"], "serial": serial[i]["choices"],
                                   "concurrent": concurrent[i]["choices"]})
    checks = {
        "no_request_running": running == 0 and waiting == 0,
        "kv_usage_zero": kv == 0,
        "rss_within_slack": None if warm_rss is None else end_rss <= warm_rss * (1 + rss_slack),
        "no_server_errors": not server_errors,
        "no_client_errors": not client_errors,
        "completed_equal_serial": not mismatches,
    }
    return {
        "requests": len(requests), "concurrency": concurrency, "disconnect_fraction": disconnect,
        "disconnected": disconnected, "compared": compared,
        "kinds": {k: sum(r["kind"] == k for r in requests) for k in ("completion", "chat", "json", "tools")},
        "streamed": sum(r["body"]["stream"] for r in requests),
        "serial_s": round(serial_s, 1), "concurrent_s": round(concurrent_s, 1), "warmup_passes": warmup_passes,
        "compiles_during_soak": metric(url, "weld:compiled_programs") - warm_compiles,
        "rss_warm_mb": None if warm_rss is None else round(warm_rss / 2**20, 1),
        "rss_end_mb": None if end_rss is None else round(end_rss / 2**20, 1),
        "running": running, "waiting": waiting, "kv_cache_usage": kv,
        "server_errors": server_errors[:20], "num_server_errors": len(server_errors),
        "client_errors": client_errors[:20], "num_client_errors": len(client_errors),
        "mismatches": mismatches[:10], "num_mismatches": len(mismatches),
        "checks": checks, "passed": all(v is not False for v in checks.values()),
    }


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "weld.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", args.model, "--warmup", args.warmup, "--log-level", "warning", *args.serve_args]
    proc = subprocess.Popen(cmd, env={**os.environ, "WELD_PROGRESS": "0"}, stdout=sys.stderr, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url + "/health", args.launch_timeout, "soak: weld serve")
    return proc, url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --launch)")
    p.add_argument("--pid", type=int, help="the server's process id, for its RSS (with --url)")
    p.add_argument("--launch", action="store_true", help="start `weld serve` (SERVE_ARGS after --) and stop it after")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--warmup", default="basic", choices=["none", "basic", "full"],
                   help="`weld serve --warmup` with --launch (default: basic; the soak's own warm-up passes "
                        "compile what its traffic needs: full compiles every shape of the limits, which for the "
                        "defaults with speculation is more programs than one process holds at once)")
    p.add_argument("--model", default="soak", help="the served model name requests use")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect", type=float, default=0.2, help="the share of streamed requests cut mid-stream")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-words", type=int, default=300, help="the longest prompt, in words")
    p.add_argument("--rss-slack", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report (JSON) here")
    p.add_argument("serve_args", nargs="*", help="after --: arguments for `weld serve` with --launch "
                   "(default: n-gram speculation, 3 drafts)")
    args = p.parse_args(argv)
    if not args.serve_args:
        args.serve_args = ["--spec", "ngram", "--spec-k", "3"]
    if bool(args.url) == bool(args.launch):
        p.error("give exactly one of --url and --launch")
    proc = None
    if args.launch:
        proc, url = launch(args)
        pid = proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        requests = make_requests(args.requests, args.seed, args.max_tokens, args.model, args.max_words)
        report = asyncio.run(soak(url, pid, requests, args.concurrency, args.disconnect, args.seed, args.rss_slack,
                                  log=lambda m: print(m, file=sys.stderr, flush=True)))
    finally:
        if proc is not None:
            stop_server(proc)
    report["date"] = time.strftime("%Y-%m-%d %H:%M")
    report["serve_args"] = args.serve_args if args.launch else None
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    summary = {k: report[k] for k in ("requests", "concurrency", "disconnected", "compared", "num_server_errors",
                                      "num_client_errors", "num_mismatches", "rss_warm_mb", "rss_end_mb", "checks", "passed")}
    print(json.dumps(summary, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
