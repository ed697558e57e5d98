"""The app through Quart's ASGI test client with no station running: validation happens
before the station is needed, and a missing station is a clean 503."""

from __future__ import annotations

import json

import pytest

from gnosis_daemon.settings import Settings
from host.app import create_app
from host.station_link import StationLink

UNAVAILABLE = {"error": {
    "message": "The model station is not available right now; retry shortly. (not connected "
               "to the station yet)",
    "type": "service_unavailable", "param": None, "code": "station_unavailable"}}


@pytest.fixture
def client(tmp_path):
    settings = Settings(runtime_dir=str(tmp_path))
    link = StationLink(settings.station_socket, max_frame_bytes=settings.max_frame_bytes)
    return create_app(settings, link).test_client()


async def post(client, path, data, headers=None):
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    response = await client.post(path, data=raw, headers={"Content-Type": "application/json",
                                                           **(headers or {})})
    return response.status_code, response.headers, json.loads(await response.get_data())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("raw", [b"{bad", b"", b'{"messages": NaN}', b"\xff\xfe"])
async def test_malformed_json_is_400(client, path, raw):
    status, _, body = await post(client, path, raw)
    assert (status, body) == (400, {"error": {
        "message": "We could not parse the JSON body of your request. The API expects a JSON "
                   "object as the body (Content-Type: application/json).",
        "type": "invalid_request_error", "param": None, "code": None}})


async def test_a_bad_field_is_rejected_before_the_station_is_asked(client):
    status, _, body = await post(client, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "x"}],
                                  "prediction": {"type": "content", "content": "x"}})
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "unsupported_value",
                                                                       "prediction")


@pytest.mark.parametrize("path, data", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"prompt": "x", "stream": True}),
])
async def test_no_station_is_503_with_retry_after(client, path, data):
    status, headers, body = await post(client, path, data)
    assert (status, headers["Retry-After"], body) == (503, "1", UNAVAILABLE)


async def test_models_without_station_is_503(client):
    response = await client.get("/v1/models")
    assert response.status_code == 503
    assert json.loads(await response.get_data()) == UNAVAILABLE


async def test_health_without_station_is_503_with_the_same_fields(client):
    response = await client.get("/health")
    body = json.loads(await response.get_data())
    assert response.status_code == 503
    assert body["status"] == "unavailable" and body["station_reachable"] is False
    assert body["station_pid"] is None and body["station_restarts"] == 0
    assert body["liquid_memory"] is False and body["liquid_memory_reason"] == "station not connected"


async def test_request_id_is_echoed_or_generated(client):
    _, headers, _ = await post(client, "/v1/completions", {"prompt": 1},
                               {"X-Request-Id": "abc-123"})
    assert headers["X-Request-Id"] == "abc-123"
    _, headers, _ = await post(client, "/v1/completions", {"prompt": 1},
                               {"X-Request-Id": "bad id with spaces"})
    assert headers["X-Request-Id"].startswith("req-")


async def test_unknown_route_and_method_use_the_openai_error_body(client):
    response = await client.get("/v1/nothing")
    assert response.status_code == 404
    assert json.loads(await response.get_data()) == {"error": {
        "message": "Unknown request URL: GET /v1/nothing.", "type": "invalid_request_error",
        "param": None, "code": "not_found"}}
    response = await client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert json.loads(await response.get_data())["error"]["code"] == "method_not_allowed"


async def test_metrics_counts_requests(client):
    await post(client, "/v1/completions", b"{")
    response = await client.get("/metrics")
    text = (await response.get_data()).decode()
    assert 'gnosis_http_requests_total{path="/v1/completions",status="400"} 1' in text
    assert "gnosis_station_up 0" in text


async def test_livez_is_200_without_a_station(client):
    # The liveness probe: a station down or restarting must not get the pod killed.
    response = await client.get("/livez")
    assert response.status_code == 200
    assert json.loads(await response.get_data()) == {"status": "alive"}
