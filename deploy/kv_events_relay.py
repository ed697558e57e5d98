"""A local relay for routers whose KV event subscriber cannot do ZMQ CURVE (vllm-router 0.1.17).

With API keys configured, a daemon publishes its KV events (every tenant's prompt tokens)
only on loopback or behind CURVE (docs/deploy.md, "Routing without a session key"). A router
on another machine that speaks only plain ZMQ then reads them through this relay, run beside
the router (the same pod or host): it subscribes to one daemon's events as a CURVE client
and republishes them on a loopback endpoint, and forwards replay requests the same way.
Run one per daemon; point the router's ``--kv-event-source`` (and
``--kv-event-replay-source``) at the relay's loopback endpoints.

    python kv_events_relay.py --server-key station.key --client-key router.key_secret \\
        --upstream tcp://gnosis-daemon-0.gnosis-daemon:5557 --listen tcp://127.0.0.1:15557 \\
        [--replay-upstream tcp://...:5558 --replay-listen tcp://127.0.0.1:15558]

``--server-key``: the daemon's public certificate (``<name>.key``); ``--client-key``: this
relay's secret certificate (``<name>.key_secret``), whose public key is in the daemon's
``kv_events_curve_client_keys``. The listen endpoints must be loopback (refused otherwise):
what comes out of the relay is unencrypted. Needs only pyzmq.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
import threading
from urllib.parse import urlsplit

import zmq
import zmq.auth

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last answer
REPLAY_TIMEOUT_MS = 5000


def _loopback(endpoint: str) -> bool:
    host = urlsplit(endpoint).hostname or ""
    if endpoint.startswith("ipc://") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _curve_client(sock: zmq.Socket, server_key: bytes, client: tuple[bytes, bytes]) -> None:
    sock.curve_serverkey = server_key
    sock.curve_publickey, sock.curve_secretkey = client


def relay(ctx: zmq.Context, server_key: bytes, client: tuple[bytes, bytes], upstream: str,
          listen: str, replay_upstream: str = "", replay_listen: str = "") -> list[threading.Thread]:
    """Start the relay's proxies on daemon threads (they end when ``ctx`` is terminated)."""
    for endpoint in (listen, replay_listen):
        if endpoint and not _loopback(endpoint):
            raise ValueError(f"{endpoint!r} is not a loopback endpoint: the relay republishes "
                             "the events unencrypted")
    sub = ctx.socket(zmq.SUB)
    _curve_client(sub, server_key, client)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(upstream)
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(100_000)
    pub.bind(listen)
    pairs = [(sub, pub, None)]
    if replay_upstream and replay_listen:
        front = ctx.socket(zmq.ROUTER)
        front.bind(replay_listen)
        back = ctx.socket(zmq.DEALER)
        _curve_client(back, server_key, client)
        back.connect(replay_upstream)
        pairs.append((front, back, "replay"))
    threads = [threading.Thread(target=_proxy if kind is None else _replay, args=pair,
                                daemon=True) for *pair, kind in pairs]
    for thread in threads:
        thread.start()
    return threads


def _proxy(front: zmq.Socket, back: zmq.Socket) -> None:
    try:
        zmq.proxy(front, back)
    except zmq.ContextTerminated:
        pass
    finally:
        front.close(linger=0)
        back.close(linger=0)


def _replay(front: zmq.Socket, back: zmq.Socket) -> None:
    """One replay request at a time: ``[id, "", start_seq]`` from the router goes upstream
    as ``["", start_seq]`` (the daemon's replay socket takes exactly three frames, so a
    generic proxy's extra envelope would be refused), its answers come back to ``id``
    until the end marker (seq -1) or ``REPLAY_TIMEOUT_MS`` of silence."""
    try:
        while True:
            frames = front.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            back.send_multipart([b"", start])
            while back.poll(REPLAY_TIMEOUT_MS):
                answer = back.recv_multipart()
                front.send_multipart([client, *answer])
                if len(answer) == 3 and answer[1] == END_SEQ:
                    break
    except zmq.ContextTerminated:
        pass
    finally:
        front.close(linger=0)
        back.close(linger=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-key", required=True, help="the daemon's public certificate")
    parser.add_argument("--client-key", required=True, help="this relay's secret certificate")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--replay-upstream", default="")
    parser.add_argument("--replay-listen", default="")
    args = parser.parse_args(argv)
    server_key = zmq.auth.load_certificate(args.server_key)[0]
    public, secret = zmq.auth.load_certificate(args.client_key)
    if secret is None:
        parser.error("--client-key must be a secret certificate (<name>.key_secret)")
    ctx = zmq.Context()
    try:
        threads = relay(ctx, server_key, (public, secret), args.upstream, args.listen,
                        args.replay_upstream, args.replay_listen)
    except ValueError as exc:
        parser.error(str(exc))
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
