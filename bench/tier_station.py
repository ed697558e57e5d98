"""What the disk-tier figures share: a station of their own, and waits on its writer."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import trio

from bench.common import start_station, stop_station

POLL_S = 0.05  # stats polls while a decode runs (both sides), and while waiting for the writer


class TierBenchError(RuntimeError):
    """The tier did not do what a figure relies on: it would measure nothing."""


@contextlib.contextmanager
def tier_station(settings, runtime_dir: Path):
    """A station on ``runtime_dir`` (its tier: ``runtime_dir/state/kv-tier``); -> (socket,
    seconds from spawn to the first hello answered). A clean stop flushes the writer."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = start_station(settings, runtime_dir, runtime_dir.parent / f"{runtime_dir.name}.log")
    started_s = time.perf_counter() - start
    try:
        yield runtime_dir / "station.sock", started_s
    finally:
        stop_station(proc)


def check_tier(hello: dict) -> dict:
    tier = hello.get("kv_tier") or {}
    if not tier.get("enabled") or tier.get("error") or "start_sessions" not in tier:
        raise TierBenchError(f"the station has no disk tier: {tier}")
    return tier


async def settle(conn, sessions: int = 0, timeout_s: float = 300.0) -> dict:
    """Wait until the write-behind is idle (nothing queued, no byte written for 3 polls)
    and the store holds at least ``sessions`` manifests; -> the stats then."""
    # An engine call wakes the engine thread: a session saved in a sequence's last step (a
    # generate of max_tokens 1) is only queued for writing when the engine next wakes up.
    await conn.request("kv_session.list", {})
    deadline = time.monotonic() + timeout_s
    last, still = None, 0
    while True:
        stats = await conn.request("stats", {})
        written = stats.get("disk_bytes_written")
        idle = stats["write_behind_queued"] == 0 and stats.get("disk_sessions", 0) >= sessions
        still = still + 1 if idle and written == last else 0
        if still >= 3:
            return stats
        if time.monotonic() > deadline:
            raise TierBenchError(f"the write-behind did not settle in {timeout_s:.0f} s: {stats}")
        last = written
        await trio.sleep(POLL_S)
