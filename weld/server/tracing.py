"""OpenTelemetry traces of completion and chat requests, exported by OTLP (`weld serve
--otlp-traces-endpoint URL`, vLLM's flag; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` picks grpc, the
default, or http/protobuf).

Each request is one SERVER span named as the GenAI semantic conventions name it
(`chat MODEL`, `text_completion MODEL`), a child of the caller's span when the request carries a
W3C `traceparent`. Its children, one set per engine request (a completions request with several
prompts runs one per prompt; `weld.prompt_index` tells them apart):

    preprocess     the route's start -> the first prompt handed to the engine (body, template, tokens)
    queue          handed to the engine -> the start of the first engine step that ran it
    prefill        that step -> the output with the first token; a prompt prefilled in several
                   steps (chunked prefill) has one `prefill_chunk` child per step, each ending when
                   that step's output reached the server
    decode         the first token -> the last output
    response       the last output -> the response's end (the JSON body, or a stream's last chunks)

Detokenizing is incremental, inside the engine's steps: it is part of prefill and decode.

The spans are made when the request ends, from the times its outputs reached the server (as
vLLM makes its `llm_request` span when the request finishes): the engine thread does nothing
more, and the event loop only notes a time per output. Without the flag no `Tracing` exists, the
server never imports the OpenTelemetry SDK, and a request pays one `is None` test per output.

Attribute names are vLLM's (`vllm/tracing.py`, which follows the GenAI conventions of its day)
plus the current conventions' names for the same counts (`gen_ai.usage.input_tokens`, ...).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any, AsyncIterator, Mapping

from weld.utils.errors import InvalidInputError

INSTALL_HINT = "pip install 'weld[otel]'"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SHUTDOWN_TIMEOUT_S = 5.0  # a collector that is down must not hold the server's exit for long


class Tracing:
    """Makes a `RequestTrace` per request; its spans go to `provider` (an SDK TracerProvider)."""

    def __init__(self, provider: Any):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from weld import __version__

        self.provider = provider
        self.tracer = provider.get_tracer("weld.server", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.api = trace

    @classmethod
    def otlp(cls, endpoint: str) -> "Tracing":
        """Spans batched and sent to `endpoint` by OTLP; a missing package or an unknown protocol
        is an InvalidInputError (one line on the command line)."""
        protocol = os.environ.get(PROTOCOL_ENV, "grpc")  # vLLM's default
        if protocol not in ("grpc", "http/protobuf"):
            raise InvalidInputError(f"{PROTOCOL_ENV} must be grpc or http/protobuf, got {protocol!r}")
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as err:
            raise InvalidInputError(f"--otlp-traces-endpoint needs the OpenTelemetry packages, which are not "
                                    f"installed ({err.name or err}): {INSTALL_HINT}") from None
        # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, when set, name the service instead
        named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
        provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "weld"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider)

    def begin(self, operation: str, model: str, headers: Mapping[str, str], path: str) -> "RequestTrace":
        """A request's trace, from now; `headers` may carry the caller's `traceparent`."""
        return RequestTrace(self, operation, model, self.propagator.extract(headers), path)

    def shutdown(self) -> None:
        """Sends the spans still batched, waiting at most SHUTDOWN_TIMEOUT_S."""
        thread = threading.Thread(target=self.provider.shutdown, name="weld-otel-shutdown", daemon=True)
        thread.start()
        thread.join(SHUTDOWN_TIMEOUT_S)


class EngineTimeline:
    """One engine request's times (time.monotonic()) and counts, noted as its outputs arrive."""

    def __init__(self, request_id: str, index: int, num_prompt_tokens: int, params: Any, submitted: float):
        self.request_id, self.index, self.params = request_id, index, params
        self.num_prompt_tokens = num_prompt_tokens
        self.submitted = submitted
        self.first_step_start: float | None = None
        self.chunk_ends: list[float] = []  # the outputs up to and with the first token: one per prefill step
        self.first_token_at: float | None = None
        self.last_output_at: float | None = None
        self.num_tokens = 0  # generated, all n completions
        self.num_cached_tokens = 0
        self.finish_reasons: list[str] = []

    def on_output(self, now: float, out: Any, num_tokens: int, first_step_start: float | None) -> None:
        if self.first_step_start is None:
            self.first_step_start = first_step_start
        if self.first_token_at is None:
            self.chunk_ends.append(now)
            if num_tokens > 0 or out.finished:
                self.first_token_at = now
        self.last_output_at = now
        self.num_tokens = num_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reasons = [c.finish_reason or "abort" for c in out.outputs]


