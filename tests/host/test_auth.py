"""API keys: the keys file, the 401 answer, which routes need a key, the tenant a key names,
and the supervisor's /health probe when /health needs a key.

The app through Quart's ASGI test client (no station needed: a request that passes the key
check gets the station's 503), the host as a real process for start-up and the probe.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trio

from gnosis_daemon.settings import Settings
from host.app import create_app
from gnosis_daemon.api_keys import ANON, KeyFileError, load_keyring, parse_key_file, tenant_key
from host.station_link import StationLink
from supervisor.probes import host_health, probe_api_key
from tests.support.procs import REPO, child_env, free_port, wait_for

MISSING = {"error": {
    "message": "You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
WRONG = {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                   "param": None, "code": "invalid_api_key"}}


def keys_file(tmp_path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_the_keys_file_format(tmp_path):
    text = "# operators\n\n  sk-alpha   team-a  \nsk-beta\n\t# indented comment\nsk-gamma team-a\n"
    assert parse_key_file(text, "f") == [("sk-alpha", "team-a"), ("sk-beta", None),
                                         ("sk-gamma", "team-a")]
    ring = load_keyring(Settings(runtime_dir=str(tmp_path), api_keys="sk-env",
                                 api_keys_file=keys_file(tmp_path, text)))
    assert ring.enabled
    assert ring.tenant("sk-alpha") == ring.tenant("sk-gamma") == "team-a"
    assert ring.tenant("sk-beta") == tenant_key("sk-beta")
    assert ring.tenant("sk-env") == tenant_key("sk-env")
    assert ring.tenant("sk-alph") is None and ring.tenant("") is None and ring.tenant(None) is None


def test_without_keys_every_caller_is_one_tenant(tmp_path):
    ring = load_keyring(Settings(runtime_dir=str(tmp_path)))
    assert not ring.enabled
    assert ring.tenant("anything") == ring.tenant(None) == ring.tenant("other") == ANON


@pytest.mark.parametrize("text, message", [
    ("sk-a team b\n", "line 1: expected a key optionally followed by one tenant name, got 3 "
                      "fields"),
    ("# c\nsk-a team/x\n", "line 2: tenant name must be 1-64 characters of A-Z, a-z, 0-9, '_' "
                           "or '-'"),
    ("sk-é\n", "line 1: a key must be printable ASCII without spaces"),
    ("# only comments\n\n", "holds no keys"),
    ("sk-a t1\nsk-a t2\n", "an API key is configured twice with different tenants ('t1' and "
                           "'t2')"),
])
def test_a_bad_keys_file_is_refused_with_the_line(tmp_path, text, message):
    with pytest.raises(KeyFileError) as info:
        load_keyring(Settings(runtime_dir=str(tmp_path),
                              api_keys_file=keys_file(tmp_path, text)))
    assert message in str(info.value)


def test_the_host_refuses_to_start_on_a_bad_keys_file(tmp_path):
    path = keys_file(tmp_path, "sk-ok\nsk-a tenant extra\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gnosis_daemon.cli", "host", "--runtime-dir", str(tmp_path),
         "--port", str(free_port())], cwd=REPO, env=child_env(GNOSIS_API_KEYS_FILE=path),
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"gnosis-daemon host: api_keys_file {path!r} line 2: expected a key optionally " \
           f"followed by one tenant name, got 3 fields" in proc.stderr


def app_client(tmp_path, **settings):
    s = Settings(runtime_dir=str(tmp_path), **settings)
    return create_app(s, StationLink(s.station_socket, max_frame_bytes=s.max_frame_bytes)
                      ).test_client()


async def call(client, method, path, key=None, body=None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = key
    response = await client.open(path, method=method, headers=headers,
                                 data=json.dumps(body).encode() if body is not None else b"")
    return response.status_code, response.headers, json.loads(await response.get_data() or b"{}")


V1 = [("GET", "/v1/models", None), ("GET", "/v1/models/m", None),
      ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
      ("POST", "/v1/completions", {"prompt": "x"}), ("POST", "/v1/embeddings", {"input": "x"})]


@pytest.mark.parametrize("method, path, body", V1)
async def test_with_keys_every_v1_route_needs_one(tmp_path, method, path, body):
    client = app_client(tmp_path, api_keys="sk-one,sk-two")
    status, headers, answer = await call(client, method, path, None, body)
    assert (status, answer, headers["WWW-Authenticate"]) == (401, MISSING, "Bearer")
    for wrong in ("Bearer sk-three", "Bearer sk-on", "Basic sk-one", "sk-one", "Bearer "):
        status, _, answer = await call(client, method, path, wrong, body)
        assert (status, answer) == (401, WRONG if wrong.startswith("Bearer sk") else MISSING)
    for key in ("Bearer sk-one", "bearer  sk-two "):
        status, _, answer = await call(client, method, path, key, body)
        # Past the key check: the station is what is missing.
        assert (status, answer["error"]["code"]) == (503, "station_unavailable")


async def test_health_and_metrics_are_open_by_default(tmp_path):
    client = app_client(tmp_path, api_keys="sk-one")
    assert (await call(client, "GET", "/health"))[0] == 503  # the station is down, not a 401
    response = await client.get("/metrics")
    assert response.status_code == 200


async def test_health_requires_key_closes_health_and_metrics(tmp_path):
    client = app_client(tmp_path, api_keys="sk-one", health_requires_key=True)
    for path in ("/health", "/metrics"):
        status, _, answer = await call(client, "GET", path)
        assert (status, answer) == (401, MISSING)
        response = await client.get(path, headers={"Authorization": "Bearer sk-one"})
        # /health answers 503 without a station; /metrics 200.
        assert response.status_code == (503 if path == "/health" else 200)


async def test_without_keys_nothing_needs_one(tmp_path):
    client = app_client(tmp_path)
    status, _, answer = await call(client, "GET", "/v1/models", "Bearer whatever")
    assert (status, answer["error"]["code"]) == (503, "station_unavailable")


def test_the_supervisor_probe_sends_a_key_when_health_needs_one(tmp_path):
    port = free_port()
    path = keys_file(tmp_path, "sk-probe ops\nsk-other\n")
    settings = Settings(runtime_dir=str(tmp_path), port=port, api_keys_file=path,
                        health_requires_key=True)
    assert probe_api_key(settings) == "sk-probe"
    assert probe_api_key(Settings(runtime_dir=str(tmp_path), api_keys_file=path)) is None
    host = subprocess.Popen(
        [sys.executable, "-m", "gnosis_daemon.cli", "host", "--runtime-dir", str(tmp_path),
         "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=child_env(GNOSIS_API_KEYS_FILE=path, GNOSIS_HEALTH_REQUIRES_KEY="1"))
    try:
        without = wait_for(lambda: trio.run(host_health, "127.0.0.1", port), 60, "host /health",
                           host)
        assert without == (401, MISSING)
        status, body = trio.run(host_health, "127.0.0.1", port, probe_api_key(settings))
        # No station runs here: the real /health body, 503, with the host's pid.
        assert (status, body["status"], body["host_pid"]) == (503, "unavailable", host.pid)
    finally:
        host.terminate()
        host.wait(timeout=30)


@pytest.fixture
def keyed_host(tmp_path):
    port = free_port()
    host = subprocess.Popen(
        [sys.executable, "-m", "gnosis_daemon.cli", "host", "--runtime-dir", str(tmp_path),
         "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=child_env(GNOSIS_API_KEYS="sk-one", GNOSIS_MAX_REQUEST_BYTES="4096"))
    try:
        wait_for(lambda: trio.run(host_health, "127.0.0.1", port)[0] == 503, 60, "host /health",
                 host)
        yield port
    finally:
        host.terminate()
        host.wait(timeout=30)


@pytest.mark.parametrize("key, length, status", [("wrong", 2000, 401), ("sk-one", 10_000, 413)])
def test_an_answer_before_the_body_closes_the_connection(keyed_host, key, length, status):
    """A 401 or 413 answered before the body arrived says Connection: close and closes, so
    a client never sends its next request into a connection nobody reads."""

    async def exchange() -> tuple[bytes, bytes]:
        stream = await trio.open_tcp_stream("127.0.0.1", keyed_host)
        async with stream:
            await stream.send_all(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())
            head = b""
            with trio.fail_after(10):
                while b"\r\n\r\n" not in head:
                    head += await stream.receive_some(65536)
            # The body and a second request follow on the same connection.
            rest = b""
            try:
                await stream.send_all(b"x" * length + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                with trio.fail_after(10):
                    while chunk := await stream.receive_some(65536):
                        rest += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # already closed by the server: as good as EOF
            return head, rest

    head, rest = trio.run(exchange)
    lines = head.split(b"\r\n")
    assert lines[0] == f"HTTP/1.1 {status} ".encode() + lines[0].split(b" ", 2)[2]
    assert b"connection: close" in head.lower()
    # The server closed (EOF within the deadline): the second request was never left waiting.
    assert b"HTTP/1.1 503" not in rest


async def test_livez_never_needs_a_key(tmp_path):
    # A kubelet liveness probe carries no key; /livez says nothing but "the process serves".
    client = app_client(tmp_path, api_keys="sk-one", health_requires_key=True)
    response = await client.get("/livez")
    assert (response.status_code, json.loads(await response.get_data())) == (
        200, {"status": "alive"})
