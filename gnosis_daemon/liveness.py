"""Is a station's serving side stuck? The verdict the station's ``health`` op reports and the
supervisor's probe acts on (``supervisor.probes.station_health``), from the figures the op
reports under ``serving`` (``station.serving.liveness``):

- ``engine_busy`` / ``engine_loop_age_s``: whether the engine thread is inside one turn of
  its loop (it only leaves its wait when there is work) and for how long. Stuck: busy for
  longer than ``engine_stall_s``. An idle engine is never stuck, however long since it turned.
- ``tokenizer_workers`` / ``tokenizer_jobs_s``: the worker threads for tokenizer work
  (chat templates, tokenizing, grammar compiles) and the age of each job they run. Stuck:
  every worker on a job older than ``tokenizer_stall_s`` (one slow job leaves the other
  worker serving; when all are taken, every other request waits behind them).

The socket's trio thread answers ``health`` inline, so a station stuck this way still
answers it: without this verdict the supervisor would see a healthy station.
"""

from __future__ import annotations

from typing import Any


def stall_reason(serving: dict[str, Any] | None, engine_stall_s: float,
                 tokenizer_stall_s: float) -> str | None:
    """Why the serving side is stuck, or None (also for a station that reports nothing)."""
    if not isinstance(serving, dict):
        return None
    age = float(serving.get("engine_loop_age_s") or 0.0)
    if serving.get("engine_busy") and age > engine_stall_s:
        return (f"the engine loop has not turned for {age:.1f} s with work pending "
                f"(engine_stall_s {engine_stall_s:g})")
    jobs = [float(a) for a in serving.get("tokenizer_jobs_s") or ()]
    workers = int(serving.get("tokenizer_workers") or 0)
    if workers and len(jobs) >= workers and min(jobs) > tokenizer_stall_s:
        return (f"all {workers} tokenizer workers have been on one job for over "
                f"{min(jobs):.1f} s (tokenizer_stall_s {tokenizer_stall_s:g})")
    return None
