"""A real station child and a real host child on one runtime directory, shared by a module."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from gnosis_daemon.client import open_station_client
from tests.support.procs import REPO, child_env, free_port, http_json, stop_process, wait_for
from tests.support.tiny_models import build_tiny_model

START_TIMEOUT_S = 90.0


def spawn(role: str, runtime_dir: Path, log_path: Path, *extra: str,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """``gnosis-daemon <role>`` as a child; ``env`` adds variables (GNOSIS_*/THOTH_*)."""
    argv = [sys.executable, "-m", "gnosis_daemon.cli", role, "--runtime-dir", str(runtime_dir),
            *extra]
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, cwd=REPO, env=child_env(**(env or {})), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def station_call(socket_path: Path, op: str, args: dict[str, Any] | None = None) -> dict:
    """One request on a fresh station connection (sync, for tests that are not async)."""

    async def call() -> dict:
        async with open_station_client(socket_path) as conn:
            return await conn.request(op, args)

    return trio.run(call)


def log_lines(path: Path) -> list[dict]:
    lines = []
    for raw in path.read_text(errors="replace").splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines


@dataclass
class Stack:
    root: Path
    model_dir: Path
    runtime_dir: Path
    port: int
    station: subprocess.Popen
    host: subprocess.Popen
    station_log: Path
    host_log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "station.sock"

    def health(self) -> tuple[int, dict]:
        return http_json(self.base_url + "/health", timeout=5)

    def start_station(self) -> None:
        assert self.station.poll() is not None, "the old station is still running"
        self.station = spawn("station", self.runtime_dir, self.station_log,
                             "--model", str(self.model_dir))

    def wait_served(self) -> dict:
        def ready():
            status, body = self.health()
            return body if status == 200 and body.get("station_pid") == self.station.pid else None

        return wait_for(ready, START_TIMEOUT_S, "host /health 200 with the current station",
                        self.station)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("host-stack")
    runtime_dir = root / "run"
    station_log, host_log = root / "station.log", root / "host.log"
    station = spawn("station", runtime_dir, station_log, "--model", str(tiny_llama))
    port = free_port()
    host = spawn("host", runtime_dir, host_log, "--port", str(port))
    s = Stack(root, tiny_llama, runtime_dir, port, station, host, station_log, host_log)
    try:
        try:
            s.wait_served()
        except AssertionError:
            for path in (station_log, host_log):
                print(f"--- {path.name}\n" + path.read_text(errors="replace")[-4000:])
            raise
        yield s
    finally:
        stop_process(s.host)
        stop_process(s.station)
