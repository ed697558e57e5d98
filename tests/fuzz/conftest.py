"""One real daemon (``gnosis-daemon run``: supervisor, station, host) for the fuzz package.

Both fuzz modules hammer the same daemon, the HTTP API through the host and the station's
socket directly, so the suite pays for one cold start. Each module takes its own baseline
(pids and restart counts) when it starts and checks at its end that nothing it sent stopped
a process: the station's pid is unchanged and neither the supervisor nor the host counted a
station restart.

The daemon is configured small so that every fuzzed request ends quickly and every bound
is reachable: a 96-token context (no generation runs longer), 8 tokens by default, 1 MiB
request bodies and station frames, and API keys, so the key checks are fuzzed too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck

from gnosis_daemon.client import open_station_client
from supervisor.pdeathsig import make_preexec
from tests.support.procs import REPO, child_env, free_port, health_ok, stop_process, wait_for
from tests.support.tiny_models import build_tiny_model

MODEL_NAME = "tiny"
API_KEYS = ("fuzz-key-alpha", "fuzz-key-beta")
MAX_MODEL_LEN = 96
MAX_REQUEST_BYTES = 1024 * 1024
MAX_FRAME_BYTES = 1024 * 1024

FUZZ_ENV = {
    "GNOSIS_SERVED_MODEL_NAME": MODEL_NAME,
    "GNOSIS_API_KEYS": ",".join(API_KEYS),
    "GNOSIS_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
    "GNOSIS_MAX_TOKENS_DEFAULT": "8",
    "GNOSIS_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
    "GNOSIS_MAX_FRAME_BYTES": str(MAX_FRAME_BYTES),
    "GNOSIS_KV_CACHE_BYTES": str(16 * 1024 * 1024),
    "GNOSIS_KV_BLOCK_SIZE": "8",
    "GNOSIS_REQUEST_TIMEOUT_S": "60",
    # A crash is a finding, not the end of the run: restart at once, never give up, so every
    # input that stops a process is blamed on its own example.
    "GNOSIS_MIN_UPTIME_S": "1",
    "GNOSIS_MAX_FAST_FAILURES": "1000",
    "GNOSIS_BACKOFF_INITIAL_S": "0.1",
    "GNOSIS_BACKOFF_MAX_S": "1",
    "MKL_NUM_THREADS": "1",
}


# Reproducible and bounded: the same examples every run, no example database, no deadline
# (a shared CPU), and no health check (the daemon is slower than hypothesis expects).
FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                     suppress_health_check=list(HealthCheck))


class Watch:
    """The station pid each example is checked against; moved on after a reported crash, so
    each crash is blamed on the one example after which it happened and the run goes on."""

    def __init__(self, pid: int) -> None:
        self.pid = pid


class Violations:
    """Distinct property violations (first reproducer of each kind kept), for one report."""

    def __init__(self) -> None:
        self.seen: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self.outcomes: Counter[str] = Counter()  # what the run got, printed for -s / -rA

    def tally(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def add(self, kind: str, reproducer: str) -> None:
        count, first = self.seen.get(kind, (0, reproducer))
        self.seen[kind] = (count + 1, first)

    def report(self) -> str:
        return "\n".join(f"- [{count}x] {kind}\n    e.g. {first}"
                         for kind, (count, first) in self.seen.items())


@dataclass(frozen=True)
class Baseline:
    station_pid: int
    host_pid: int
    supervisor_station_restarts: int
    supervisor_host_restarts: int
    host_station_restarts: int


@dataclass
class FuzzDaemon:
    runtime_dir: Path
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def station_socket(self) -> Path:
        return self.runtime_dir / "station.sock"

    def status(self) -> dict[str, Any]:
        return json.loads((self.runtime_dir / "status.json").read_text())

    def health(self) -> tuple[int, dict[str, Any]]:
        response = httpx.get(f"{self.base_url}/health", timeout=10)
        return response.status_code, response.json()

    def baseline(self) -> Baseline:
        """Wait until both children run and the host is connected, then record who runs."""
        wait_for(lambda: self.health()[0] == 200, 120, "the host connected to the station")
        status = wait_for(lambda: (s := self.status())["supervisor"]["state"] == "running" and s,
                          60, "both children running")
        health = self.health()[1]
        station, host = status["children"]["station"], status["children"]["host"]
        assert health["station_pid"] == station["pid"], (health, station)
        return Baseline(station["pid"], host["pid"], station["restarts"], host["restarts"],
                        health["station_restarts"])

    def unchanged_since(self, base: Baseline) -> list[str]:
        """What changed since ``base``: the property every fuzz module ends with."""
        problems = []
        code, health = self.health()
        status = self.status()
        station, host = status["children"]["station"], status["children"]["host"]
        if code != 200:
            problems.append(f"/health answered {code}: {health}")
        if health.get("station_pid") != base.station_pid:
            problems.append(f"station pid {base.station_pid} -> {health.get('station_pid')} (/health)")
        if health.get("host_pid") != base.host_pid:
            problems.append(f"host pid {base.host_pid} -> {health.get('host_pid')}")
        if health.get("station_restarts") != base.host_station_restarts:
            problems.append(f"host saw station restarts {base.host_station_restarts} -> "
                            f"{health.get('station_restarts')}")
        if station["pid"] != base.station_pid or station["restarts"] != base.supervisor_station_restarts:
            problems.append(f"supervisor: station pid {station['pid']} restarts {station['restarts']}, "
                            f"last exit {station['last_exit']}")
        if host["pid"] != base.host_pid or host["restarts"] != base.supervisor_host_restarts:
            problems.append(f"supervisor: host pid {host['pid']} restarts {host['restarts']}, "
                            f"last exit {host['last_exit']}")
        return problems

    def station(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request on a fresh station connection (through ``gnosis_daemon.client``)."""

        async def call() -> dict[str, Any]:
            async with open_station_client(self.station_socket,
                                           max_frame_bytes=MAX_FRAME_BYTES) as conn:
                return await conn.request(op, args)

        return trio.run(call)

    def leaked_blocks(self) -> tuple[int, dict[str, Any]]:
        """KV blocks held by nobody once the station is idle: held minus session-pinned.

        A block is held when a sequence references it or a session pins it; with nothing
        running, waiting or held between calls, every held block must be a pinned one.
        """
        stats = wait_for(lambda: (s := self.station("stats"))["running"] == 0
                         and s["waiting"] == 0 and s["host_sequences"] == 0 and s,
                         30, "an idle station")
        return stats["blocks_held"] - stats["pinned_blocks"], stats

    def exception_of(self, request_id: str) -> str:
        """The last line of the host's logged exception for ``request_id`` (500s only)."""
        for line in reversed(self.log_path.read_text(errors="replace").splitlines()):
            if request_id in line and '"unhandled_error"' in line:
                try:
                    exception = json.loads(line).get("exception", "")
                except ValueError:
                    continue
                return exception.strip().splitlines()[-1][:200] if exception else "no traceback"
        return "not logged"

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line[:400] for line in lines[-n:])


@pytest.fixture(scope="package")
def fuzz_daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    model_dir = build_tiny_model(base / "tiny-llama", "llama")
    port = free_port()
    daemon = FuzzDaemon(base / "run", port, base / "daemon.log")
    argv = [sys.executable, "-m", "gnosis_daemon.cli", "run", "--runtime-dir", str(daemon.runtime_dir),
            "--port", str(port), "--model", str(model_dir)]
    with open(daemon.log_path, "ab") as log:
        # SIGTERM to the supervisor if pytest itself dies (a CI timeout): no daemon outlives
        # the run on a shared machine, and the supervisor still stops its children in order.
        proc = subprocess.Popen(argv, cwd=REPO, env=child_env(**FUZZ_ENV), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=make_preexec(signal.SIGTERM))
    try:
        wait_for(lambda: health_ok(port), 180, "daemon /health", proc)
        yield daemon
    finally:
        stop_process(proc)
