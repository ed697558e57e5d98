"""Per-request record, its one canonical log line, and process-wide counters for /metrics.

A ``RequestRecord`` lives for one HTTP request (a contextvar set by the app's connection
class, so the view, a streamed body and the final log line all see the same one). It is
logged exactly once, when the request's task ends, whatever way it ends.
"""

from __future__ import annotations

import contextvars
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from gnosis_daemon.logs import get_logger
from host.liquid import OUTCOMES as LIQUID_OUTCOMES

log = get_logger("host.request")

Closer = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    route: str | None = None  # the matched URL rule: bounded label cardinality for /metrics
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    model: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_ms: float | None = None
    liquid_memory: str | None = None  # hit | miss | capture_failed | disabled (completions)
    liquid_reason: str | None = None
    liquid_tier: str | None = None  # a hit: the tier its session came from (pool | disk)
    outcome: str | None = None  # ok | error:<code> | client_disconnected | ...
    # Resources a streamed response holds (the station stream); run when the task ends,
    # even if the response body was never iterated.
    closers: list[Closer] = field(default_factory=list)

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


class Counters:
    """Monotonic counters, rendered in Prometheus text format."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (path, status)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        # Completions by liquid-memory outcome; every outcome is rendered, 0 included.
        self.liquid: Counter[str] = Counter({name: 0 for name in LIQUID_OUTCOMES})
        self.liquid_hits: Counter[str] = Counter({tier: 0 for tier in TIERS})  # hits by tier
        self.inflight = 0  # HTTP requests whose task has not ended (the drain waits for 0)

    def observe(self, record: RequestRecord) -> None:
        self.requests[(record.route or "unmatched", record.status or 0)] += 1
        self.prompt_tokens += record.prompt_tokens or 0
        self.completion_tokens += record.completion_tokens or 0
        self.cached_tokens += record.cached_tokens or 0
        if record.liquid_memory is not None:
            self.liquid[record.liquid_memory] += 1
        if record.liquid_tier is not None:
            self.liquid_hits[record.liquid_tier] += 1

    def render(self, gauges: dict[str, float], station: dict[str, Any] | None = None) -> str:
        """The counters, ``gauges``, and the KV tiers' figures from the station's ``stats``
        (absent when it did not answer)."""
        lines = ["# TYPE gnosis_http_requests_total counter"]
        for (path, status), count in sorted(self.requests.items()):
            lines.append(f'gnosis_http_requests_total{{path="{_label(path)}",status="{status}"}} '
                         f"{count}")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            lines.append(f"# TYPE gnosis_{name}_total counter")
            lines.append(f"gnosis_{name}_total {getattr(self, name)}")
        lines.append("# TYPE gnosis_liquid_memory_total counter")
        for outcome, count in sorted(self.liquid.items()):
            lines.append(f'gnosis_liquid_memory_total{{outcome="{_label(outcome)}"}} {count}')
        lines.append("# TYPE gnosis_liquid_hits_total counter")
        for tier, count in sorted(self.liquid_hits.items()):
            lines.append(f'gnosis_liquid_hits_total{{tier="{_label(tier)}"}} {count}')
        lines.extend(tier_lines(station or {}))
        gauges = {**gauges, "http_requests_inflight": float(self.inflight)}
        for name, value in sorted(gauges.items()):
            lines.append(f"# TYPE gnosis_{name} gauge")
            lines.append(f"gnosis_{name} {value:g}")
        return "\n".join(lines) + "\n"


TIERS = ("pool", "disk")

# (metric, type, {tier label or "": station stats key}): the KV tiers from ``stats``.
_TIER_METRICS = (
    ("kv_tier_sessions", "gauge", {"pool": "kv_sessions", "disk": "kv_disk_sessions"}),
    ("kv_tier_bytes", "gauge", {"disk": "disk_bytes"}),
    ("kv_tier_budget_bytes", "gauge", {"disk": "disk_budget_bytes"}),
    ("kv_tier_loads_total", "counter", {"disk": "read_back_done"}),
    ("kv_tier_load_failures_total", "counter", {"disk": "read_back_failures"}),
    ("kv_tier_load_ms_p50", "gauge", {"disk": "read_back_ms_p50"}),
    ("kv_tier_load_ms_p99", "gauge", {"disk": "read_back_ms_p99"}),
    ("kv_tier_writes_total", "counter", {"disk": "write_behind_done"}),
    ("kv_tier_write_errors_total", "counter", {"disk": "write_behind_errors"}),
    ("kv_tier_write_behind_late_total", "counter", {"disk": "write_behind_late"}),
    ("kv_tier_files_written_total", "counter", {"disk": "disk_writes"}),
    ("kv_tier_bytes_written_total", "counter", {"disk": "disk_bytes_written"}),
    ("kv_tier_write_behind_lag_ms_p50", "gauge", {"disk": "write_behind_lag_ms_p50"}),
    ("kv_tier_write_behind_lag_ms_p99", "gauge", {"disk": "write_behind_lag_ms_p99"}),
    ("kv_tier_write_behind_queued", "gauge", {"disk": "write_behind_queued"}),
    ("kv_tier_quarantined_total", "counter", {"disk": "disk_quarantined_total"}),
    ("kv_tier_offloaded_total", "counter", {"pool": "kv_sessions_offloaded"}),
    ("kv_tier_lost_total", "counter", {"pool": "kv_sessions_lost"}),
)


def tier_lines(stats: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for metric, kind, keys in _TIER_METRICS:
        values = [(tier, stats.get(key)) for tier, key in keys.items()]
        values = [(tier, v) for tier, v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not values:
            continue
        lines.append(f"# TYPE gnosis_{metric} {kind}")
        lines.extend(f'gnosis_{metric}{{tier="{tier}"}} {value:g}' for tier, value in values)
    return lines


def emit(record: RequestRecord, counters: Counters) -> None:
    counters.observe(record)
    log.info("request", **record.fields())


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
