"""The fleet on loopback: daemon replicas (`gnosis-daemon run` each) and vllm-router in front."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import free_port
from bench.soak.daemon import Daemon
from supervisor.pdeathsig import make_preexec


class Replica(Daemon):
    """One replica: its own runtime and state directories and port; ``shared``: the fleet's
    shared tier directory (or None: its tier is its own)."""

    def __init__(self, base: Path, name: str, model: str | None, shared: Path | None,
                 env_extra: dict[str, str]) -> None:
        env = {"GNOSIS_REPLICA_NAME": name, **env_extra}
        if shared is not None:
            env["GNOSIS_KV_SHARED_DIR"] = str(shared)
        super().__init__(base / name, model, env)
        self.base.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.killed = False

    @property
    def url(self) -> str:
        return self.base_url

    def metric(self, name: str) -> float | None:
        """The first sample named ``name`` in the host's /metrics, None when unreadable."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(f"{self.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        return None

    def wait_written(self, timeout: float = 60.0) -> float:
        """Wait until the write-behind has nothing queued -> seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.metric("gnosis_kv_tier_write_behind_queued") == 0:
                break
            time.sleep(0.1)
        return time.monotonic() - start

    def kill_all(self) -> list[int]:
        """The loss of the replica's machine: every process of the daemon (supervisor, host,
        station, the tier's I/O process) stopped at once, then SIGKILLed -> their pids."""
        assert self.proc is not None
        pids = _tree(self.proc.pid)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self.proc.wait(30)
        self.killed = True
        return pids

    def stop(self) -> None:
        if not self.killed:
            super().stop()


def _tree(pid: int) -> list[int]:
    """``pid`` and every descendant (from /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def router_binary() -> str | None:
    """vllm-router's launcher: beside this interpreter (the test extra), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


class Router:
    """vllm-router (the PyPI `vllm-router`, prebuilt Rust) on a free loopback port."""

    def __init__(self, base: Path, policy: str, workers: list[str], *extra: str) -> None:
        self.policy = policy
        self.port = free_port()
        self.log_path = base / f"router-{policy}-{self.port}.log"
        binary = router_binary()
        if binary is None:
            raise SystemExit("vllm-router is not installed (pip install vllm-router; it is in "
                             "the project's test extra)")
        # Health checks every second and two failures to drop a worker: a replica that
        # died leaves the hash ring within seconds; a failed request is retried elsewhere.
        self.argv = [binary, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                     "--worker-urls", *workers, "--health-check-interval-secs", "1",
                     "--health-failure-threshold", "2", "--worker-startup-timeout-secs", "120",
                     "--log-level", "warning", "--prometheus-host", "127.0.0.1",
                     "--prometheus-port", str(free_port()), *extra]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=make_preexec(signal.SIGTERM))

    def wait_ready(self, timeout: float = 120.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"vllm-router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"vllm-router did not serve within {timeout:g} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""
