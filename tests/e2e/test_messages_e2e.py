"""End to end: an Anthropic Messages conversation through ``gnosis-daemon run`` (supervisor,
host, station) with the official ``anthropic`` client and a cache breakpoint on its system
prompt, its station SIGKILLed between turns and restarted by the supervisor: the turn after
the kill reads the pinned prefix back from the disk tier."""

from __future__ import annotations

import os
import signal

import anthropic
import httpx

from tests.host.conftest import station_call
from tests.support.procs import child_env, free_port, run_daemon, wait_for
from tests.support.tiny_models import build_tiny_model

SYSTEM = ("You are a patient tutor. Explain each idea in one short sentence, check that the "
          "student follows, and never skip a step of the reasoning you give them.")


def station_sessions(socket_path) -> list[dict]:
    return station_call(socket_path, "kv_session.list", {})["sessions"]


def test_a_pinned_system_prompt_survives_a_station_sigkill_under_the_supervisor(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    port = free_port()
    runtime = tmp_path / "run"
    with run_daemon(model_dir, runtime, port, log_path=tmp_path / "daemon.log",
                    env=child_env(GNOSIS_SERVED_MODEL_NAME="tiny")):
        base = f"http://127.0.0.1:{port}"
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0,
                                     timeout=120)
        system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        turns: list[dict] = []

        def turn(text: str):
            turns.append({"role": "user", "content": text})
            msg = client.messages.create(model="tiny", max_tokens=8, system=system,
                                         messages=turns, extra_body={"temperature": 0})
            turns.append({"role": "assistant", "content": msg.content[0].text or "."})
            return msg

        first = turn("What is a prime number?")
        pinned = first.usage.cache_creation_input_tokens
        assert pinned > 0 and first.usage.cache_read_input_tokens == 0
        assert turn("Is seven one?").usage.cache_read_input_tokens == pinned
        wait_for(lambda: all(s["durable"] for s in station_sessions(runtime / "station.sock")),
                 30, "every session durable")
        old_pid = httpx.get(base + "/health", timeout=10).json()["station_pid"]
        os.kill(old_pid, signal.SIGKILL)
        wait_for(lambda: (h := httpx.get(base + "/health", timeout=10)).status_code == 200
                 and h.json()["station_pid"] not in (None, old_pid)
                 and h.json()["liquid_memory"] is True, 120, "the restarted station served")
        third = turn("And nine?")
        assert (third.usage.cache_read_input_tokens, third.usage.cache_creation_input_tokens) == \
            (pinned, 0)
        assert third.model_dump()["_gnosis"]["tier"] == "disk"