class RequestTrace:
    """One HTTP request's timeline; `end` turns it into spans."""

    def __init__(self, tracing: Tracing, operation: str, model: str, parent: Any, path: str):
        self.tracing = tracing
        self.operation, self.model, self.parent, self.path = operation, model, parent, path
        self.start = time.monotonic()
        self.epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self.response_id: str | None = None
        self.engine_requests: list[EngineTimeline] = []
        self.ended = False

    def engine_request(self, request_id: str, num_prompt_tokens: int, params: Any) -> EngineTimeline:
        timeline = EngineTimeline(request_id, len(self.engine_requests), num_prompt_tokens, params,
                                  time.monotonic())
        self.engine_requests.append(timeline)
        return timeline

    async def until_end(self, stream: AsyncIterator) -> AsyncIterator:
        """Passes a streaming response's body through; the trace ends with the stream."""
        try:
            async for chunk in stream:
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            self.end(499)  # the client left (nginx's status for it)
            raise
        except BaseException as err:
            self.end(500, err)
            raise
        self.end(200)

    def end(self, status_code: int, error: BaseException | None = None) -> None:
        """Makes the spans (once): the request's, then its phases', all with the times noted."""
        if self.ended:
            return
        self.ended = True
        end = time.monotonic()
        if error is not None:  # as the app's error handlers answer it
            status_code = getattr(error, "status", 400 if isinstance(error, InvalidInputError) else 500)
        api, tracer = self.tracing.api, self.tracing.tracer
        span = tracer.start_span(f"{self.operation} {self.model}", context=self.parent, kind=api.SpanKind.SERVER,
                                 start_time=self._ns(self.start), attributes=self._attributes(end, status_code))
        if error is not None:
            span.set_attribute("error.type", type(error).__name__)
        if error is not None or status_code >= 500:
            span.set_status(api.Status(api.StatusCode.ERROR, str(error) if error is not None else None))
        inside = api.set_span_in_context(span)

        def child(name: str, start: float, stop: float, attributes: dict, context: Any = inside) -> Any:
            s = tracer.start_span(name, context=context, start_time=self._ns(start), attributes=attributes)
            s.end(end_time=self._ns(max(start, stop)))
            return s

        requests = self.engine_requests
        if requests:
            child("preprocess", self.start, min(r.submitted for r in requests), {})
        for r in requests:
            ids = {"gen_ai.request.id": r.request_id, "weld.prompt_index": r.index}
            started = r.first_step_start
            child("queue", r.submitted, started if started is not None else end, ids)
            if started is None:
                continue
            first_token = r.first_token_at if r.first_token_at is not None else end
            prefill = child("prefill", started, first_token,
                            {**ids, "gen_ai.usage.prompt_tokens": r.num_prompt_tokens,
                             "gen_ai.usage.cache_read.input_tokens": r.num_cached_tokens,
                             "weld.prefill.steps": len(r.chunk_ends)})
            if len(r.chunk_ends) > 1:
                in_prefill = api.set_span_in_context(prefill)
                for k, (a, b) in enumerate(zip([started, *r.chunk_ends], r.chunk_ends)):
                    child("prefill_chunk", a, b, {"weld.prefill.step": k}, in_prefill)
            if r.first_token_at is not None and r.last_output_at > r.first_token_at:
                child("decode", r.first_token_at, r.last_output_at,
                      {**ids, "gen_ai.usage.completion_tokens": r.num_tokens})
        last = max((r.last_output_at for r in requests if r.last_output_at is not None), default=None)
        if last is not None:
            child("response", last, end, {})
        span.end(end_time=self._ns(end))

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.epoch_offset_ns

    def _attributes(self, end: float, status_code: int) -> dict:
        requests = self.engine_requests
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": self.operation, "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model, "http.request.method": "POST", "url.path": self.path,
            "http.response.status_code": status_code, "gen_ai.latency.e2e": end - self.start}
        if self.response_id is not None:
            attributes["gen_ai.response.id"] = self.response_id
        if not requests:
            return attributes
        params = requests[0].params
        prompt_tokens = sum(r.num_prompt_tokens for r in requests)
        completion_tokens = sum(r.num_tokens for r in requests)
        attributes.update({
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k, "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.n": params.n, "gen_ai.request.presence_penalty": params.presence_penalty,
            "gen_ai.request.frequency_penalty": params.frequency_penalty,
            "gen_ai.usage.prompt_tokens": prompt_tokens, "gen_ai.usage.completion_tokens": completion_tokens,
            "gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": sum(r.num_cached_tokens for r in requests),
            "gen_ai.usage.num_sequences": params.n * len(requests),
            "gen_ai.response.finish_reasons": [f for r in requests for f in r.finish_reasons]})
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        # vLLM's latency attributes; with several prompts, the slowest prompt's
        firsts = [r.first_token_at for r in requests if r.first_token_at is not None]
        if firsts:
            attributes["gen_ai.latency.time_to_first_token"] = min(firsts) - self.start
        queued = [r.first_step_start - r.submitted for r in requests if r.first_step_start is not None]
        if queued:
            attributes["gen_ai.latency.time_in_queue"] = max(queued)
        prefills = [r.first_token_at - r.first_step_start for r in requests
                    if r.first_token_at is not None and r.first_step_start is not None]
        if prefills:
            attributes["gen_ai.latency.time_in_model_prefill"] = max(prefills)
        decodes = [r.last_output_at - r.first_token_at for r in requests if r.first_token_at is not None]
        if decodes:
            attributes["gen_ai.latency.time_in_model_decode"] = max(decodes)
        return attributes
