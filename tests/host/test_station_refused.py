"""The host while its station refuses its model, through Quart's ASGI test client: no station
socket, a refusal file in the runtime dir (as a refusing station leaves it). ``/health`` and
every model route say why; a 503 that will not clear invites no retry. (The real processes:
tests/supervisor/test_refused_station.py.)"""

from __future__ import annotations

import json
import os
import time

import pytest

from gnosis_daemon.refusal import write_refusal
from gnosis_daemon.settings import Settings
from host.app import create_app
from host.station_link import StationLink

REFUSAL = {"model_type": "mamba", "kind": "non-attention layers",
           "reason": "layers 0-1 of 2 compute no softmax attention",
           "message": "model type 'mamba' refused: layers 0-1 of 2 compute no softmax attention"}


@pytest.fixture
def settings(tmp_path):
    return Settings(runtime_dir=str(tmp_path / "run"))


def app_for(settings):
    link = StationLink(settings.station_socket, max_frame_bytes=settings.max_frame_bytes,
                       refusal_file=settings.station_refusal_file)
    return link, create_app(settings, link)


async def call(client, method, path, data=None):
    kwargs = {} if data is None else {"data": json.dumps(data).encode(),
                                      "headers": {"Content-Type": "application/json"}}
    response = await getattr(client, method)(path, **kwargs)
    return response.status_code, response.headers, json.loads(await response.get_data())


async def test_health_reports_the_refusal(settings):
    written = write_refusal(settings.station_refusal_file, REFUSAL, model="/models/mamba")
    _, app = app_for(settings)
    status, _, body = await call(app.test_client(), "get", "/health")
    assert status == 503
    assert body["status"] == "refused" and body["station_reachable"] is False
    assert body["station_refused"] == {**REFUSAL, "model": "/models/mamba", "at": written["at"]}
    assert body["station_last_error"] == REFUSAL["message"]


@pytest.mark.parametrize("method, path, data", [
    ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "stream": True}),
    ("post", "/v1/embeddings", {"input": "hi"}),
    ("get", "/v1/models", None),
    ("post", "/tokenize", {"prompt": "hi"}),
    ("post", "/detokenize", {"tokens": [1, 2]}),
    ("post", "/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}]}),
])
async def test_model_routes_answer_503_naming_the_reason_without_retry_after(settings, method,
                                                                            path, data):
    write_refusal(settings.station_refusal_file, REFUSAL, model="/models/mamba")
    _, app = app_for(settings)
    status, headers, body = await call(app.test_client(), method, path, data)
    assert status == 503
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == ("service_unavailable",
                                                              "station_refused", None)
    assert REFUSAL["message"] in error["message"] and "retrying" in error["message"]
    assert "Retry-After" not in headers  # permanent: no invitation to retry
    assert headers["x-should-retry"] == "false"  # the openai clients then do not retry


async def test_without_a_refusal_file_it_is_the_ordinary_retryable_503(settings):
    _, app = app_for(settings)
    client = app.test_client()
    status, headers, body = await call(client, "post", "/v1/completions", {"prompt": "hi"})
    assert (status, body["error"]["code"], headers["Retry-After"]) == (503, "station_unavailable", "1")
    status, _, body = await call(client, "get", "/health")
    assert (status, body["status"], body["station_refused"]) == (503, "unavailable", None)


async def test_metrics_gauge(settings):
    write_refusal(settings.station_refusal_file, REFUSAL, model="/models/mamba")
    _, app = app_for(settings)
    response = await app.test_client().get("/metrics")
    text = (await response.get_data()).decode()
    assert "gnosis_station_refused 1.0" in text and "gnosis_station_up 0.0" in text


def test_a_refusal_older_than_the_last_station_reached_is_stale(settings):
    link, _ = app_for(settings)
    path = settings.station_refusal_file
    write_refusal(path, REFUSAL, model="/models/mamba")
    assert link.refusal is not None and link.refusal["model_type"] == "mamba"
    # A station answered hello after the file was written (the link's record of it): the
    # file describes an earlier station, never the one that may be restarting now.
    link._connected_wall = time.time() + 60
    assert link.refusal is None
    link._connected_wall = time.time() - 60  # a refusal written after that connect counts
    assert link.refusal is not None
    os.unlink(path)
    assert link.refusal is None


def test_an_unreadable_refusal_file_says_nothing(settings):
    link, _ = app_for(settings)
    path = settings.station_refusal_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert link.refusal is None
