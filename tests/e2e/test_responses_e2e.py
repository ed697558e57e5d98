"""End to end: a Responses API conversation through ``gnosis-daemon run`` (supervisor, host,
station) with the official ``openai`` client, its station SIGKILLed between turns and
restarted by the supervisor: every turn after the first loads the previous turn's KV, the
one after the kill from the disk tier."""

from __future__ import annotations

import os
import signal

import httpx
from openai import OpenAI

from tests.host.conftest import station_call
from tests.support.procs import child_env, free_port, run_daemon, wait_for
from tests.support.tiny_models import build_tiny_model

BS = 16  # the daemon's default KV block size


def station_sessions(socket_path) -> list[dict]:
    return station_call(socket_path, "kv_session.list", {})["sessions"]


def test_a_conversation_survives_a_station_sigkill_under_the_supervisor(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    port = free_port()
    runtime = tmp_path / "run"
    with run_daemon(model_dir, runtime, port, log_path=tmp_path / "daemon.log",
                    env=child_env(GNOSIS_SERVED_MODEL_NAME="tiny")):
        base = f"http://127.0.0.1:{port}"
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def turn(text: str, previous: str | None = None):
            return client.responses.create(model="tiny", input=text, previous_response_id=previous,
                                           instructions="Answer briefly.", max_output_tokens=8,
                                           temperature=0)

        first = turn("Where is the Eiffel tower?")
        second = turn("How tall is it?", first.id)
        assert second.model_extra["_gnosis"]["liquid_memory"] == "hit"
        assert second.usage.input_tokens_details.cached_tokens >= \
            first.usage.input_tokens // BS * BS
        # The second turn's session (its conversation so far) on disk before the kill.
        wait_for(lambda: all(s["durable"] for s in station_sessions(runtime / "station.sock")),
                 30, "every session durable")
        old_pid = httpx.get(base + "/health", timeout=10).json()["station_pid"]
        os.kill(old_pid, signal.SIGKILL)
        wait_for(lambda: (h := httpx.get(base + "/health", timeout=10)).status_code == 200
                 and h.json()["station_pid"] not in (None, old_pid)
                 and h.json()["liquid_memory"] is True, 120, "the restarted station served")
        third = turn("When was it built?", second.id)
        gnosis = third.model_extra["_gnosis"]
        assert (gnosis["liquid_memory"], gnosis["tier"]) == ("hit", "disk")
        assert third.usage.input_tokens_details.cached_tokens >= \
            second.usage.input_tokens // BS * BS
        assert client.responses.retrieve(first.id).output_text == first.output_text
