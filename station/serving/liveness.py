"""The ``health`` op's ``serving`` figures: the engine loop's heartbeat and the tokenizer
workers' jobs (``gnosis_daemon.liveness`` says what they mean and when they are stuck).

Read on the trio thread without locks: the engine's ``loop_idle`` / ``loop_turned`` and the
server's ``text_jobs`` are plain attributes its threads set; a figure may be a moment old.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gnosis_daemon.liveness import stall_reason
from gnosis_daemon.settings import Settings

if TYPE_CHECKING:
    from station.engine.loop import PagedEngine


def serving_report(engine: PagedEngine, text_jobs: Mapping[object, float], text_threads: int,
                   settings: Settings) -> dict[str, Any]:
    """``text_jobs``: the tokenizer jobs running now, with when each began (monotonic);
    ``text_threads``: how many worker threads run them."""
    now = time.monotonic()
    busy = not engine.loop_idle
    jobs = sorted((now - started for started in list(text_jobs.values())), reverse=True)
    report: dict[str, Any] = {
        "engine_busy": busy,
        "engine_loop_age_s": round(now - engine.loop_turned, 3) if busy else 0.0,
        "tokenizer_workers": text_threads,
        "tokenizer_jobs_s": [round(age, 3) for age in jobs],  # oldest first
    }
    report["stalled"] = stall_reason(report, settings.engine_stall_s, settings.tokenizer_stall_s)
    return report
