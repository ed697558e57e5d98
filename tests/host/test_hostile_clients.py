"""Clients that hold the host's resources without using them, against a real station and
two real ``gnosis-daemon host`` processes on the tiny model, over raw loopback sockets:

- bodies sent a byte at a time hold no ``max_inflight_requests`` slot (a slot is taken once
  the body is read), and one tenant's streams hold at most its share of the slots
  (``max_inflight_tenant_share``): another tenant is served meanwhile;
- a stream whose client stops reading is ended after ``stream_stall_timeout_s`` (connection
  closed, slot and station sequence freed, ``gnosis_stalled_responses_total`` counted);
- a client that does not read an n=16 stream with top logprobs makes the host hold at most
  ``stream_buffer_bytes`` of its frames: then that stream alone is ended and counted;
- a request with both Content-Length and Transfer-Encoding is answered and its connection
  closed (the request smuggled after it is never answered); ``Upgrade: h2c`` is not 101.

Every wait is bounded; nothing asserts a duration.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.host.conftest import spawn
from tests.support.procs import free_port, http_json, stop_process, wait_for

LIMIT = 4  # max_inflight_requests; each tenant's share is half of it
ATTACKER, VICTIM = "sk-attacker", "sk-victim"
STALL_S = 2.0
BUFFER_BYTES = 128 * 1024
LONG_PROMPT = [66, 67, 68]  # greedy decoding runs past hundreds of tokens without EOS
# One step of this stream is 16 frames of 20 top logprobs each: kernel buffers fill fast.
HEAVY = {"messages": [{"role": "user", "content": "go"}], "n": 16, "logprobs": True,
         "top_logprobs": 20, "max_tokens": 4000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, tiny_llama):
    """One station and two hosts on it: ``stall`` (the stall bound small, the buffer bound
    large) and ``buffer`` (the other way round)."""
    root = tmp_path_factory.mktemp("hostile")
    runtime_dir = root / "run"
    station = spawn("station", runtime_dir, root / "station.log", "--model", str(tiny_llama))
    common = {"GNOSIS_MAX_INFLIGHT_REQUESTS": str(LIMIT), "THOTH_LIQUID_MEMORY": "0",
              "GNOSIS_API_KEYS": f"{ATTACKER},{VICTIM}"}
    settings = {"stall": {"GNOSIS_STREAM_STALL_TIMEOUT_S": str(STALL_S),
                          "GNOSIS_STREAM_BUFFER_BYTES": str(64 * 1024 * 1024)},
                "buffer": {"GNOSIS_STREAM_BUFFER_BYTES": str(BUFFER_BYTES),
                           "GNOSIS_STREAM_STALL_TIMEOUT_S": "600"}}
    procs, out = [station], {"station": station, "root": root}
    try:
        for name, env in settings.items():
            port = free_port()
            procs.append(spawn("host", runtime_dir, root / f"host-{name}.log", "--port",
                               str(port), env={**common, **env}))
            out[name] = {"port": port, "base": f"http://127.0.0.1:{port}", "proc": procs[-1]}
        for name in settings:
            wait_for(lambda: http_json(out[name]["base"] + "/health", timeout=5)[1]
                     .get("station_pid") == station.pid, 90, f"host {name} /health", station)
        yield out
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _request(port: int, key: str, body: dict, path: str = "/v1/chat/completions") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _connect(port: int, small_window: bool = False) -> socket.socket:
    sock = socket.socket()
    if small_window:  # a client that reads nothing fills a small receive window at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    return sock


def _status(sock: socket.socket) -> int:
    """Read up to the end of the response's head (a few bytes of body may come along)."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1024)
        assert chunk, f"connection closed before the response head: {head!r}"
        head += chunk
    return int(head.split(b" ", 2)[1])


