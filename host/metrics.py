"""Per-request record, its one canonical log line, and the host's Prometheus metrics.

A ``RequestRecord`` lives for one HTTP request (a contextvar set by the app's connection
class, so the view, a streamed body and the final log line all see the same one). It is
logged exactly once, when the request's task ends, whatever way it ends, and observed into
the app's ``Metrics`` then: counters by route, status and liquid outcome, and for a
completion the latency and token histograms.

``Metrics`` owns one ``CollectorRegistry`` per app (tests build several apps in one process).
What the station says at scrape time (running and waiting requests, KV usage, the KV tiers)
is not kept here: ``host.scrape_metrics`` turns each scrape's ``stats`` answer into metric
families. Names come in two sets that share observations: ``gnosis_*``, and the ``vllm:*``
names (label ``model_name``, the served model id) that vLLM's dashboards, autoscaling rules
and routers read. Every label value comes from a bounded set: route rules, HTTP statuses,
liquid outcomes, tiers, finish reasons, the served model id; never from a client's string.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.registry import Collector

from gnosis_daemon.logs import get_logger
from host.liquid import OUTCOMES as LIQUID_OUTCOMES

log = get_logger("host.request")

Closer = Callable[[], Awaitable[None]]

TIERS = ("pool", "host", "disk")
FINISH_REASONS = ("stop", "length")  # a station result's finish_reason (vllm:request_success)
# The API dialect of a generation request, by the route it came in on (a POST).
DIALECT_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                  "/v1/messages": "messages", "/v1/responses": "responses"}
DIALECTS = tuple(DIALECT_ROUTES.values())
# TTL pins (Anthropic's cache_control, OpenAI's prompt_cache_retention): the TTL class a
# pin was asked with, and what became of it (created: pinned anew; read: served from a live
# pin; downgraded: kept as an ordinary LRU session, the tenant's pin budget being full;
# refused: not saved at all).
PIN_TTLS = ("5m", "1h", "24h")
PIN_OUTCOMES = ("created", "read", "downgraded", "refused")

# Seconds. Time to first token and end-to-end: vLLM's buckets; between tokens: vLLM's, with
# finer ones below 10 ms (a small model on a GPU decodes a token in a few milliseconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token histograms' buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_model_len:
                return tuple(buckets) or (1.0,)
            buckets.append(float(value))
        exponent += 1


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    route: str | None = None  # the matched URL rule: bounded label cardinality for /metrics
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    model: str | None = None  # the served model id; set once a completion is validated
    stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_ms: float | None = None
    liquid_memory: str | None = None  # hit | miss | capture_failed | disabled (completions)
    liquid_reason: str | None = None
    liquid_tier: str | None = None  # a hit: the tier its session came from (pool | disk)
    outcome: str | None = None  # ok | error:<code> | client_disconnected | ...
    # Times (time.monotonic) the host saw, for the latency histograms.
    admitted: float | None = None  # passed the in-flight bound
    prefill_at: float | None = None  # the station's prefill event arrived
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # between successive tokens
    finished_at: float | None = None  # the station's result arrived
    finish_reason: str | None = None
    # The request's TTL pins as (ttl class, outcome): PIN_TTLS x PIN_OUTCOMES.
    pins: list[tuple[str, str]] = field(default_factory=list)
    # Resources a streamed response holds (the station stream); run when the task ends,
    # even if the response body was never iterated.
    closers: list[Closer] = field(default_factory=list)

    def on_tokens(self, count: int) -> None:
        """``count`` tokens arrived from the station at once (one event)."""
        now = time.monotonic()
        for _ in range(count):
            if self.last_token_at is None:
                self.first_token_at = now
            else:
                self.token_gaps.append(now - self.last_token_at)
            self.last_token_at = now

    def fields(self) -> dict[str, Any]:
        return {
            "method": self.method, "path": self.path, "status": self.status,
            "model": self.model, "stream": self.stream,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens, "ttft_ms": self.ttft_ms,
            "liquid_memory": self.liquid_memory, "liquid_reason": self.liquid_reason,
            "duration_ms": round((time.monotonic() - self.started) * 1000, 3),
            "outcome": self.outcome,
        }


current_record: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "gnosis_request_record", default=None)

MODEL = ("model_name",)


class Metrics:
    """The host's metrics in its own registry; ``inflight`` counts HTTP requests whose task
    has not ended (the drain waits for 0)."""

    def __init__(self, max_model_len: int) -> None:
        # A counter's "_created" series would double every counter and histogram.
        prometheus_client.disable_created_metrics()
        self.registry = r = CollectorRegistry()
        self.inflight = 0
        self.http_requests = Counter("gnosis_http_requests", "HTTP requests by route and status",
                                     ("path", "status"), registry=r)
        self.prompt_tokens = Counter("gnosis_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("gnosis_completion_tokens", "Completion tokens",
                                         registry=r)
        self.cached_tokens = Counter("gnosis_cached_tokens",
                                     "Prompt tokens whose KV came from the cache", registry=r)
        self.liquid = Counter("gnosis_liquid_memory", "Completions by liquid-memory outcome",
                              ("outcome",), registry=r)
        self.liquid_hits = Counter("gnosis_liquid_hits", "Liquid-memory hits by the tier the "
                                   "session came from", ("tier",), registry=r)
        self.dialects = Counter("gnosis_requests_by_dialect", "Generation requests by API "
                                "dialect (the route they came in on)", ("dialect",), registry=r)
        for dialect in DIALECTS:
            self.dialects.labels(dialect)
        self.pins = Counter("gnosis_cache_pins", "TTL pins asked for, by TTL class and outcome",
                            ("ttl", "outcome"), registry=r)
        for ttl in PIN_TTLS:
            for pin_outcome in PIN_OUTCOMES:
                self.pins.labels(ttl, pin_outcome)
        for outcome in LIQUID_OUTCOMES:
            self.liquid.labels(outcome)
        for tier in TIERS:
            self.liquid_hits.labels(tier)
        self.prefix_queries = _pair(Counter, "prefix_cache_queries", "Prompt tokens looked up "
                                    "in the prefix cache (completions prefilled)", r)
        self.prefix_hits = _pair(Counter, "prefix_cache_hits", "Prompt tokens found in the "
                                 "prefix cache or a KV session", r)
        self.ttft = Histogram("gnosis_time_to_first_token_seconds", "From the request's arrival "
                              "to its first token, by liquid-memory outcome", ("liquid_memory",),
                              registry=r, buckets=TTFT_BUCKETS)
        for outcome in LIQUID_OUTCOMES:
            self.ttft.labels(outcome)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                   MODEL, registry=r, buckets=TTFT_BUCKETS)
        self.itl = _pair(Histogram, "inter_token_latency_seconds", "Time between two successive "
                         "tokens of a completion", r, ITL_BUCKETS)
        self.e2e = _pair(Histogram, "e2e_request_latency_seconds", "From the request's arrival "
                         "to the end of its generation", r, E2E_BUCKETS)
        self.queue = Histogram("gnosis_request_queue_time_seconds", "From the request's admission "
                               "to the station's prefill event (its queue wait plus the prompt's "
                               "prefill)", registry=r, buckets=TTFT_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_hist = Histogram("gnosis_request_prompt_tokens", "Prompt tokens of each "
                                     "finished completion", registry=r, buckets=tokens)
        self.completion_hist = Histogram("gnosis_request_completion_tokens", "Completion tokens "
                                         "of each finished completion", registry=r, buckets=tokens)
        self.vllm_prompt_hist = Histogram("vllm:request_prompt_tokens", "Prompt tokens of each "
                                          "finished request", MODEL, registry=r, buckets=tokens)
        self.vllm_generation_hist = Histogram("vllm:request_generation_tokens", "Generated tokens"
                                              " of each finished request", MODEL, registry=r,
                                              buckets=tokens)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens", MODEL,
                                          registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Generated tokens",
                                              MODEL, registry=r)
        self.vllm_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                    ("model_name", "finished_reason"), registry=r)
        # Clients that stopped reading: a response ended after stream_stall_timeout_s without
        # a byte taken, and a stream ended for falling stream_buffer_bytes behind.
        self.stalled = Counter("gnosis_stalled_responses", "Responses ended because their "
                               "client took no byte for stream_stall_timeout_s", registry=r)
        self.overflows = Counter("gnosis_stream_buffer_overflows", "Streams ended because "
                                 "their client fell stream_buffer_bytes behind", registry=r)

    def touch(self, model: str) -> None:
        """Give ``model``'s labelled series their zero values before its first request."""
        for metric in (self.prefix_queries[1], self.prefix_hits[1], self.vllm_ttft,
                       self.itl[1], self.e2e[1], self.vllm_prompt_hist,
                       self.vllm_generation_hist, self.vllm_prompt_tokens,
                       self.vllm_generation_tokens):
            metric.labels(model)
        for reason in FINISH_REASONS:
            self.vllm_success.labels(model, reason)

    def observe(self, record: RequestRecord) -> None:
        self.http_requests.labels(record.route or "unmatched", str(record.status or 0)).inc()
        dialect = DIALECT_ROUTES.get(record.route or "") if record.method == "POST" else None
        if dialect is not None:
            self.dialects.labels(dialect).inc()
        for ttl, pin_outcome in record.pins:
            if ttl in PIN_TTLS and pin_outcome in PIN_OUTCOMES:
                self.pins.labels(ttl, pin_outcome).inc()
        self.prompt_tokens.inc(_n(record.prompt_tokens))
        self.completion_tokens.inc(_n(record.completion_tokens))
        self.cached_tokens.inc(_n(record.cached_tokens))
        if record.liquid_memory in LIQUID_OUTCOMES:
            self.liquid.labels(record.liquid_memory).inc()
        if record.liquid_tier in TIERS:
            self.liquid_hits.labels(record.liquid_tier).inc()
        if record.model is not None:
            self._observe_completion(record, record.model)

    def _observe_completion(self, record: RequestRecord, model: str) -> None:
        self.touch(model)
        if record.prefill_at is not None:
            _inc(self.prefix_queries, model, _n(record.prompt_tokens))
            _inc(self.prefix_hits, model, _n(record.cached_tokens))
            self.vllm_prompt_tokens.labels(model).inc(_n(record.prompt_tokens))
            self.queue.observe(record.prefill_at - (record.admitted or record.started))
        self.vllm_generation_tokens.labels(model).inc(_n(record.completion_tokens))
        if record.first_token_at is not None:
            ttft = record.first_token_at - record.started
            self.ttft.labels(record.liquid_memory if record.liquid_memory in LIQUID_OUTCOMES
                             else "disabled").observe(ttft)
            self.vllm_ttft.labels(model).observe(ttft)
        for gap in record.token_gaps:
            _observe(self.itl, model, gap)
        if record.finished_at is None:
            return
        _observe(self.e2e, model, record.finished_at - record.started)
        prompt, completion = _n(record.prompt_tokens), _n(record.completion_tokens)
        self.prompt_hist.observe(prompt)
        self.vllm_prompt_hist.labels(model).observe(prompt)
        self.completion_hist.observe(completion)
        self.vllm_generation_hist.labels(model).observe(completion)
        if record.finish_reason in FINISH_REASONS:
            self.vllm_success.labels(model, record.finish_reason).inc()

    def render(self, *scraped: Collector) -> bytes:
        """The registry and ``scraped`` (collectors of this scrape) in the text format."""
        return prometheus_client.generate_latest(_Union(self.registry, *scraped))


class _Union(Collector):
    def __init__(self, *collectors: Collector) -> None:
        self.collectors = collectors

    def collect(self) -> Any:
        for collector in self.collectors:
            yield from collector.collect()


def _n(value: Any) -> int:
    """A token count from the station as a counter increment: a non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _pair(kind: Any, name: str, doc: str, registry: CollectorRegistry,
          buckets: tuple[float, ...] | None = None) -> tuple[Any, Any]:
    """``gnosis_<name>`` (no labels) and ``vllm:<name>`` (model_name): one observation each."""
    extra = {} if buckets is None else {"buckets": buckets}
    return (kind(f"gnosis_{name}", doc, registry=registry, **extra),
            kind(f"vllm:{name}", doc, MODEL, registry=registry, **extra))


def _inc(pair: tuple[Counter, Counter], model: str, amount: float) -> None:
    pair[0].inc(amount)
    pair[1].labels(model).inc(amount)


def _observe(pair: tuple[Histogram, Histogram], model: str, value: float) -> None:
    pair[0].observe(value)
    pair[1].labels(model).observe(value)


def emit(record: RequestRecord, metrics: Metrics) -> None:
    metrics.observe(record)
    log.info("request", **record.fields())
