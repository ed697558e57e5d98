"""The control socket: mode 0600, JSON lines, bad requests answered, stale socket replaced."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import trio

from gnosis_daemon.settings import Settings
from supervisor.control import ControlError, call, request_restart, serve_control


async def test_requests_and_replies(tmp_path):
    path = tmp_path / "control.sock"
    seen: list[dict] = []

    async def handler(request: dict) -> dict:
        seen.append(request)
        return {"ok": True, "pid": 42} if request["op"] == "restart" else {"ok": True, "status": {}}

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, path, handler)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        restart = await trio.to_thread.run_sync(call, path, {"op": "restart", "child": "host"})
        assert restart == {"ok": True, "pid": 42}
        bad = await trio.to_thread.run_sync(call, path, {"op": "restart", "child": "gpu"})
        assert bad == {"ok": False, "error": 'restart needs "child": one of station, host'}
        unknown = await trio.to_thread.run_sync(call, path, {"op": "reboot"})
        assert unknown["ok"] is False and "unknown op 'reboot'" in unknown["error"]

        def garbage() -> bytes:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
                s.sendall(b"not json\n")
                return s.recv(1000)

        assert await trio.to_thread.run_sync(garbage) == b'{"ok": false, "error": "request is not JSON"}\n'
        # a second supervisor on the same runtime dir is refused, the first keeps serving
        with pytest.raises(ControlError, match="another supervisor already serves"):
            await serve_control(path, handler)
        assert (await trio.to_thread.run_sync(call, path, {"op": "status"}))["ok"] is True
        nursery.cancel_scope.cancel()
    assert seen == [{"op": "restart", "child": "host"}, {"op": "status"}]
    assert not path.exists()


async def test_stale_socket_file_is_replaced(tmp_path):
    path = tmp_path / "control.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never listening: what a SIGKILLed supervisor leaves

    async def handler(request: dict) -> dict:
        return {"ok": True, "status": {}}

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, path, handler)
        assert (await trio.to_thread.run_sync(call, path, {"op": "status"}))["ok"] is True
        nursery.cancel_scope.cancel()


def test_restart_without_supervisor_says_so(tmp_path, capsys):
    assert request_restart(Settings(runtime_dir=str(tmp_path)), "station") == 1
    assert "the supervisor is not running (no control socket answers at" in capsys.readouterr().err
