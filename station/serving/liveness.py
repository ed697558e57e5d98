"""The ``health`` op's ``serving`` figures: the engine loop's heartbeat and the tokenizer
workers' jobs (``gnosis_daemon.liveness`` says what they mean and when they are stuck).

Read on the trio thread without locks: the engine's ``loop_idle`` / ``loop_turned`` and the
server's ``text_jobs`` are plain attributes its threads set; a figure may be a moment old.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gnosis_daemon.liveness import stall_reason

if TYPE_CHECKING:
    from station.serving.server import StationServer


def serving_report(server: StationServer) -> dict[str, Any]:
    now = time.monotonic()
    engine = server.engine
    busy = not engine.loop_idle
    jobs = sorted((now - started for started in list(server.text_jobs.values())), reverse=True)
    report: dict[str, Any] = {
        "engine_busy": busy,
        "engine_loop_age_s": round(now - engine.loop_turned, 3) if busy else 0.0,
        "tokenizer_workers": server.text_threads,
        "tokenizer_jobs_s": [round(age, 3) for age in jobs],  # oldest first
    }
    report["stalled"] = stall_reason(report, server.settings.engine_stall_s,
                                     server.settings.tokenizer_stall_s)
    return report
