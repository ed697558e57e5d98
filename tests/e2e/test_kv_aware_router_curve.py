"""The keyed fleet's recipe (docs/deploy.md, "Routing without a session key"), for real:
two daemons with API keys publish their KV events on a wildcard behind CURVE, a relay per
daemon (``deploy/kv_events_relay.py``) subscribes with the allowed client key and
republishes on loopback, and ``vllm-router --policy kv_aware`` (which cannot do CURVE)
reads the relays. A prompt warmed on one replica is routed there through the router; a
plain subscriber on a daemon's own endpoint gets nothing."""

from __future__ import annotations

import importlib.util
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import zmq
import zmq.auth
from openai import OpenAI

from tests.e2e.test_kv_aware_router import BLOCK, ROUTER, _chat_count, start_router
from tests.support.procs import REPO, child_env, free_port, run_daemon
from tests.support.tiny_models import build_tiny_model

KEY = "sk-router"
pytestmark = pytest.mark.skipif(not Path(ROUTER).exists(), reason="vllm-router is not installed")


def _relay_module():
    spec = importlib.util.spec_from_file_location("kv_events_relay",
                                                  REPO / "deploy" / "kv_events_relay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_keyed_fleet_routes_by_prefix_through_the_relay(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", "llama")
    keys = tmp_path / "keys"
    keys.mkdir()
    zmq.auth.create_certificates(keys, "station")
    zmq.auth.create_certificates(keys, "relay")
    server_key = zmq.auth.load_certificate(keys / "station.key")[0]
    relay_pair = zmq.auth.load_certificate(keys / "relay.key_secret")
    relay = _relay_module()
    ctx = zmq.Context()
    with ExitStack() as stack:
        stack.callback(ctx.term)  # last: ends the relays' proxies, which close their sockets
        replicas = []
        for name in ("a", "b"):
            port, zport, local = free_port(), free_port(), free_port()
            env = child_env(GNOSIS_API_KEYS=KEY, GNOSIS_KV_BLOCK_SIZE=str(BLOCK),
                            GNOSIS_KV_EVENTS_ENDPOINT=f"tcp://0.0.0.0:{zport}",
                            GNOSIS_KV_EVENTS_CURVE_SECRET_FILE=str(keys / "station.key_secret"),
                            GNOSIS_KV_EVENTS_CURVE_CLIENT_KEYS=str(keys / "relay.key"),
                            GNOSIS_STATE_DIR=str(tmp_path / f"state-{name}"))
            stack.enter_context(run_daemon(model_dir, tmp_path / f"run-{name}", port, env=env,
                                           log_path=tmp_path / f"daemon-{name}.log"))
            relay.relay(ctx, server_key, relay_pair, f"tcp://127.0.0.1:{zport}",
                        f"tcp://127.0.0.1:{local}")
            replicas.append((port, zport, local))
        rport = start_router(stack, model_dir, [(port, local) for port, _, local in replicas],
                             tmp_path / "router.log")
        plain = ctx.socket(zmq.SUB)  # no credentials, straight at replica A's endpoint
        stack.callback(plain.close, 0)
        plain.setsockopt(zmq.SUBSCRIBE, b"")
        plain.setsockopt(zmq.RCVTIMEO, 500)
        plain.connect(f"tcp://127.0.0.1:{replicas[0][1]}")
        time.sleep(1.0)  # the relays' and the router's subscriptions are in place

        def ask(port: int, text: str):
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY,
                            max_retries=0, timeout=60)
            return client.chat.completions.create(
                model=client.models.list().data[0].id, max_tokens=2, temperature=0,
                messages=[{"role": "user", "content": text}])

        prefix = ("Replica A keeps this long shared system preamble about routing tokens to "
                  "the cache that already holds them, repeated. " * 3)
        ask(replicas[0][0], prefix + "first question")
        time.sleep(0.5)  # the BlockStored batch reaches the router through the relay
        with pytest.raises(zmq.Again):
            plain.recv_multipart()
        before = [_chat_count(p) for p, _, _ in replicas]
        for i in range(3):
            resp = ask(rport, prefix + f"question number {i}")
            assert resp.usage.prompt_tokens_details.cached_tokens >= BLOCK, (
                (tmp_path / "router.log").read_text()[-3000:])
        served = [_chat_count(p) - b for (p, _, _), b in zip(replicas, before)]
        assert served == [3, 0], (served, (tmp_path / "router.log").read_text()[-3000:])
