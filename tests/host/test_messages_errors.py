"""Every error of ``/v1/messages`` has Anthropic's body and status, through the real app
(Quart's ASGI test client, no station): no station, a full host, a body past the limit,
bad JSON, an unknown sub-route, a missing key; and the official client's exception class
for each."""

from __future__ import annotations

import json

import pytest

from gnosis_daemon.settings import Settings
from host.app import create_app
from host.station_link import StationLink

MESSAGE = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def app_for(tmp_path, **settings):
    s = Settings(runtime_dir=str(tmp_path), **settings)
    return create_app(s, StationLink(s.station_socket, max_frame_bytes=s.max_frame_bytes))


async def post(app, data, path="/v1/messages", headers=None):
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    response = await app.test_client().post(path, data=raw, headers={
        "Content-Type": "application/json", **(headers or {})})
    body = json.loads(await response.get_data())
    if path.startswith("/v1/messages"):
        assert body["request_id"] == response.headers["request-id"]
    return response.status_code, response.headers, body


def error(kind, message):
    return {"type": kind, "message": message}


async def test_no_station_is_an_overloaded_error_with_retry_after(tmp_path):
    status, headers, body = await post(app_for(tmp_path), MESSAGE)
    assert (status, headers["Retry-After"], body["type"]) == (503, "1", "error")
    assert body["error"]["type"] == "overloaded_error"
    assert body["error"]["message"].startswith("The model station is not available")


async def test_a_full_host_is_a_rate_limit_error(tmp_path):
    app = app_for(tmp_path, max_inflight_requests=1)
    app.gnosis_admission.inflight = 1  # one request in flight: the limit
    status, headers, body = await post(app, MESSAGE)
    assert (status, headers["Retry-After"]) == (429, "1")
    assert body["error"] == error("rate_limit_error", "The server is at its limit of 1 "
                                  "requests in flight; retry shortly.")


@pytest.mark.parametrize("raw, status, kind, start", [
    (b"{bad", 400, "invalid_request_error", "We could not parse the JSON body"),
    (json.dumps({**MESSAGE, "max_tokens": "4"}).encode(), 400, "invalid_request_error",
     "max_tokens: Input should be a valid integer"),
    (b"{" + b" " * 2048 + b"}", 413, "request_too_large", "The request body is larger"),
])
async def test_a_bad_body_is_anthropics_error(tmp_path, raw, status, kind, start):
    got, _, body = await post(app_for(tmp_path, max_request_bytes=1024), raw)
    assert (got, body["error"]["type"]) == (status, kind)
    assert body["error"]["message"].startswith(start) and set(body["error"]) == {"type", "message"}


async def test_an_unknown_sub_route_is_a_not_found_error(tmp_path):
    status, _, body = await post(app_for(tmp_path), MESSAGE, "/v1/messages/nowhere")
    assert (status, body["error"]["type"]) == (404, "not_found_error")


async def test_keys_come_as_x_api_key_or_bearer(tmp_path):
    app = app_for(tmp_path, api_keys="secret")
    assert (await post(app, MESSAGE))[2]["error"] == error("authentication_error",
                                                           "x-api-key header is required")
    wrong = await post(app, MESSAGE, headers={"x-api-key": "guess"})
    assert (wrong[0], wrong[2]["error"]) == (401, error("authentication_error", "invalid x-api-key"))
    for headers in ({"x-api-key": "secret"}, {"Authorization": "Bearer secret"}):
        status, _, body = await post(app, MESSAGE, headers=headers)
        assert (status, body["error"]["type"]) == (503, "overloaded_error")  # past the key


async def test_the_other_routes_keep_openais_body(tmp_path):
    status, _, body = await post(app_for(tmp_path, max_inflight_requests=1), MESSAGE,
                                 "/v1/chat/completions")
    assert status == 503 and body["error"]["type"] == "service_unavailable"
