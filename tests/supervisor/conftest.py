"""A real supervisor (``python -m gnosis_daemon.cli run``) over a tiny model, shared by the
real-process tests of one module; plus the helpers they poll it with."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0  # station + host cold start on 2 busy cores
MODEL_NAME = "tiny"

# Small supervision figures, so a hang is detected and a restart happens in seconds.
SUPERVISION_ENV = {
    "GNOSIS_HEALTH_INTERVAL_S": "0.5",
    "GNOSIS_HEALTH_TIMEOUT_S": "2",
    "GNOSIS_HEALTH_FAILURES_BEFORE_KILL": "2",
    "GNOSIS_BACKOFF_INITIAL_S": "0.1",
    "GNOSIS_BACKOFF_MAX_S": "1",
    "GNOSIS_MIN_UPTIME_S": "1",
    "GNOSIS_DRAIN_GRACE_S": "30",
    "GNOSIS_STOP_TIMEOUT_S": "10",
    "GNOSIS_KV_CACHE_BYTES": str(16 * 1024 * 1024),
    "GNOSIS_MAX_MODEL_LEN": "2048",
    "GNOSIS_SERVED_MODEL_NAME": MODEL_NAME,
    "GNOSIS_LOG_FORMAT": "json",
    "WATCHDOG_USEC": "500000",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli(*args: str, runtime_dir: Path, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gnosis_daemon.cli", *args,
                           "--runtime-dir", str(runtime_dir)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=clean_env())


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GNOSIS_", "THOTH_")) and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class NotifyCollector:
    """A fake systemd: an AF_UNIX datagram socket that records every notification."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@dataclass
class Daemon:
    proc: subprocess.Popen
    runtime_dir: Path
    port: int
    log_path: Path
    notify: NotifyCollector
    log_file: Any = field(repr=False, default=None)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any]:
        return json.loads((self.runtime_dir / "status.json").read_text())

    def child(self, name: str) -> dict[str, Any]:
        return self.status()["children"][name]

    def wait(self, predicate: Callable[[dict[str, Any]], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{what}: supervisor exited with {self.proc.returncode}\n"
                                     + self.log_tail())
            try:
                last = self.status()
                if predicate(last):
                    return last
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; last status "
                             f"{json.dumps(last, indent=1)}\n" + self.log_tail())

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def terminate(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def both_running(status: dict[str, Any]) -> bool:
    children = status["children"]
    return (status["supervisor"]["state"] == "running"
            and all(children[n]["state"] == "running" for n in ("station", "host")))


def start_daemon(model_dir: Path, base: Path, *, wait: bool = True, **extra_env: str) -> Daemon:
    base.mkdir(parents=True, exist_ok=True)
    runtime_dir = base / "run"
    port = free_port()
    notify = NotifyCollector(base / "notify.sock")
    log_path = base / "daemon.log"
    log_file = open(log_path, "wb")
    env = clean_env(**{**SUPERVISION_ENV, **extra_env}, NOTIFY_SOCKET=str(notify.path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gnosis_daemon.cli", "run", "--model", str(model_dir),
         "--runtime-dir", str(runtime_dir), "--port", str(port)],
        cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    daemon = Daemon(proc, runtime_dir, port, log_path, notify, log_file)
    if not wait:
        return daemon
    try:
        daemon.wait(both_running, START_TIMEOUT_S, "station and host running")
    except BaseException:
        stop_daemon(daemon)
        raise
    return daemon


def stop_daemon(daemon: Daemon) -> None:
    pids = [c.get("pid") for c in _last_children(daemon)]
    daemon.terminate()
    for pid in pids:  # a failing test must not leave workers on the shared machine
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)
    daemon.notify.close()
    daemon.log_file.close()


def _last_children(daemon: Daemon) -> list[dict[str, Any]]:
    try:
        return list(daemon.status()["children"].values())
    except (OSError, ValueError, KeyError):
        return []


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.support.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("supervisor-model") / "tiny-llama", "llama")
