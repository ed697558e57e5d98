"""A base model (no chat template) through a real station and host, each started alone on
one runtime dir, with the official openai client: ``/v1/completions`` serves it,
``/v1/chat/completions`` is a 400 on ``messages`` that names the missing template.

The runtime dir starts with an earlier station's refusal file in it: the station removes it
as it starts, and a refusal file written while the station answers is not believed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from gnosis_daemon.refusal import write_refusal
from tests.support.procs import REPO, child_env, free_port, health_ok, stop_process, wait_for

START_TIMEOUT_S = 120.0
REFUSAL = {"model_type": "llama", "kind": "stale", "reason": "an earlier station's refusal",
           "message": "model type 'llama' refused: an earlier station's refusal"}


def spawn(role: str, runtime_dir, log_path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gnosis_daemon.cli", role, "--runtime-dir", str(runtime_dir),
            *extra]
    env = child_env(GNOSIS_KV_CACHE_BYTES=str(16 << 20), GNOSIS_MAX_MODEL_LEN="2048")
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.support.refused_models import build_base_model

    root = tmp_path_factory.mktemp("base-model")
    model_dir = build_base_model(root / "tiny-base")
    runtime_dir = root / "run"
    refusal_file = runtime_dir / "station-refused.json"
    write_refusal(refusal_file, REFUSAL, model=str(model_dir))  # an earlier station's
    port = free_port()
    station = spawn("station", runtime_dir, root / "station.log", "--model", str(model_dir))
    host = spawn("host", runtime_dir, root / "host.log", "--port", str(port))
    try:
        wait_for(lambda: health_ok(port), START_TIMEOUT_S, "host /health 200", station)
        yield {"port": port, "refusal_file": refusal_file, "model_dir": model_dir,
               "client": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                       api_key="unused", max_retries=0, timeout=60)}
    finally:
        stop_process(host)
        stop_process(station)


def test_the_starting_station_removed_the_stale_refusal(stack):
    assert not stack["refusal_file"].exists()
    body = httpx.get(f"http://127.0.0.1:{stack['port']}/health", timeout=10).json()
    assert body["status"] == "ok" and body["station_refused"] is None


def test_completions_serve_a_base_model(stack):
    client = stack["client"]
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6,
                                     temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1 and resp.usage.prompt_tokens == len("Once upon a time")
    pieces = [c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True)
        if c.choices]
    assert "".join(pieces) == resp.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_on_a_base_model_is_a_400_naming_the_missing_template(stack, stream):
    client = stack["client"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=client.models.list().data[0].id, stream=stream,
                                       messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "messages",
                                                              "invalid_value")
    assert "has no chat template" in error["message"]
    assert "prompt" in error["message"]  # what to send instead


def test_a_refusal_file_does_not_override_a_station_that_answers(stack):
    path = stack["refusal_file"]
    write_refusal(path, REFUSAL, model=str(stack["model_dir"]))  # newer than the connect
    try:
        response = httpx.get(f"http://127.0.0.1:{stack['port']}/health", timeout=10)
        assert response.status_code == 200
        body = response.json()
        assert body["status"] == "ok" and body["station_refused"] is None
        assert body["station_last_error"] is None
        resp = stack["client"].completions.create(model=stack["client"].models.list().data[0].id,
                                                  prompt="x", max_tokens=2)
        assert resp.usage.completion_tokens >= 1
    finally:
        os.unlink(path)
