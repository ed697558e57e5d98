"""The metrics of one ``/metrics`` scrape that the host does not count itself: its gauges,
what the station's ``stats`` answered just now, and the supervisor's child restarts.

``ScrapeCollector`` yields them as metric families beside the app's registry. Figures that
could not be read this scrape (the station down, busy past the deadline, no supervisor) are
absent, never a stale or invented value.

- station ``stats``: the KV tiers (``gnosis_kv_tier_*{tier}``), requests running and waiting
  in the station, and the KV pool's usage, under ``gnosis_*`` names and the ``vllm:*`` names
  that autoscalers and routers read (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, label ``model_name``).
- TTL pins (``station.core.pins``) by TTL class, ``ttl`` the dialects' name of its seconds
  (``5m``, ``1h``, ``24h``; another TTL as its seconds): ``gnosis_kv_pins{ttl}``,
  ``gnosis_kv_pinned_bytes{ttl}``, ``gnosis_kv_pins_expired_total{ttl}``,
  ``gnosis_kv_pins_downgraded_total{ttl}`` (saved unpinned past ``kv_pin_tenant_bytes``).
- ``gnosis_child_restarts_total{child}``: the restarts the supervisor counts, from its status
  file, only when that supervisor is this host's parent (a status file left behind by
  another run says nothing about this one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CHILDREN = ("station", "host")

# (metric, type, {tier label: station stats key}): the KV tiers from ``stats``.
_TIER_METRICS = (
    ("kv_tier_sessions", "gauge", {"pool": "kv_sessions", "disk": "kv_disk_sessions"}),
    ("kv_tier_bytes", "gauge", {"host": "host_bytes", "disk": "disk_bytes"}),
    ("kv_tier_budget_bytes", "gauge", {"host": "host_budget_bytes", "disk": "disk_budget_bytes"}),
    ("kv_tier_block_hits_total", "counter", {"host": "host_block_hits"}),
    ("kv_tier_block_misses_total", "counter", {"host": "host_block_misses"}),
    ("kv_tier_loads_total", "counter", {"disk": "read_back_done"}),
    ("kv_tier_load_failures_total", "counter", {"disk": "read_back_failures"}),
    ("kv_tier_load_ms_p50", "gauge", {"disk": "read_back_ms_p50"}),
    ("kv_tier_load_ms_p99", "gauge", {"disk": "read_back_ms_p99"}),
    ("kv_tier_writes_total", "counter", {"disk": "write_behind_done"}),
    ("kv_tier_write_errors_total", "counter", {"disk": "write_behind_errors"}),
    ("kv_tier_write_behind_late_total", "counter", {"disk": "write_behind_late"}),
    ("kv_tier_write_behind_dropped_total", "counter", {"disk": "write_behind_dropped"}),
    ("kv_tier_files_written_total", "counter", {"disk": "disk_writes"}),
    ("kv_tier_bytes_written_total", "counter", {"disk": "disk_bytes_written"}),
    ("kv_tier_write_behind_lag_ms_p50", "gauge", {"disk": "write_behind_lag_ms_p50"}),
    ("kv_tier_write_behind_lag_ms_p99", "gauge", {"disk": "write_behind_lag_ms_p99"}),
    ("kv_tier_write_behind_queued", "gauge", {"disk": "write_behind_queued"}),
    ("kv_tier_quarantined_total", "counter", {"disk": "disk_quarantined_total"}),
    ("kv_tier_quarantine_kept", "gauge", {"disk": "disk_quarantine_kept"}),
    ("kv_tier_quarantine_kept_bytes", "gauge", {"disk": "disk_quarantine_kept_bytes"}),
    ("kv_tier_quarantine_deleted_total", "counter", {"disk": "disk_quarantine_deleted"}),
    ("kv_tier_evicted_over_share_total", "counter", {"disk": "disk_evicted_over_share"}),
    ("kv_tier_disk_full_total", "counter", {"disk": "disk_disk_full"}),
    ("kv_tier_disk_full_evicted_total", "counter", {"disk": "disk_disk_full_evicted"}),
    ("kv_tier_root_lost_total", "counter", {"disk": "disk_lost"}),
    ("kv_tier_root_lost_sessions_total", "counter", {"disk": "disk_lost_sessions"}),
    ("kv_tier_io_cpu_seconds_total", "counter", {"disk": "kv_io_cpu_s"}),
    ("kv_tier_offloaded_total", "counter", {"pool": "kv_sessions_offloaded"}),
    ("kv_tier_lost_total", "counter", {"pool": "kv_sessions_lost"}),
)

# (gnosis name, vllm name, help, station stats key)
_LOAD_GAUGES = (
    ("gnosis_requests_running", "vllm:num_requests_running",
     "Requests the station is running (prefill or decode)", "running"),
    ("gnosis_requests_waiting", "vllm:num_requests_waiting",
     "Requests waiting in the station for a slot", "waiting"),
)


_PIN_METRICS = (
    ("gnosis_kv_pins", "Live TTL pins in the station, by TTL class"),
    ("gnosis_kv_pinned_bytes", "KV bytes the live TTL pins hold, by TTL class"),
    ("gnosis_kv_pins_expired", "TTL pins that expired (deleted from every tier), by TTL class"),
    ("gnosis_kv_pins_downgraded", "TTL pins saved unpinned past kv_pin_tenant_bytes, by TTL class"),
)


class ScrapeCollector(Collector):
    """``gauges``: host gauges (``gnosis_<name>``); ``stats``: the station's ``stats``
    answer or None; ``model_name``: the served model id; ``restarts``: child -> restarts."""

    def __init__(self, gauges: dict[str, float], stats: dict[str, Any] | None,
                 model_name: str | None, restarts: dict[str, int] | None = None,
                 ttl_names: dict[float, str] | None = None) -> None:
        self.gauges = gauges
        self.stats = stats
        self.model_name = model_name
        self.restarts = restarts
        self.ttl_names = ttl_names or {}  # a TTL's seconds -> its class name (label ``ttl``)

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self.gauges.items()):
            yield _gauge(f"gnosis_{name}", name.replace("_", " "), value)
        if self.stats is not None:
            yield from tier_families(self.stats)
            yield from self._load(self.stats)
            yield from self._pins(self.stats.get("kv_pins_by_ttl"))
        if self.restarts:
            family = CounterMetricFamily("gnosis_child_restarts", "Restarts of each child by "
                                         "the supervisor", labels=("child",))
            for child, count in sorted(self.restarts.items()):
                family.add_metric((child,), count)
            yield family

    def _pins(self, by_ttl: Any) -> Iterator[Metric]:
        if not isinstance(by_ttl, dict):
            return  # a station without pins
        families = [(GaugeMetricFamily if i < 2 else CounterMetricFamily)(name, doc, labels=("ttl",))
                    for i, (name, doc) in enumerate(_PIN_METRICS)]
        for ttl, counts in sorted(by_ttl.items()):
            try:
                label = self.ttl_names.get(float(ttl), str(ttl))
            except (TypeError, ValueError):
                label = str(ttl)
            for family, key in zip(families, ("pins", "bytes", "expired", "downgraded")):
                value = _number(counts.get(key)) if isinstance(counts, dict) else None
                if value is not None:
                    family.add_metric((label,), value)
        yield from families

    def _load(self, stats: dict[str, Any]) -> Iterator[Metric]:
        figures = [(gnosis, vllm, doc, _number(stats.get(key)))
                   for gnosis, vllm, doc, key in _LOAD_GAUGES]
        total, free = _number(stats.get("blocks_total")), _number(stats.get("blocks_free"))
        if total and free is not None:
            figures.append(("gnosis_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc",
                            "Fraction of the KV pool's blocks in use (1 = full)",
                            min(1.0, max(0.0, 1.0 - free / total))))
        for gnosis, vllm, doc, value in figures:
            if value is None:
                continue
            yield _gauge(gnosis, doc, value)
            if self.model_name is not None:
                family = GaugeMetricFamily(vllm, doc, labels=("model_name",))
                family.add_metric((self.model_name,), value)
                yield family


def tier_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """The KV tiers' figures in ``stats``; a metric none of whose keys is there is left out."""
    for metric, kind, keys in _TIER_METRICS:
        numbers = [(tier, _number(stats.get(key))) for tier, key in keys.items()]
        values = [(tier, value) for tier, value in numbers if value is not None]
        if not values:
            continue
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(f"gnosis_{metric}", metric.replace("_", " "), labels=("tier",))
        for tier, value in values:
            family.add_metric((tier,), value)
        yield family


def supervisor_restarts(status_file: str | os.PathLike[str],
                        parent_pid: int | None = None) -> dict[str, int] | None:
    """Each child's restarts from the supervisor's status file, when the supervisor that
    wrote it is ``parent_pid`` (this process's parent by default); else None."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    try:
        document = json.loads(Path(status_file).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict):
        return None
    supervisor, children = document.get("supervisor"), document.get("children")
    if not isinstance(supervisor, dict) or supervisor.get("pid") != parent_pid \
            or not isinstance(children, dict):
        return None
    restarts = {}
    for child in CHILDREN:
        entry = children.get(child)
        count = entry.get("restarts") if isinstance(entry, dict) else None
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            restarts[child] = count
    return restarts or None


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
