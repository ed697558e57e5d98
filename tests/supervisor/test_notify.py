"""sd_notify datagrams, received on a real AF_UNIX/SOCK_DGRAM socket."""

from __future__ import annotations

import os
import socket

from supervisor.notify import Notifier, format_message, socket_address


def test_format_is_key_value_lines_and_values_stay_on_one_line():
    assert format_message(READY=1, STATUS="both up") == b"READY=1\nSTATUS=both up"
    assert format_message(STATUS="a\nb") == b"STATUS=a b"
    assert format_message(WATCHDOG=True) == b"WATCHDOG=1"


def test_path_socket_receives_each_message(tmp_path):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        notifier = Notifier(str(path))
        assert notifier.ready("starting done")
        assert notifier.watchdog()
        assert notifier.stopping("bye")
        got = [server.recv(4096) for _ in range(3)]
    assert got == [b"READY=1\nSTATUS=starting done", b"WATCHDOG=1", b"STOPPING=1\nSTATUS=bye"]


def test_abstract_namespace_address():
    name = f"gnosis-test-notify-{os.getpid()}"
    assert socket_address("@" + name) == b"\0" + name.encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(b"\0" + name.encode())
        assert Notifier("@" + name).status("hello")
        assert server.recv(4096) == b"STATUS=hello"


def test_no_socket_is_a_noop_and_a_dead_socket_does_not_raise(tmp_path):
    assert Notifier(None).ready("x") is False
    assert Notifier(str(tmp_path / "absent.sock")).watchdog() is False
