"""A supervisor whose station refuses its model (a tiny Mamba: no attention at all, refused
for real by the station's attention check): the refusal is a permanent, visible state.

One supervisor serves the module's tests in order: the station is started once and never
again (no restart loop, no FATAL), the supervisor stays up with the host serving, and the
refusal's reason is in ``gnosis-daemon status``, the STATUS= line, ``/health`` and every
``/v1`` answer; an operator's restart tries once more; SIGTERM still stops it cleanly.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.supervisor.conftest import START_TIMEOUT_S, cli, start_daemon, stop_daemon

REFUSED_EXIT = 78
# Several seconds: a restart loop (backoff 0.1 s doubling to 1 s) would have spawned the
# station again, and gone FATAL after max_fast_failures, long before this.
SETTLE_S = 4.0


def refused(status) -> bool:
    return (status["supervisor"]["state"] == "refused"
            and status["children"]["host"]["state"] == "running")


@pytest.fixture(scope="module")
def mamba_dir(tmp_path_factory):
    from tests.support.refused_models import build_tiny_mamba

    return build_tiny_mamba(tmp_path_factory.mktemp("refused-model") / "tiny-mamba")


@pytest.fixture(scope="module")
def daemon(mamba_dir, tmp_path_factory):
    d = start_daemon(mamba_dir, tmp_path_factory.mktemp("refused"), wait=False)
    try:
        d.wait(refused, START_TIMEOUT_S, "station refused and host running")
    except BaseException:
        stop_daemon(d)
        raise
    yield d
    stop_daemon(d)


def log_events(daemon, event: str, **match) -> list[dict]:
    out = []
    for raw in daemon.log_path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("event") == event and all(line.get(k) == v for k, v in match.items()):
            out.append(line)
    return out


def station_spawns(daemon) -> int:
    return len(log_events(daemon, "child_state", child="station", new="starting"))


def test_the_station_is_started_once_and_never_restarted(daemon):
    watchdogs_before = sum(1 for m in daemon.notify.messages if m.get("WATCHDOG") == "1")
    time.sleep(SETTLE_S)
    assert daemon.proc.poll() is None, daemon.log_tail()  # the supervisor stays up
    status = daemon.status()
    station = status["children"]["station"]
    assert station["state"] == "refused" and station["pid"] is None
    assert (station["restarts"], station["fast_failures"]) == (0, 0)
    assert station["last_exit"]["code"] == REFUSED_EXIT
    assert station_spawns(daemon) == 1
    assert status["supervisor"]["fatal"] is None and status["supervisor"]["ready"] is True
    # systemd: READY=1 (the host serves), STATUS= names the refusal, and the watchdog is
    # still fed (its silence would have systemd kill and restart the unit: the same refusal)
    messages = daemon.notify.messages
    assert any(m.get("READY") == "1" for m in messages)
    assert any("refused" in m.get("STATUS", "") and "mamba" in m.get("STATUS", "")
               for m in messages)
    assert sum(1 for m in messages if m.get("WATCHDOG") == "1") > watchdogs_before
    line = log_events(daemon, "station_refused")
    assert len(line) == 1 and line[0]["model_type"] == "mamba" and line[0]["reason"]


def test_status_shows_the_reason(daemon, mamba_dir):
    result = cli("status", "--json", runtime_dir=daemon.runtime_dir)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    refusal = document["supervisor"]["refused"]
    assert refusal["model_type"] == "mamba" and refusal["kind"] and refusal["reason"]
    assert refusal["model"] == str(mamba_dir)
    assert document["children"]["station"]["refused"] == refusal
    table = cli("status", runtime_dir=daemon.runtime_dir)
    assert table.returncode == 0, table.stderr
    assert "state refused" in table.stdout
    assert f"STATION REFUSED ITS MODEL (not restarted): {refusal['message']}" in table.stdout


def test_health_shows_the_refusal(daemon):
    response = httpx.get(f"{daemon.base_url}/health", timeout=10)
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "refused" and body["station_reachable"] is False
    refusal = body["station_refused"]
    assert refusal["model_type"] == "mamba" and refusal["kind"] and refusal["reason"]
    assert body["station_last_error"] == refusal["message"]


def test_a_completion_answers_503_naming_the_reason(daemon):
    reason = daemon.status()["supervisor"]["refused"]["reason"]
    response = httpx.post(f"{daemon.base_url}/v1/completions", timeout=10,
                          json={"prompt": "hi", "max_tokens": 4})
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "station_refused")
    assert reason in error["message"]
    assert "retry-after" not in response.headers
    # The official client (2 retries by default) asks once: x-should-retry: false. The host
    # logs a request after its response is sent: count from the first request's line.
    deadline = time.monotonic() + 5
    while not log_events(daemon, "request", path="/v1/completions") and time.monotonic() < deadline:
        time.sleep(0.1)
    before = len(log_events(daemon, "request", path="/v1/completions"))
    assert before == 1
    client = openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", timeout=10)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert caught.value.status_code == 503 and reason in caught.value.message
    deadline = time.monotonic() + 5
    while len(log_events(daemon, "request", path="/v1/completions")) == before \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(log_events(daemon, "request", path="/v1/completions")) == before + 1


def test_an_operator_restart_tries_once_more(daemon):
    result = cli("restart", "station", runtime_dir=daemon.runtime_dir)
    assert result.returncode == 0, result.stderr
    daemon.wait(lambda s: s["children"]["station"]["restarts"] == 1
                and s["children"]["station"]["state"] == "refused", START_TIMEOUT_S,
                "the restarted station refused again")
    time.sleep(1.0)
    assert station_spawns(daemon) == 2 and daemon.status()["supervisor"]["state"] == "refused"


def test_sigterm_stops_a_refused_daemon_with_exit_0(daemon):
    assert daemon.terminate() == 0
    status = daemon.status()
    assert status["supervisor"]["state"] == "stopped"
    assert {n: c["state"] for n, c in status["children"].items()} == {"station": "stopped",
                                                                       "host": "stopped"}
