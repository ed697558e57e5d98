"""A real station and a liquid host with two API keys (two tenants), for the Responses API
and session-control tests: the official ``openai`` client per tenant, the station's own
session listing, and the host's record directory."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import OpenAI

from gnosis_daemon.api_keys import tenant_key
from tests.host.conftest import Stack, spawn, station_call
from tests.support.procs import free_port, stop_process, wait_for

KEY_A, KEY_B = "resp-tenant-a", "resp-tenant-b"
HOST_ENV = {"GNOSIS_API_KEYS": f"{KEY_A},{KEY_B}"}
STATION_ENV = {"GNOSIS_SERVED_MODEL_NAME": "tiny"}
INSTRUCTIONS = "You are a terse assistant that answers in one short sentence."


@dataclass
class ResponsesStack(Stack):
    def client(self, key: str = KEY_A) -> OpenAI:
        return OpenAI(base_url=self.base_url + "/v1", api_key=key, max_retries=0, timeout=120)

    def http(self, method: str, path: str, key: str = KEY_A, **kw) -> httpx.Response:
        return httpx.request(method, self.base_url + path, timeout=60,
                             headers={"Authorization": f"Bearer {key}"}, **kw)

    def sessions(self, tenant: str | None = None) -> list[dict]:
        """The station's own listing (every tenant's, or one tenant's)."""
        listed = station_call(self.socket, "kv_session.list", {})["sessions"]
        return [s for s in listed if tenant is None or s["tenant"] == tenant]

    @staticmethod
    def tenant_of(key: str) -> str:
        return tenant_key(key)

    @property
    def records(self) -> Path:
        return self.runtime_dir / "state" / "responses"

    def record_files(self) -> list[Path]:
        return sorted(self.records.glob("*/resp_*.json")) if self.records.is_dir() else []

    def kill_station(self) -> None:
        """SIGKILL the station and start it again; returns once the host serves it."""
        os.kill(self.station.pid, signal.SIGKILL)
        self.station.wait(timeout=30)
        self.station = spawn("station", self.runtime_dir, self.station_log, "--model",
                             str(self.model_dir), env=STATION_ENV)
        self.wait_served()

    def wait_durable(self, session_id: str) -> dict:
        def durable():
            found = [s for s in self.sessions() if s["session_id"] == session_id]
            return found[0] if found and found[0]["durable"] else None

        return wait_for(durable, 30, f"session {session_id} durable", self.station)


def start(root: Path, model_dir: Path, host_env: dict[str, str] | None = None,
          station_env: dict[str, str] | None = None) -> ResponsesStack:
    runtime_dir = root / "run"
    station_log, host_log = root / "station.log", root / "host.log"
    station = spawn("station", runtime_dir, station_log, "--model", str(model_dir),
                    env={**STATION_ENV, **(station_env or {})})
    port = free_port()
    host = spawn("host", runtime_dir, host_log, "--port", str(port),
                 env={**HOST_ENV, **(host_env or {})})
    s = ResponsesStack(root, model_dir, runtime_dir, port, station, host, station_log, host_log)
    try:
        s.wait_served()
    except AssertionError:
        stop(s, dump=True)
        raise
    return s


def stop(s: ResponsesStack, dump: bool = False) -> None:
    if dump:
        for path in (s.station_log, s.host_log):
            print(f"--- {path.name}\n" + path.read_text(errors="replace")[-6000:])
    stop_process(s.host)
    stop_process(s.station)
