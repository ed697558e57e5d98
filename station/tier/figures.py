"""The disk tier's figures (``stats``, ``/metrics``): write-behind, read-back, shared tier."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

_LAG_WINDOW = 4096  # write-behind lags kept for the percentiles


@dataclass(slots=True)
class TierFigures:
    writes: int = 0  # sessions made durable
    write_errors: int = 0
    dropped_writes: int = 0  # queued while the disk stalled, given up (logged by name)
    loads: int = 0
    load_failures: int = 0
    load_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LAG_WINDOW))
    lag_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LAG_WINDOW))
    queued_writes: int = 0
    late_writes: int = 0  # made durable later than kv_write_behind_s after the save
    touches: int = 0
    shared_added: int = 0  # a shared tier: sessions other replicas saved, learned by rescan
    shared_removed: int = 0  # ... and sessions whose manifests they removed

    def as_dict(self) -> dict[str, Any]:
        # Not "disk_*": those are the store's own figures (files written, bytes...).
        return {"write_behind_done": self.writes, "write_behind_errors": self.write_errors,
                "write_behind_late": self.late_writes, "write_behind_dropped": self.dropped_writes,
                "read_back_done": self.loads, "read_back_failures": self.load_failures,
                "read_back_ms_p50": _pct(self.load_ms, 0.5),
                "read_back_ms_p99": _pct(self.load_ms, 0.99),
                "write_behind_lag_ms_p50": _pct(self.lag_ms, 0.5),
                "write_behind_lag_ms_p99": _pct(self.lag_ms, 0.99),
                "write_behind_queued": self.queued_writes, "disk_touches": self.touches,
                "shared_sessions_added": self.shared_added,
                "shared_sessions_removed": self.shared_removed}


def _pct(values: collections.deque, q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None
