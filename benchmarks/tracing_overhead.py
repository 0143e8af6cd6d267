"""What OpenTelemetry tracing costs `weld serve`: the same load on two servers, one without and one
with `--otlp-traces-endpoint` (exporting by OTLP http/protobuf to a collector run here), rounds
interleaved (A B, B A, ...) so drift on a shared machine falls on both; medians side by side.

    python benchmarks/tracing_overhead.py --rounds 5 --concurrency 1 8 --max-tokens 64

Each round runs `serve_bench.run_level` (streaming /v1/completions, greedy, ignore_eos) once per
server and level. Decode tok/s is 1000 / TPOT p50 (one stream's decode rate); throughput is output
tokens / wall time. "paired" is the median over rounds of each round's on / off ratio. The OTLP
posts the collector received are counted, to show the traced server traced. First, the CPU one
traced request costs in process (`--cpu-only`: that alone).
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import pathlib
import statistics
import sys
import threading

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from serve_bench import launch, run_level, served_model  # noqa: E402


class Collector:
    """Accepts OTLP/HTTP trace exports on 127.0.0.1 and counts the bytes and requests (not decoded)."""

    def __init__(self):
        counts = {"posts": 0, "bytes": 0}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                size = int(self.headers["Content-Length"])
                self.rfile.read(size)
                counts["posts"] += 1
                counts["bytes"] += size
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.counts = counts
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def cpu_per_request(num_requests: int = 2000) -> tuple[float, float]:
    """(CPU seconds per traced request, per output) in this process: a 128-token request in 16
    outputs, its 6 spans handed to a BatchSpanProcessor whose exporter drops them (the export
    thread's protobuf encoding and POST are not counted)."""
    import time
    import types

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from weld.engine.sampling_params import SamplingParams
    from weld.server.tracing import Tracing

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    tracing, params = Tracing(provider), SamplingParams(max_tokens=128, temperature=0)
    choice = [types.SimpleNamespace(finish_reason="length")]
    running = types.SimpleNamespace(finished=False, num_cached_tokens=0, outputs=choice)
    done = types.SimpleNamespace(finished=True, num_cached_tokens=0, outputs=choice)
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    start = time.process_time()
    for _ in range(num_requests):
        trace = tracing.begin("text_completion", "model", headers, "/v1/completions")
        timeline = trace.engine_request("cmpl-0", 16, params)
        for k in range(16):
            timeline.on_output(time.monotonic(), done if k == 15 else running, 8 * (k + 1), trace.start)
        trace.end(200)
    per_request = (time.process_time() - start) / num_requests
    start = time.process_time()
    for _ in range(100_000):
        timeline.on_output(1.0, running, 8, 1.0)
    per_output = (time.process_time() - start) / 100_000
    provider.shutdown()
    return per_request, per_output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-requests", type=int, default=None, help="per level (default: max(8, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--weld-args", default="", help="extra flags for both servers (one string)")
    p.add_argument("--cpu-only", action="store_true", help="only the in-process CPU cost per request and output")
    args = p.parse_args(argv)
    per_request, per_output = cpu_per_request()
    print(f"in process: {per_request * 1e6:.0f} us CPU per traced request (16 outputs, 6 spans), "
          f"{per_output * 1e9:.0f} ns per output")
    if args.cpu_only:
        return 0

    collector = Collector()
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    extra = args.weld_args.split()
    servers = {}
    procs = []
    try:
        for label, flags in (("off", extra), ("on", extra + ["--otlp-traces-endpoint", collector.url])):
            print(f"# starting weld serve (tracing {label}) ...", file=sys.stderr)
            proc, url = launch("weld", args.model, 2, flags)
            procs.append(proc)
            servers[label] = url
        models = {label: served_model(url, None) for label, url in servers.items()}
        results: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            for c in args.concurrency:
                for label in order:
                    n = args.num_requests or max(8, 2 * c)
                    row = asyncio.run(run_level(servers[label], models[label], c, n, args.max_tokens,
                                                ignore_eos=True, api_key=None))
                    results.setdefault((label, c), []).append(row)
                    print(f"# round {r} c={c} tracing {label}: decode {1e3 / row['tpot_p50_ms']:.1f} tok/s, "
                          f"{row['output_tok_s']:.1f} tok/s overall", file=sys.stderr)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    print(f"spans exported: {collector.counts['posts']} OTLP posts, {collector.counts['bytes']} bytes")
    print("concurrency | decode tok/s off | on | change | paired | throughput off | on | change | paired | "
          "TTFT p50 ms off | on")
    for c in args.concurrency:
        def series(label, key):
            return [1e3 / row["tpot_p50_ms"] if key == "decode" else row[key] for row in results[(label, c)]]

        cells = []
        for key in ("decode", "output_tok_s"):
            off, on = series("off", key), series("on", key)
            m_off, m_on = statistics.median(off), statistics.median(on)
            # paired: the median of each round's on / off, which drift between rounds does not move
            paired = statistics.median(b / a for a, b in zip(off, on))
            cells += [f"{m_off:.1f}", f"{m_on:.1f}", f"{100 * (m_on / m_off - 1):+.1f}%", f"{100 * (paired - 1):+.1f}%"]
        ttft = [statistics.median(series(label, "ttft_p50_ms")) for label in ("off", "on")]
        print(" | ".join([str(c), *cells, f"{ttft[0]:.0f}", f"{ttft[1]:.0f}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
