"""Fixtures that start the real station as a child process on a tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import trio

from gnosis_daemon.client import StationUnavailable, open_station_client
from gnosis_daemon.protocol import FrameDecoder
from tests.support.tiny_models import build_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def few_threads():
    """In-process engine tests: one torch thread, so the 2 cores stay shared fairly."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
START_TIMEOUT_S = 90.0


@dataclass
class StationProcess:
    proc: subprocess.Popen
    runtime_dir: Path
    log_path: Path
    hello: dict

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "station.sock"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_station(model_dir: Path, runtime_dir: Path, **env_overrides: str) -> StationProcess:
    """Start ``gnosis-daemon station`` and wait until it answers hello."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GNOSIS_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GNOSIS_LOG_FORMAT="json",
               PYTHONPATH=str(REPO))
    env.update(env_overrides)
    log_path = runtime_dir.parent / f"{runtime_dir.name}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gnosis_daemon.cli", "station", "--model", str(model_dir),
             "--runtime-dir", str(runtime_dir)],
            cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    station = StationProcess(proc, runtime_dir, log_path, {})
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"station exited with {proc.returncode}:\n{station.log()}")
        if station.socket.exists():
            try:
                station.hello = trio.run(_hello, station.socket)
                return station
            except StationUnavailable:
                pass
        time.sleep(0.1)
    station.stop()
    raise RuntimeError(f"station did not answer hello within {START_TIMEOUT_S}s:\n{station.log()}")


async def _hello(path: Path) -> dict:
    async with open_station_client(path) as conn:
        assert conn.hello is not None
        return conn.hello


class RawConnection:
    """A bare socket for sending malformed frames and reading every reply frame."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.frames: list = []

    async def send(self, payload: bytes | object) -> None:
        data = payload if isinstance(payload, bytes) else msgpack.packb(payload, use_bin_type=True)
        await self.stream.send_all(data)

    async def receive(self, timeout: float = 10.0) -> dict | None:
        """The next frame, or None when the station closed the connection."""
        with trio.fail_after(timeout):
            while not self.frames:
                data = await self.stream.receive_some(65536)
                if not data:
                    return None
                self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    async def call(self, payload: object) -> dict:
        await self.send(payload)
        frame = await self.receive()
        assert frame is not None, "station closed the connection"
        return frame


async def open_raw(path: Path) -> RawConnection:
    return RawConnection(await trio.open_unix_socket(str(path)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama", "llama")
