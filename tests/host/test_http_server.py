"""``send_or_stall`` over a real socket pair: a peer that takes nothing is a stall, one that
keeps taking bytes, however slowly, never is."""

from __future__ import annotations

import socket

import trio

from host.http_server import send_or_stall

PAYLOAD = b"x" * (8 * 1024 * 1024)  # far past both sockets' buffers


def _pair() -> tuple[trio.SocketStream, trio.socket.SocketType]:
    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return trio.SocketStream(trio.socket.from_stdlib_socket(a)), trio.socket.from_stdlib_socket(b)


async def test_a_peer_that_reads_nothing_is_a_stall():
    stream, peer = _pair()
    with trio.fail_after(30):
        assert await send_or_stall(stream, PAYLOAD, 0.5) is False
    stream.socket.close()
    peer.close()


async def test_a_peer_that_keeps_reading_slowly_is_not():
    stream, peer = _pair()
    payload = b"y" * (256 * 1024)
    received = bytearray()

    async def slow_reader() -> None:
        while len(received) < len(payload):
            received.extend(await peer.recv(4096))
            await trio.sleep(0.01)  # far slower than the writer, never still for 0.5 s

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_reader)
            assert await send_or_stall(stream, payload, 0.5) is True
    assert bytes(received) == payload
    stream.socket.close()
    peer.close()
