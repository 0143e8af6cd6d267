"""OpenTelemetry tracing (`weld serve --otlp-traces-endpoint`, weld/server/tracing.py).

In process: `build_app` with the SDK's in-memory exporter, on a real engine over a tiny llama
whose prompts are prefilled in 16-token chunks: span names, parents, times, attributes against
the response's own usage, and a caller's `traceparent` continued. End to end: a real `weld serve`
exporting by OTLP http/protobuf to a collector run in the test. Without the packages the flag is a
one-line error.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

pytest.importorskip("opentelemetry.sdk")
from fastapi.testclient import TestClient  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from tests.server.conftest import run_server, wait_for  # noqa: E402
from weld.server.app import build_app  # noqa: E402
from weld.server.serving import ServerConfig  # noqa: E402
from weld.server.tracing import Tracing  # noqa: E402

MAX_MODEL_LEN = 256
CHUNK = 16  # max_num_batched_tokens: a 40-token prompt is prefilled in 3 steps
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
LONG_PROMPT = [3 + (7 * i) % 300 for i in range(40)]  # token ids, none special
PHASES = ["preprocess", "queue", "prefill", "decode", "response"]


@pytest.fixture(scope="module")
def traced(tiny_llama_dir):
    """(TestClient, exporter): an app on a real AsyncLLM, its spans kept in memory."""
    from weld.engine.async_llm import AsyncLLM

    directory, _ = tiny_llama_dir
    engine = AsyncLLM(model=str(directory), max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.01,
                      max_num_batched_tokens=CHUNK, steps_per_call=4)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = build_app(engine, ServerConfig(served_model_name="tiny", max_model_len=MAX_MODEL_LEN), Tracing(provider))
    with TestClient(app) as client:  # its exit shuts the engine down (the app's lifespan)
        yield client, exporter


def request_spans(exporter, name: str) -> tuple:
    """(the one request span called `name`, {child name: [spans]}, all spans of its trace)."""
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == name]
    trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
    children: dict[str, list] = {}
    for s in trace:
        if s.parent is not None and s.parent.span_id == root.context.span_id:
            children.setdefault(s.name, []).append(s)
    return root, children, trace


def test_completion_spans_attributes_and_traceparent(traced):
    client, exporter = traced
    exporter.clear()
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 7,
            "ignore_eos": True}
    resp = client.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    root, children, trace = request_spans(exporter, "text_completion tiny")

    # the caller's trace continues: same trace id, the request span a child of the caller's span
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert root.parent is not None and root.parent.is_remote and f"{root.parent.span_id:016x}" == PARENT_ID
    assert root.kind == SpanKind.SERVER
    assert sorted(children) == sorted(PHASES)
    a = root.attributes
    assert a["gen_ai.response.id"] == resp.json()["id"]
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.operation.name"] == "text_completion" and a["http.response.status_code"] == 200
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"], a["gen_ai.request.max_tokens"],
            a["gen_ai.request.n"], a["gen_ai.request.seed"]) == (0.5, 0.9, 9, 1, 7)
    assert a["gen_ai.usage.prompt_tokens"] == a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == 40
    assert a["gen_ai.usage.completion_tokens"] == a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 9
    assert a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]

    # the phases tile the request, in order, inside its span
    phases = [children[name][0] for name in PHASES]
    assert root.start_time <= phases[0].start_time and phases[-1].end_time <= root.end_time
    for before, after in zip(phases, phases[1:]):
        assert before.end_time <= after.start_time, (before.name, after.name)
    queue, prefill, decode = children["queue"][0], children["prefill"][0], children["decode"][0]
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert prefill.attributes["gen_ai.request.id"] == resp.json()["id"] + "-0"
    assert decode.attributes["gen_ai.usage.completion_tokens"] == 9

    # 40 prompt tokens in 16-token steps: 3 chunks, under the prefill span, tiling it
    chunks = sorted((s for s in trace if s.name == "prefill_chunk"), key=lambda s: s.start_time)
    assert prefill.attributes["weld.prefill.steps"] == len(chunks) == 3
    assert all(c.parent.span_id == prefill.context.span_id for c in chunks)
    assert chunks[0].start_time == prefill.start_time and chunks[-1].end_time == prefill.end_time
    assert [c.attributes["weld.prefill.step"] for c in chunks] == [0, 1, 2]

    # the same prompt again: its full pages come from the prefix cache, and the span says so
    exporter.clear()
    again = client.post("/v1/completions", json=body).json()
    root, _, _ = request_spans(exporter, "text_completion tiny")
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and root.attributes["gen_ai.usage.cache_read.input_tokens"] == cached
    assert root.parent is None  # no traceparent: a new trace


def test_streaming_chat_and_several_prompts(traced):
    client, exporter = traced
    exporter.clear()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: {")]

    usage = json.loads(lines[-1][6:])["usage"]
    root, children, _ = request_spans(exporter, "chat tiny")
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert sorted(children) == sorted(PHASES)
    assert root.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert root.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 6
    assert root.attributes["gen_ai.response.id"] == json.loads(lines[0][6:])["id"]

    # two prompts, n = 2: one queue / prefill / decode per prompt, told apart by their index
    exporter.clear()
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": [[5, 6, 7], [8, 9, 10, 11]],
                                                 "max_tokens": 4, "n": 2, "temperature": 1.0, "ignore_eos": True})
    root, children, _ = request_spans(exporter, "text_completion tiny")
    assert root.attributes["gen_ai.usage.completion_tokens"] == resp.json()["usage"]["completion_tokens"] == 16
    assert root.attributes["gen_ai.usage.num_sequences"] == 4
    for name in ("queue", "prefill", "decode"):
        assert sorted(s.attributes["weld.prompt_index"] for s in children[name]) == [0, 1]


def test_refused_request_is_one_span(traced):
    client, exporter = traced
    exporter.clear()
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": -1})
    assert resp.status_code == 400
    root, children, _ = request_spans(exporter, "text_completion tiny")
    assert root.attributes["http.response.status_code"] == 400 and root.attributes["error.type"] == "APIError"
    assert children == {}


def test_without_tracing_no_sdk_is_imported():
    code = ("import sys, weld.server.app, weld.server.serving, weld.server.tracing\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter',"
            "))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# ----- end to end: weld serve -> OTLP http/protobuf -> a collector in this test -----

class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: keeps every span it is sent, decoded."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)

        spans, lock = [], threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    for resource in request.resource_spans:
                        service = {kv.key: kv.value.string_value for kv in resource.resource.attributes}
                        for scope in resource.scope_spans:
                            spans.extend((service, s) for s in scope.spans)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.spans, self.lock = spans, lock
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list:
        with self.lock:
            return [(service, s) for service, s in self.spans if s.name == name]


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


def test_weld_serve_exports_by_otlp_http(tiny_llama_dir, tmp_path):
    import httpx

    collector = Collector()
    directory, _ = tiny_llama_dir
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
            mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: the batch goes out at once
            mp.delenv("OTEL_SERVICE_NAME", raising=False)
            with run_server("--model", str(directory), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb",
                            "0.01", "--steps-per-call", "4", "--served-model-name", "tiny",
                            "--otlp-traces-endpoint", collector.url, tmp_path=tmp_path) as server:
                resp = httpx.post(server.url + "/v1/chat/completions", timeout=120, headers={"traceparent": TRACEPARENT},
                                  json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 5, "temperature": 0, "ignore_eos": True})
                assert resp.status_code == 200, resp.text
                found = wait_for(lambda: collector.named("chat tiny"), timeout=30)
                assert found, f"no span reached the collector; server log:\n{server.logs()}"
    finally:
        collector.server.shutdown()
    (service, span), = found
    assert service["service.name"] == "weld"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    attributes = {kv.key: _value(kv.value) for kv in span.attributes}
    usage = resp.json()["usage"]
    assert attributes["gen_ai.response.id"] == resp.json()["id"]
    assert attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
    assert attributes["gen_ai.request.temperature"] == 0.0
    phases = {s.name for _, s in collector.spans if s.parent_span_id == span.span_id}
    assert phases == set(PHASES)


def test_otlp_grpc_is_the_default_protocol(monkeypatch):
    """`Tracing.otlp` with no protocol set sends by OTLP gRPC (vLLM's default), here to a gRPC
    collector in the test; the caller's trace id comes through."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.extend(s for r in request.resource_spans for scope in r.scope_spans for s in scope.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    try:
        tracing = Tracing.otlp(f"http://127.0.0.1:{port}")
        tracing.begin("chat", "tiny", {"traceparent": TRACEPARENT}, "/v1/chat/completions").end(200)
        tracing.shutdown()  # sends the batch
    finally:
        server.stop(0)
    (span,) = received
    assert span.name == "chat tiny" and span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID


# ----- the flag without the packages -----

BLOCK_OTEL = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from weld.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("blocked, protocol, message", [
    (True, "grpc", "pip install 'weld[otel]'"),
    (True, "http/protobuf", "pip install 'weld[otel]'"),
    (False, "thrift", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf, got 'thrift'"),
])
def test_flag_errors_are_one_line(tiny_llama_dir, blocked, protocol, message):
    directory, _ = tiny_llama_dir
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WELD_PROGRESS": "0", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}
    prefix = [sys.executable, "-c", BLOCK_OTEL] if blocked else [sys.executable, "-m", "weld.cli"]
    out = subprocess.run([*prefix, "serve", "--model", str(directory), "--port", "0",
                          "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weld: error: --otlp-traces-endpoint" if blocked else "weld: error:")
    assert message in lines[0]
