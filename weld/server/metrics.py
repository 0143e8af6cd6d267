"""Prometheus metrics: vLLM's metric set, named `weld:` instead of `vllm:`, labelled by model_name.

Gauges and the engine's cumulative counters (prefix cache, preemptions) are read from
`AsyncLLM.stats()` when /metrics is scraped. Per-request figures are measured here, in the
server, as the stream goes by:

- time to first token: request arrival to the first output with a token;
- inter-token latency: the gap between two outputs divided by the tokens the later one added,
  observed once per token (the fused decode delivers several tokens per engine call, so this is
  the per-token cost, not the burst gap a client sees);
- queue time: arrival to the start of the engine step that produced the request's first output
  (for a prompt prefilled in one step, the moment it left the waiting queue);
- end-to-end latency: arrival to the final output.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

PREFIX = "weld:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Metrics:
    """One registry per app, so several apps (tests) never share counters."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # no `*_created` series: vLLM's scrapers do not expect them
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Number of sequences in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of sequences waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of pages in use.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter(PREFIX + "request_success", "Count of finished requests.",
                                       ["model_name", "finished_reason"], registry=r)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token in seconds.",
                                             _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Inter-token latency in seconds.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "End-to-end request latency in seconds.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Time spent in the waiting queue, in seconds.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request.", _TOKEN_BUCKETS)
        self._seen = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        self.num_requests_running.set(stats["running"])
        self.num_requests_waiting.set(stats["waiting"])
        pages = stats["num_pages"]
        self.kv_cache_usage_perc.set((pages - stats["num_free_pages"]) / pages if pages else 0.0)
        for key in self._seen:
            delta = stats[key] - self._seen[key]
            if delta > 0:
                getattr(self, key).inc(delta)
                self._seen[key] = stats[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one engine request (one prompt; its n completions share it) from its arrival."""

    def __init__(self, metrics: Metrics, arrival: float, num_prompt_tokens: int):
        self.metrics = metrics
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.first_token_at: float | None = None
        self.last_at = arrival
        self.num_tokens = 0
        self.finished = False
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def on_output(self, now: float, num_tokens: int, first_step_start: float | None = None) -> None:
        """`num_tokens`: the request's total generated tokens so far (all n completions)."""
        new = num_tokens - self.num_tokens
        if new <= 0:
            return
        m = self.metrics
        if self.first_token_at is None:
            self.first_token_at = now
            m.time_to_first_token.observe(now - self.arrival)
            if first_step_start is not None:
                m.request_queue_time.observe(max(0.0, first_step_start - self.arrival))
            new_after_first = new - 1
        else:
            new_after_first = new
        if new_after_first > 0:
            per_token = (now - self.last_at) / new_after_first
            for _ in range(new_after_first):
                m.inter_token_latency.observe(per_token)
        m.generation_tokens.inc(new)
        self.num_tokens = num_tokens
        self.last_at = now

    def on_finish(self, now: float, finish_reason: str | None) -> None:
        if self.finished:
            return
        self.finished = True
        m = self.metrics
        m.e2e_request_latency.observe(now - self.arrival)
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        m.request_success.labels(m.model_name, finish_reason or "abort").inc()
