"""What the drill records: one request, one fault, one sample of a process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Record:
    route: str
    outcome: str
    start: float
    end: float
    retry_after: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome == "200"


@dataclass
class Fault:
    name: str
    child: str
    at: float = 0.0  # drill clock
    old_pid: int | None = None
    new_pid: int | None = None
    detected_s: float | None = None  # SIGSTOP: fault -> the supervisor's SIGKILL
    exit_reason: str | None = None
    recovery_s: float | None = None
    failed_during: int = 0  # requests that did not succeed, started between fault and recovery
    cut: int = 0  # requests in flight at the fault that did not succeed
    sessions: list[dict[str, Any]] = field(default_factory=list)
    durable_wait_s: float | None = None  # after the write-behind bound, until the probes were durable


@dataclass
class Sample:
    t: float
    rss_kib: int
    fds: int
