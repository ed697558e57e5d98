"""A station's internal error never reaches a client: a 500 (and a streamed error event)
says only "Internal server error (request id <id>)."; the station's text is in the host's log
line carrying that request id.

The real station answers ``internal`` only when it has a bug, which no request can be made
to trigger on purpose, so the peer here is a scripted station: a real Unix socket speaking
the real protocol (``gnosis_daemon.protocol``) that answers ``generate`` with an internal
error, before or after the first token. The host is a real ``gnosis-daemon host`` process
on real HTTP.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import httpx
import pytest
import trio

from gnosis_daemon.protocol import (
    Capability,
    ErrorCode,
    FrameDecoder,
    error_frame,
    event_frame,
    parse_request,
    result_frame,
)
from tests.host.conftest import log_lines, spawn
from tests.support.procs import free_port, stop_process, wait_for

SECRET = "KeyError('kv_blocks') at /srv/station/engine.py:412"
HELLO = {"protocol": 1, "pid": os.getpid(), "version": "scripted",
         "model": {"id": "scripted", "max_model_len": 64, "vocab_size": 100},
         "capabilities": {c.value: c is Capability.GENERATE for c in Capability},
         "kv_pool": {"block_size": 16, "blocks_total": 8, "blocks_free": 8}}


def _text(args: dict) -> str:
    return args.get("prompt") or (args.get("messages") or [{}])[-1].get("content", "")


async def _serve_connection(stream: trio.SocketStream) -> None:
    decoder = FrameDecoder()
    async with stream:
        while data := await stream.receive_some(65536):
            for frame in decoder.feed(data):
                req = parse_request(frame)
                if req.op == "hello":
                    await stream.send_all(result_frame(req.id, HELLO))
                elif req.op == "generate" and _text(req.args) == "fail-after-a-token":
                    await stream.send_all(event_frame(req.id, {
                        "type": "prefill", "prompt_tokens": 3, "cached_tokens": 0}))
                    await stream.send_all(event_frame(req.id, {
                        "type": "tokens", "token_ids": [7], "text": "hi"}))
                    await stream.send_all(error_frame(req.id, ErrorCode.INTERNAL, SECRET))
                elif req.op == "generate":
                    await stream.send_all(error_frame(req.id, ErrorCode.INTERNAL, SECRET))
                elif req.op != "cancel":
                    await stream.send_all(error_frame(req.id, ErrorCode.UNKNOWN_OP, req.op))


@pytest.fixture
def scripted_host(tmp_path):
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    ready, stop = threading.Event(), {}

    async def station() -> None:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(str(runtime_dir / "station.sock"))
        sock.listen(8)
        async with trio.open_nursery() as nursery:
            stop["cancel"] = nursery.cancel_scope.cancel
            stop["token"] = trio.lowlevel.current_trio_token()
            ready.set()
            await trio.serve_listeners(_serve_connection, [trio.SocketListener(sock)])

    thread = threading.Thread(target=trio.run, args=(station,), daemon=True)
    thread.start()
    assert ready.wait(10)
    port, log = free_port(), tmp_path / "host.log"
    host = spawn("host", runtime_dir, log, "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(base + "/health").status_code == 200, 60, "host /health 200",
                 host)
        yield base, log
    finally:
        stop_process(host)
        trio.from_thread.run_sync(stop["cancel"], trio_token=stop["token"])
        thread.join(10)


def logged_detail(log: Path, request_id: str) -> list[str]:
    return [line["detail"] for line in log_lines(log)
            if line.get("event") == "internal_error" and line.get("request_id") == request_id]


@pytest.mark.parametrize("stream", [False, True])
def test_a_station_internal_error_is_a_generic_500(scripted_host, stream):
    base, log = scripted_host
    rid = f"rid-internal-{int(stream)}"
    r = httpx.post(base + "/v1/completions", headers={"X-Request-Id": rid},
                   json={"prompt": "fail-now", "max_tokens": 2, "stream": stream})
    assert (r.status_code, r.json()) == (500, {"error": {
        "message": f"Internal server error (request id {rid}).", "type": "server_error",
        "param": None, "code": "internal_error"}})
    assert SECRET not in r.text
    assert wait_for(lambda: logged_detail(log, rid), 10, "the log line with the detail") == \
        [f"station error internal: {SECRET}"]


def test_a_streamed_internal_error_event_is_generic(scripted_host):
    base, log = scripted_host
    rid = "rid-internal-mid-stream"
    with httpx.stream("POST", base + "/v1/chat/completions", headers={"X-Request-Id": rid},
                      json={"messages": [{"role": "user", "content": "fail-after-a-token"}],
                            "stream": True}
                      ) as r:
        assert r.status_code == 200  # the headers left before the error
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert json.loads(events[-1]) == {"error": {
        "message": f"Internal server error (request id {rid}).", "type": "server_error",
        "param": None, "code": "internal_error"}}
    assert wait_for(lambda: logged_detail(log, rid), 10, "the log line with the detail") == \
        [f"station error internal: {SECRET}"]
