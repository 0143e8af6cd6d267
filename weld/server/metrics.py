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

With speculative decoding on (the engine's stats carry `spec_*` keys), vLLM's speculative
counters appear too: `spec_decode_num_drafts` (row-steps that verified at least one draft),
`spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens` and
`spec_decode_num_accepted_tokens_per_pos` (label `position`, from 0). weld adds
`spec_decode_num_draft_tokens_per_pos` (an n-gram proposal may fill fewer than k slots, so the
rate of slot j is accepted / drafted in that slot) and the gauge
`spec_decode_mean_acceptance_length` (1 + accepted / drafts since the start; 0 before any draft).
Without speculation these series are absent, as in vLLM.
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
        self.compiled_programs = gauge("compiled_programs", "Device programs compiled so far (one per distinct "
                                                            "batch shape and variant; each costs memory and seconds).")
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
        self._spec: _SpecMetrics | None = None  # made at the first stats with speculative counters

    def start_from(self, stats: dict[str, Any]) -> None:
        """Counts the engine's cumulative counters from their values in `stats` on: what ran
        before the server (the warm-up) is not counted."""
        self._seen = {key: stats[key] for key in self._seen}
        if "spec_num_drafts" in stats:
            self._spec = _SpecMetrics(self.registry, self.model_name)
            self._spec.seen = {name: stats[key] for name, key in _SpecMetrics.COUNTERS.items()}
            self._spec.seen.update({(name, position): value for name, key in _SpecMetrics.PER_POSITION.items()
                                    for position, value in enumerate(stats[key])})

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        self.num_requests_running.set(stats["running"])
        self.num_requests_waiting.set(stats["waiting"])
        pages = stats["num_pages"]
        self.kv_cache_usage_perc.set((pages - stats["num_free_pages"]) / pages if pages else 0.0)
        self.compiled_programs.set(stats.get("num_compiles", 0))
        for key in self._seen:
            self._seen[key] = _advance(getattr(self, key), self._seen[key], stats[key])
        if "spec_num_drafts" in stats:
            if self._spec is None:
                self._spec = _SpecMetrics(self.registry, self.model_name)
            self._spec.update(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _advance(counter: Any, seen: float, value: float) -> float:
    """Moves a Prometheus counter up to the engine's cumulative `value`; returns what it now shows."""
    if value > seen:
        counter.inc(value - seen)
        return value
    return seen


class _SpecMetrics:
    """Speculative decoding counters, mirrored from the engine's cumulative `spec_*` stats."""

    # metric name -> the engine's stats key
    COUNTERS = {"spec_decode_num_drafts": "spec_num_drafts",
                "spec_decode_num_draft_tokens": "spec_num_draft_tokens",
                "spec_decode_num_accepted_tokens": "spec_num_accepted_tokens"}
    PER_POSITION = {"spec_decode_num_accepted_tokens_per_pos": "spec_accepted_per_position",
                    "spec_decode_num_draft_tokens_per_pos": "spec_drafted_per_position"}
    DOCS = {"spec_decode_num_drafts": "Number of spec decoding drafts (row-steps that verified drafted tokens).",
            "spec_decode_num_draft_tokens": "Number of draft tokens.",
            "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
            "spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
            "spec_decode_num_draft_tokens_per_pos": "Draft tokens per draft position."}

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        self.counters = {name: Counter(PREFIX + name, self.DOCS[name], ["model_name"], registry=registry)
                         .labels(model_name) for name in self.COUNTERS}
        self.per_position = {name: Counter(PREFIX + name, self.DOCS[name], ["model_name", "position"],
                                           registry=registry) for name in self.PER_POSITION}
        self.mean_acceptance_length = Gauge(
            PREFIX + "spec_decode_mean_acceptance_length",
            "Mean tokens per verification step that sent drafts (1 + accepted / drafts), since the start.",
            ["model_name"], registry=registry).labels(model_name)
        self.seen: dict[Any, float] = {}

    def update(self, stats: dict[str, Any]) -> None:
        for name, key in self.COUNTERS.items():
            self.seen[name] = _advance(self.counters[name], self.seen.get(name, 0), stats[key])
        for name, key in self.PER_POSITION.items():
            for position, value in enumerate(stats[key]):
                child = self.per_position[name].labels(self.model_name, str(position))
                self.seen[name, position] = _advance(child, self.seen.get((name, position), 0), value)
        self.mean_acceptance_length.set(stats["spec_mean_acceptance_length"] or 0.0)


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