def _stalled_stream(port: int, key: str, body: dict) -> tuple[socket.socket, int]:
    """A stream whose client reads its status line, then nothing."""
    sock = _connect(port, small_window=True)
    sock.sendall(_request(port, key, body))
    return sock, _status(sock)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (bounded by the socket timeout)."""
    raw = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return raw
        if not chunk:
            return raw
        raw += chunk


def test_slow_bodies_and_stalled_streams_leave_another_tenant_served(hosts):
    port, base = hosts["stall"]["port"], hosts["stall"]["base"]
    slow: list[socket.socket] = []
    stalled: list[socket.socket] = []
    try:
        # LIMIT bodies that have sent one byte of their 1000: no slot is taken for them.
        for _ in range(LIMIT):
            sock = _connect(port)
            sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          f"Authorization: Bearer {ATTACKER}\r\nContent-Length: 1000\r\n"
                          f"\r\n{{").encode())
            slow.append(sock)
        # LIMIT streams whose client reads nothing: the tenant's share (LIMIT/2) is admitted.
        statuses = []
        for _ in range(LIMIT):
            sock, status = _stalled_stream(port, ATTACKER, HEAVY)
            stalled.append(sock)
            statuses.append(status)
        assert sorted(statuses) == [200] * (LIMIT // 2) + [429] * (LIMIT // 2), statuses
        gauges = _metrics(base)
        assert gauges["gnosis_model_requests_inflight"] <= LIMIT // 2, gauges
        # The other tenant is served while all of that is held.
        with httpx.Client(base_url=base, timeout=60,
                          headers={"Authorization": f"Bearer {VICTIM}"}) as http:
            for _ in range(3):
                r = http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                assert r.status_code == 200, r.text
            # And the attacker past its share is told so.
            r = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {ATTACKER}"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        if r.status_code == 429:  # its streams may already have been ended as stalled
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert "tenant is at its share of 2" in r.json()["error"]["message"]
    finally:
        for sock in slow + stalled:
            sock.close()


def test_a_stalled_stream_is_ended_its_slot_and_sequence_freed_and_counted(hosts):
    port, base = hosts["stall"]["port"], hosts["stall"]["base"]
    before = _metrics(base).get("gnosis_stalled_responses_total", 0.0)
    wait_for(lambda: _metrics(base)["gnosis_model_requests_inflight"] == 0, 60, "idle slots")
    sock, status = _stalled_stream(port, VICTIM, HEAVY)
    try:
        assert status == 200
        wait_for(lambda: _metrics(base)["gnosis_model_requests_inflight"] == 1, 30,
                 "the stream admitted")
        # The client never reads, and keeps its socket open: the host ends the stream.
        wait_for(lambda: _metrics(base)["gnosis_stalled_responses_total"] >= before + 1,
                 60, "the stalled stream counted")
        after = wait_for(lambda: (m := _metrics(base))["gnosis_model_requests_inflight"] == 0
                         and m.get("gnosis_requests_running") == 0 and m, 30,
                         "its slot and its station sequence freed")
        assert after["gnosis_stalled_responses_total"] == before + 1
        # The connection was closed by the host: what the client reads now ends.
        sock.settimeout(30)
        _read_all(sock)
    finally:
        sock.close()
    log = (hosts["root"] / "host-stall.log").read_text()
    assert '"http_client_stalled"' in log


def test_a_stream_whose_generation_ended_unread_gives_its_slot_back(hosts):
    """The generation is over (its answer waits in the host and the socket's buffers): the
    slot is still held by the unread body until the stall bound ends it."""
    port, base = hosts["stall"]["port"], hosts["stall"]["base"]
    wait_for(lambda: _metrics(base)["gnosis_model_requests_inflight"] == 0, 60, "idle slots")
    before = _metrics(base)["gnosis_stalled_responses_total"]
    sock, status = _stalled_stream(port, VICTIM, {**HEAVY, "max_tokens": 48})
    try:
        assert status == 200
        wait_for(lambda: (m := _metrics(base))["gnosis_stalled_responses_total"] > before
                 or (m["gnosis_requests_running"] == 0
                     and m["gnosis_model_requests_inflight"] == 1), 60,
                 "the generation over, its slot held by the unread answer")
        wait_for(lambda: (m := _metrics(base))["gnosis_model_requests_inflight"] == 0
                 and m["gnosis_stalled_responses_total"] == before + 1, 60,
                 "the unread answer ended and counted")
    finally:
        sock.close()


def test_a_stream_nobody_reads_holds_at_most_its_buffer_in_the_host(hosts):
    port, base = hosts["buffer"]["port"], hosts["buffer"]["base"]
    sock, status = _stalled_stream(port, VICTIM, HEAVY)
    try:
        assert status == 200
        wait_for(lambda: _metrics(base).get("gnosis_stream_buffer_overflows_total", 0) >= 1,
                 90, "the stream ended for falling behind")
        # The most one request's frames took in the host: the bound (a frame always fits an
        # empty inbox, and that was far below it); the unbounded channel held 13 MB.
        peak = _metrics(base)["gnosis_station_request_buffer_peak_bytes"]
        print(f"peak buffered for one request: {peak:.0f} bytes (bound {BUFFER_BYTES})")
        assert BUFFER_BYTES // 2 < peak <= BUFFER_BYTES, peak
        # Ended alone, at once: the station stopped the sequence, the host holds nothing,
        # while the client still has its socket open and unread.
        after = wait_for(lambda: (m := _metrics(base))["gnosis_requests_running"] == 0
                         and m["gnosis_station_buffered_bytes"] == 0 and m, 30,
                         "the sequence cancelled and its frames dropped")
        assert after["gnosis_station_buffered_frames"] == 0
        # The station link still serves every other request.
        r = httpx.post(base + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {VICTIM}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200
    finally:
        sock.close()


def test_a_client_reading_several_prompts_streams_is_never_cut(hosts):
    """The prompts' streams are read as their frames arrive, not one after another: each
    later prompt's frames would otherwise wait in its buffer (far past BUFFER_BYTES here)."""
    base = hosts["buffer"]["base"]
    before = _metrics(base).get("gnosis_stream_buffer_overflows_total", 0.0)
    body = {"prompt": [LONG_PROMPT, [70, 71], [72, 73, 74]], "n": 8, "max_tokens": 600,
            "ignore_eos": True, "temperature": 1.0, "stream": True,
            "stream_options": {"include_usage": True}}
    raw = b""
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {VICTIM}"}) as r:
        assert r.status_code == 200
        for data in r.iter_bytes():
            raw += data
    # Split on the events' blank lines only (sampled text may hold U+2028, a line break to
    # str.splitlines).
    events = [e[len(b"data: "):].decode() for e in raw.split(b"\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    finished = {c["choices"][0]["index"] for c in chunks
                if c["choices"] and c["choices"][0].get("finish_reason")}
    assert finished == set(range(24))
    assert chunks[-1]["usage"]["completion_tokens"] == 24 * 600
    after = _metrics(base)
    assert after.get("gnosis_stream_buffer_overflows_total", 0.0) == before
    assert after["gnosis_station_buffered_bytes"] == 0


def test_content_length_with_transfer_encoding_closes_after_the_response(hosts):
    port = hosts["stall"]["port"]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    chunked = f"{len(body):x}\r\n{body}\r\n0\r\n\r\n".encode()
    smuggled = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {VICTIM}\r\n"
                f"\r\n").encode()
    sock = _connect(port)
    try:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: Bearer {VICTIM}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
                     + chunked + smuggled)
        raw = _read_all(sock)
    finally:
        sock.close()
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:200]
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # the smuggled GET was never answered
    assert b"connection: close" in raw.split(b"\r\n\r\n")[0].lower()
    assert b'"object":"list"' not in raw


def test_pipelined_requests_still_share_a_connection(hosts):
    """The framing guard closes only after an ambiguous request."""
    port = hosts["stall"]["port"]
    one = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"
    sock = _connect(port)
    try:
        sock.sendall(one + one + b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = _read_all(sock)
    finally:
        sock.close()
    assert raw.count(b"HTTP/1.1 200 ") == 3, raw


def test_h2c_upgrade_is_answered_over_http_1_1(hosts):
    port = hosts["stall"]["port"]
    sock = _connect(port)
    try:
        sock.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                     b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
                     b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = _read_all(sock)
    finally:
        sock.close()
    assert b" 101 " not in raw and b"upgrade: h2c" not in raw.lower(), raw
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.count(b"HTTP/1.1 200 ") == 2, raw
    # The HTTP/2 preface is an HTTP/1.1 request for "*", not a switch to HTTP/2.
    sock = _connect(port)
    try:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        raw = _read_all(sock)
    finally:
        sock.close()
    assert raw.startswith(b"HTTP/1.1 404 ") and b"h2" not in raw.split(b"\r\n\r\n")[0], raw
