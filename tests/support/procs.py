"""Real child processes for tests: free ports, daemons started through the CLI, clean teardown;
and what this process maps where (``mapped_file_at``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GNOSIS_", "THOTH_"))}
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_USEC", None)
    env.update({"GNOSIS_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def http_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if body else {}


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - polled condition, reported on timeout
            last_exc = exc
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_exc!r})")


def health_ok(port: int) -> bool:
    status, body = http_json(f"http://127.0.0.1:{port}/health", timeout=2)
    return status == 200 and bool(body)


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    return proc.returncode


@contextlib.contextmanager
def run_daemon(model_dir: str | Path | None, runtime_dir: Path, port: int, *, log_path: Path,
               env: dict[str, str] | None = None, start_timeout: float = 180.0,
               ) -> Iterator[subprocess.Popen]:
    """``gnosis-daemon run`` (supervisor + station + host) until /health answers 200."""
    argv = [sys.executable, "-m", "gnosis_daemon.cli", "run", "--runtime-dir", str(runtime_dir),
            "--port", str(port)]
    if model_dir is not None:
        argv += ["--model", str(model_dir)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env or child_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: health_ok(port), start_timeout, "daemon /health", proc)
        yield proc
    finally:
        stop_process(proc)


@contextlib.contextmanager
def openai_on_daemon(model_dir: str | Path, root: Path) -> Iterator[Any]:
    """``run_daemon`` on ``model_dir`` (its runtime dir and log under ``root``) and the official
    ``openai`` client pointed at it, with ``model_id`` the served model's id."""
    from openai import OpenAI

    port = free_port()
    with run_daemon(model_dir, root / "run", port, log_path=root / "daemon.log"):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                        max_retries=0, timeout=120)
        client.model_id = client.models.list().data[0].id
        yield client


def mapped_file_at(address: int) -> str | None:
    """The file this process maps at ``address`` (/proc/self/maps), or None (anonymous)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            name = fields[5].strip() if len(fields) == 6 else ""
            return name if name.startswith("/") else None
    return None
