"""The daemon under test, and what /proc says about its processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import REPO, free_port
from bench.soak.measures import Sample
from supervisor.pdeathsig import make_preexec


class Daemon:
    """`gnosis-daemon run` in a temporary runtime directory, on a free loopback port."""

    def __init__(self, base: Path, model: str | None, env_extra: dict[str, str]) -> None:
        self.base = base
        self.runtime_dir = base / "run"
        self.port = free_port()
        self.model = model
        self.log_path = base / "daemon.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GNOSIS_", "THOTH_")) and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        env.update({"GNOSIS_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", "GNOSIS_HOST": "127.0.0.1",
                    "GNOSIS_STATE_DIR": str(base / "state"), **env_extra})
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def station_socket(self) -> Path:
        return self.runtime_dir / "station.sock"

    def start(self, timeout: float) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Spawn the daemon (``wait_ready`` waits for it to serve)."""
        argv = [sys.executable, "-m", "gnosis_daemon.cli", "run", "--runtime-dir", str(self.runtime_dir),
                "--host", "127.0.0.1", "--port", str(self.port)]
        if self.model:
            argv += ["--model", self.model]
        with open(self.log_path, "ab") as log:
            # SIGTERM to the supervisor if the drill dies: no daemon outlives it
            self.proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=make_preexec(signal.SIGTERM))

    def wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200 and \
                        self.status()["supervisor"]["state"] == "running":
                    return
            except (httpx.HTTPError, OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise SystemExit(f"the daemon did not serve within {timeout:g} s:\n{self.log_tail()}")

    def status(self) -> dict[str, Any]:
        return json.loads((self.runtime_dir / "status.json").read_text())

    def pids(self) -> dict[str, int | None]:
        return {name: pid for name, (pid, _) in self.processes().items()}

    def processes(self) -> dict[str, tuple[int | None, str]]:
        """name -> (pid, state) of the supervisor and both children."""
        try:
            status = self.status()
        except (OSError, ValueError):
            return {}
        return {"supervisor": (status["supervisor"]["pid"], "running"),
                **{name: (child.get("pid"), child.get("state", "?"))
                   for name, child in status["children"].items()}}

    def stop(self) -> None:
        if self.proc is None:
            return
        children = [pid for name, pid in self.pids().items() if name != "supervisor" and pid]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in children:  # the supervisor takes them along; never leave one behind
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def proc_sample(pid: int, now: float) -> Sample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        if "\nState:\tZ" in status or "\nState:\tT" in status:
            return None  # a zombie, or a stopped process: no longer the one serving
        rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None
    return Sample(now, rss, fds)


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except (OSError, IndexError):
        return "?"


def kill_quietly(pid: int | None) -> None:
    if not pid:
        return
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
