"""The supervisor with its real children (station and host over a tiny model).

One supervisor serves the module's tests in order: status, systemd notifications, restarts
after SIGKILL, a hung (SIGSTOPped) host, a restart through the control socket, and finally a
SIGTERM that must drain an in-flight streamed request. A second one is SIGKILLed to show
that no child outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.supervisor.conftest import (
    MODEL_NAME,
    alive,
    both_running,
    cli,
    start_daemon,
    stop_daemon,
)

RESTART_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    d = start_daemon(tiny_model_dir, tmp_path_factory.mktemp("daemon"))
    yield d
    stop_daemon(d)


def chat(daemon, content: str = "hi", max_tokens: int = 8) -> dict:
    response = httpx.post(f"{daemon.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def serves_again(daemon, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return chat(daemon)
        except (AssertionError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_status_json_and_table(daemon):
    # The first station health answer is published one probe period after start.
    daemon.wait(lambda s: s["children"]["station"]["health"].get("status") == "ok", 30,
                "the station's first health answer published")
    result = cli("status", "--json", runtime_dir=daemon.runtime_dir)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["supervisor"]["pid"] == daemon.proc.pid
    assert status["supervisor"]["state"] == "running" and status["supervisor"]["ready"] is True
    station, host = status["children"]["station"], status["children"]["host"]
    for child in (station, host):
        assert child["state"] == "running" and alive(child["pid"])
        assert child["restarts"] == 0 and child["last_exit"] is None and child["uptime_s"] > 0
    assert station["capabilities"]["generate"] is True
    assert all(value is True for value in station["capabilities"].values())  # flags it has
    assert station["model"] == MODEL_NAME and station["health"]["status"] == "ok"
    # the host's effective liquid-memory state, as its /health says
    health = httpx.get(f"{daemon.base_url}/health").json()
    assert host["http_status"] == 200
    assert host["capabilities"]["liquid_memory"] == health["liquid_memory"]
    assert host["capabilities"]["liquid_memory_env"] is True
    assert host["capabilities"]["station_kv_session"] == health["station_kv_session"]
    table = cli("status", runtime_dir=daemon.runtime_dir)
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].startswith(f"supervisor pid {daemon.proc.pid}  state running")
    assert lines[2].split()[:3] == ["station", "running", str(station["pid"])]
    assert lines[3].split()[:3] == ["host", "running", str(host["pid"])]


def test_systemd_notifications(daemon):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum("WATCHDOG" in m for m in daemon.notify.messages) < 2:
        time.sleep(0.1)
    messages = list(daemon.notify.messages)
    ready = [m for m in messages if m.get("READY") == "1"]
    assert len(ready) == 1
    assert ready[0]["STATUS"].startswith("running; station running pid ")
    assert any(m.get("STATUS", "").startswith("starting; station starting") for m in messages)
    assert sum(m == {"WATCHDOG": "1"} for m in messages) >= 2
    assert not any("STOPPING" in m for m in messages)


def test_children_get_the_settings_but_not_the_notify_socket(daemon):
    for name in ("station", "host"):
        pid = daemon.child(name)["pid"]
        environ = dict(item.split("=", 1) for item in
                       open(f"/proc/{pid}/environ", "rb").read().decode().split("\0") if "=" in item)
        assert "NOTIFY_SOCKET" not in environ and "WATCHDOG_USEC" not in environ
        assert environ["GNOSIS_HEALTH_INTERVAL_S"] == "0.5"
        assert environ["GNOSIS_RUNTIME_DIR"] == str(daemon.runtime_dir)


def test_killed_station_is_restarted_and_host_serves_again(daemon):
    station, host = daemon.child("station"), daemon.child("host")
    os.kill(station["pid"], signal.SIGKILL)
    # Meanwhile the host answers 503 with Retry-After and OpenAI's error body (a new
    # station needs seconds to import torch and load, so this lands in the gap).
    gap = httpx.post(f"{daemon.base_url}/v1/chat/completions", timeout=30, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert gap.status_code == 503, gap.text
    assert gap.headers["Retry-After"] == "1"
    assert gap.json()["error"]["code"] == "station_unavailable"
    status = daemon.wait(lambda s: both_running(s) and s["children"]["station"]["pid"] != station["pid"],
                         RESTART_TIMEOUT_S, "a new station")
    new = status["children"]["station"]
    assert new["restarts"] == 1
    assert new["last_exit"]["signal_name"] == "SIGKILL" and new["last_exit"]["reason"] is None
    assert status["children"]["host"]["pid"] == host["pid"]  # restarted independently
    assert status["children"]["host"]["restarts"] == 0
    assert serves_again(daemon)["choices"][0]["finish_reason"] in ("stop", "length")
    as_json = json.loads(cli("status", "--json", runtime_dir=daemon.runtime_dir).stdout)
    assert as_json["children"]["station"]["restarts"] == 1


def test_killed_host_is_restarted(daemon):
    station, host = daemon.child("station"), daemon.child("host")
    os.kill(host["pid"], signal.SIGKILL)
    status = daemon.wait(lambda s: both_running(s) and s["children"]["host"]["pid"] != host["pid"],
                         RESTART_TIMEOUT_S, "a new host")
    assert status["children"]["host"]["restarts"] == 1
    assert status["children"]["station"]["pid"] == station["pid"]
    assert serves_again(daemon)["object"] == "chat.completion"


@pytest.mark.parametrize(("name", "peer_name"), [("host", "station"), ("station", "host")])
def test_hung_child_is_killed_and_restarted(daemon, name, peer_name):
    hung, peer = daemon.child(name), daemon.child(peer_name)
    os.kill(hung["pid"], signal.SIGSTOP)
    try:
        # detection: 2 failed checks x (0.5 s interval + 2 s timeout); then a fresh start
        status = daemon.wait(lambda s: both_running(s) and s["children"][name]["pid"] != hung["pid"],
                             RESTART_TIMEOUT_S, f"the hung {name} replaced")
    finally:
        if alive(hung["pid"]):
            os.kill(hung["pid"], signal.SIGKILL)
    new = status["children"][name]
    assert new["restarts"] == hung["restarts"] + 1
    assert new["last_exit"]["signal_name"] == "SIGKILL"
    assert new["last_exit"]["reason"] == "unresponsive: 2 failed health checks"
    assert not alive(hung["pid"])
    assert status["children"][peer_name]["pid"] == peer["pid"]  # the other child rode it out
    assert serves_again(daemon)["object"] == "chat.completion"


def test_restart_station_through_the_control_socket(daemon):
    station = daemon.child("station")
    result = cli("restart", "station", runtime_dir=daemon.runtime_dir)
    assert result.returncode == 0, result.stderr
    assert f"restarting station (was pid {station['pid']})" in result.stdout
    status = daemon.wait(lambda s: both_running(s) and s["children"]["station"]["pid"] != station["pid"],
                         RESTART_TIMEOUT_S, "the station restarted on request")
    new = status["children"]["station"]
    assert new["restarts"] == station["restarts"] + 1
    assert new["last_exit"]["code"] == 0  # stopped with SIGTERM, exited cleanly
    assert new["last_exit"]["reason"] is None
    assert serves_again(daemon)["object"] == "chat.completion"


def test_sigterm_drains_an_in_flight_stream_then_exits_0(daemon):
    pids = [daemon.child(n)["pid"] for n in ("station", "host")]
    first_chunk = threading.Event()
    sigterm_at: list[float] = []
    chunks: list[tuple[float, dict]] = []
    done: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{daemon.base_url}/v1/chat/completions", timeout=60, json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": 1000, "temperature": 0, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done.append(line)
                elif line.startswith("data: "):
                    chunks.append((time.monotonic(), json.loads(line[6:])))
                    first_chunk.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first_chunk.wait(30)
    sigterm_at.append(time.monotonic())
    daemon.proc.send_signal(signal.SIGTERM)
    client.join(60)
    assert daemon.proc.wait(60) == 0
    assert done == ["data: [DONE]"]
    finish = [c["choices"][0]["finish_reason"] for _, c in chunks if c.get("choices")]
    assert finish[-1] in ("stop", "length")
    # the stream was really in flight: content kept coming after the signal
    assert sum(1 for at, _ in chunks if at > sigterm_at[0]) > 10
    messages = daemon.notify.messages
    assert any(m.get("STOPPING") == "1" for m in messages)
    assert all(not alive(pid) for pid in pids)
    assert not (daemon.runtime_dir / "control.sock").exists()
    assert daemon.status()["supervisor"]["state"] == "stopped"
    result = cli("status", runtime_dir=daemon.runtime_dir)
    assert result.returncode == 1
    assert "the supervisor is not running" in result.stderr


def test_no_child_outlives_a_sigkilled_supervisor(tiny_model_dir, tmp_path_factory):
    d = start_daemon(tiny_model_dir, tmp_path_factory.mktemp("sigkill"), wait=False)
    try:
        # both spawned is enough: the host's own start adds nothing to what this shows
        status = d.wait(lambda s: s["children"]["station"]["state"] == "running"
                        and s["children"]["host"]["pid"], 120, "both children spawned")
        pids = [status["children"][n]["pid"] for n in ("station", "host")]
        assert all(alive(pid) for pid in pids)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        deadline = time.monotonic() + 2.0
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if alive(pid)] == []
    finally:
        stop_daemon(d)


def test_supervisor_gives_up_and_exits_1_when_the_station_cannot_start(tmp_path):
    broken = tmp_path / "not-a-model"
    broken.mkdir()  # exists, so settings accept it; the station fails to load it
    d = start_daemon(broken, tmp_path / "fatal", wait=False, GNOSIS_MAX_FAST_FAILURES="1")
    try:
        assert d.proc.wait(60) == 1
        status = d.status()
        assert status["supervisor"]["state"] == "fatal"
        assert status["supervisor"]["fatal"] == "station failed 1 times in a row"
        station = status["children"]["station"]
        assert station["state"] == "fatal" and station["last_exit"]["code"] not in (0, None)
        assert status["children"]["host"]["state"] == "stopped"  # never started
        assert not any(m.get("READY") for m in d.notify.messages)
        assert any(m.get("STOPPING") == "1" for m in d.notify.messages)
    finally:
        stop_daemon(d)
