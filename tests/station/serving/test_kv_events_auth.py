"""The KV events behind CURVE: with keys configured, a subscriber or replay client without
the right client key gets nothing (its handshake is refused), one with it gets the events.

The publisher is the station's own (``KVEventPublisher`` from ``start_publisher``, with the
settings' keys), on loopback ports; clients are plain pyzmq sockets."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
import zmq.auth

from gnosis_daemon.settings import Settings, SettingsError
from station.serving.kv_events import start_publisher
from tests.support.procs import free_port

BS = 4


@pytest.fixture
def certs(tmp_path):
    made = {}
    for name in ("station", "router", "stranger"):
        public, secret = zmq.auth.create_certificates(tmp_path, name)
        made[name] = zmq.auth.load_certificate(secret)
    (tmp_path / "allowed").mkdir()
    (tmp_path / "router.key").rename(tmp_path / "allowed" / "router.key")
    return tmp_path, made


@pytest.fixture
def curve_publisher(certs):
    path, keys = certs
    port, rport = free_port(), free_port()
    settings = Settings(runtime_dir=str(path / "run"), api_keys="sk-one", kv_block_size=BS,
                        kv_events_endpoint=f"tcp://0.0.0.0:{port}",
                        kv_events_replay_endpoint=f"tcp://0.0.0.0:{rport}",
                        kv_events_curve_secret_file=str(path / "station.key_secret"),
                        kv_events_curve_client_keys=str(path / "allowed"))
    pub = start_publisher(settings)
    ctx = zmq.Context()
    yield pub, ctx, keys, port, rport
    pub.close()
    ctx.destroy(linger=0)


def _socket(ctx, kind, keys, client=None):
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.RCVTIMEO, 1500)
    sock.setsockopt(zmq.LINGER, 0)
    if client is not None:
        sock.curve_publickey, sock.curve_secretkey = keys[client]
        sock.curve_serverkey = keys["station"][0]
    return sock


def _recv_or_none(sock):
    try:
        return sock.recv_multipart()
    except zmq.Again:
        return None


def test_only_the_configured_client_key_receives_events(curve_publisher):
    pub, ctx, keys, port, _ = curve_publisher
    subs = {}
    for who in ("router", "stranger", None):
        sub = _socket(ctx, zmq.SUB, keys, who)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        subs[who] = sub
    time.sleep(0.5)  # handshakes and subscriptions reach the publisher
    pub.listener.stored(7, None, (1, 2, 3, 4))
    pub.flush()
    frames = _recv_or_none(subs["router"])
    assert frames is not None
    batch = msgpack.unpackb(frames[2])
    events = [e for e in batch[1] if e["type"] == "BlockStored"]
    assert events and events[0]["token_ids"] == [1, 2, 3, 4]
    # No credentials, or a key the station does not know: nothing, not even the clear.
    assert _recv_or_none(subs[None]) is None
    assert _recv_or_none(subs["stranger"]) is None


def test_the_replay_socket_refuses_unauthenticated_requests(curve_publisher):
    pub, ctx, keys, _, rport = curve_publisher
    pub.listener.stored(9, None, (5, 6, 7, 8))
    pub.flush()
    time.sleep(0.2)
    answers = {}
    for who in (None, "stranger", "router"):
        dealer = _socket(ctx, zmq.DEALER, keys, who)
        dealer.connect(f"tcp://127.0.0.1:{rport}")
        dealer.setsockopt(zmq.SNDTIMEO, 1500)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        except zmq.Again:
            # A refused handshake can drop the connection's pipe before the send, and a
            # DEALER with no pipe has nowhere to queue: refused before a byte went out.
            answers[who] = None
            continue
        answers[who] = _recv_or_none(dealer)
    assert answers[None] is None and answers["stranger"] is None
    _, seq, payload = answers["router"]
    assert int.from_bytes(seq, "big") == 0 and msgpack.unpackb(payload)[1]


def test_curve_settings_are_checked_at_start(certs):
    path, _ = certs
    base = dict(runtime_dir=str(path / "run"), kv_events_endpoint="tcp://0.0.0.0:5557")
    with pytest.raises(SettingsError, match="kv_events_curve_client_keys"):
        Settings(**base, kv_events_curve_secret_file=str(path / "station.key_secret"))
    with pytest.raises(SettingsError, match="no CURVE secret key"):  # the public half
        Settings(**base, kv_events_curve_secret_file=str(path / "station.key"),
                 kv_events_curve_client_keys=str(path / "allowed"))
    with pytest.raises(SettingsError, match="not a Z85 CURVE public key"):
        Settings(**base, kv_events_curve_secret_file=str(path / "station.key_secret"),
                 kv_events_curve_client_keys="~" * 40 + ",")
    z85 = zmq.auth.load_certificate(path / "allowed" / "router.key")[0].decode()
    Settings(**base, api_keys="sk-one", kv_events_curve_secret_file=str(path / "station.key_secret"),
             kv_events_curve_client_keys=f"{z85}, {path / 'stranger.key'}")


def test_the_local_relay_serves_a_plain_subscriber_on_loopback(curve_publisher, certs):
    """deploy/kv_events_relay.py: a router without CURVE (vllm-router 0.1.17) reads the
    events on loopback through the relay, which proves the allowed client key upstream."""
    import importlib.util

    from tests.support.procs import REPO

    spec = importlib.util.spec_from_file_location("kv_events_relay",
                                                  REPO / "deploy" / "kv_events_relay.py")
    relay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(relay)
    pub, ctx, keys, port, rport = curve_publisher
    listen, rlisten = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    relay_ctx = zmq.Context()
    with pytest.raises(ValueError, match="not a loopback endpoint"):
        relay.relay(relay_ctx, keys["station"][0], keys["router"], f"tcp://127.0.0.1:{port}",
                    "tcp://0.0.0.0:1")
    relay.relay(relay_ctx, keys["station"][0], keys["router"], f"tcp://127.0.0.1:{port}",
                listen, f"tcp://127.0.0.1:{rport}", rlisten)
    try:
        sub = _socket(ctx, zmq.SUB, keys)  # plain ZMQ, as the router speaks it
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(listen)
        time.sleep(0.5)
        pub.listener.stored(11, None, (9, 9, 9, 9))
        pub.flush()
        frames = _recv_or_none(sub)
        assert frames is not None and msgpack.unpackb(frames[2])[1][0]["token_ids"] == [9] * 4
        dealer = _socket(ctx, zmq.DEALER, keys)
        dealer.connect(rlisten)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        answers = []
        while (frames := _recv_or_none(dealer)) is not None:
            answers.append(frames)
            if int.from_bytes(frames[1], "big", signed=True) == -1:
                break
        assert len(answers) >= 2 and int.from_bytes(answers[0][1], "big") == 0
        assert int.from_bytes(answers[-1][1], "big", signed=True) == -1
    finally:
        relay_ctx.term()
