"""Real station and host children on one runtime directory: ``stack`` (one of each, shared by
a module) and ``liquid_stack`` (one station, a liquid host and a THOTH_LIQUID_MEMORY=0 host,
shared by the liquid-memory modules)."""

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
from tests.host.liquid_support import HOST_ENV
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
    # This stack tests the native path (and everything around it): liquid memory is off
    # here, so its outcome does not depend on the station; test_liquid_* test the liquid path.
    host = spawn("host", runtime_dir, host_log, "--port", str(port),
                 env={"THOTH_LIQUID_MEMORY": "0"})
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


@dataclass
class LiquidStack:
    """One station and two hosts on one runtime dir: ``host`` (liquid memory on) and
    ``host_off`` (THOTH_LIQUID_MEMORY=0). Starts as a stale station (kv_session, decode_next
    and embed disabled); ``replace_station`` swaps the station under the same hosts."""

    root: Path
    model_dir: Path
    runtime_dir: Path
    station: subprocess.Popen
    station_disable: str | None
    host: subprocess.Popen
    url: str
    host_off: subprocess.Popen
    url_off: str

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "station.sock"

    def replace_station(self, disable: str | None) -> None:
        stop_process(self.station)
        env = {"GNOSIS_STATION_DISABLE": disable} if disable else None
        self.station = spawn("station", self.runtime_dir, self.root / "station.log",
                             "--model", str(self.model_dir), env=env)
        self.station_disable = disable

    def use_station(self, disable: str | None, **want) -> LiquidStack:
        """Serve from a station started with ``disable`` (replacing the running one if it
        differs), once both hosts have reconnected to it and the liquid host shows ``want``."""
        from tests.host.liquid_support import wait_health

        if self.station_disable != disable:
            self.replace_station(disable)
        try:
            wait_health(self.url, self.host, self.station.pid, **want)
            wait_health(self.url_off, self.host_off, self.station.pid)
        except AssertionError:
            self.dump_logs()
            raise
        return self

    def restart_host(self) -> None:
        stop_process(self.host)
        port = free_port()
        self.host = spawn("host", self.runtime_dir, self.root / "host.log", "--port", str(port),
                          env=HOST_ENV)
        self.url = f"http://127.0.0.1:{port}"

    def dump_logs(self) -> None:
        for name in ("station.log", "host.log", "host-off.log"):
            path = self.root / name
            if path.exists():
                print(f"--- {name}\n" + path.read_text(errors="replace")[-4000:])


STALE_DISABLE = "kv_session,decode_next,embed"


@pytest.fixture(scope="session")
def liquid_stack(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("liquid")
    runtime_dir = root / "run"
    station = spawn("station", runtime_dir, root / "station.log", "--model", str(tiny_llama),
                    env={"GNOSIS_STATION_DISABLE": STALE_DISABLE})
    port, port_off = free_port(), free_port()
    host = spawn("host", runtime_dir, root / "host.log", "--port", str(port), env=HOST_ENV)
    host_off = spawn("host", runtime_dir, root / "host-off.log", "--port", str(port_off),
                     env={"THOTH_LIQUID_MEMORY": "0", **HOST_ENV})
    s = LiquidStack(root, tiny_llama, runtime_dir, station, STALE_DISABLE, host,
                    f"http://127.0.0.1:{port}", host_off, f"http://127.0.0.1:{port_off}")
    try:
        yield s
    finally:
        for proc in (s.host, s.host_off, s.station):
            stop_process(proc)
