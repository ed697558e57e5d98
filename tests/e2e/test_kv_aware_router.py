"""Token-aware routing end to end: vllm-router's ``kv_aware`` policy sends a request that names no
session to the replica holding its prefix, learned only from the daemons' KV events.

Two whole daemons (each its own port, runtime dir, state dir and ZMQ endpoint on loopback)
on one tiny model, and ``vllm-router --policy kv_aware`` with a static event source per
daemon. The router asks a daemon's ``/v1/chat/completions/render`` for the request's token
ids, hashes them per block itself, and scores each replica by the blocks its events said it
holds. A prompt warmed on A directly (not through the router) must land on A through the
router every time, with other suffixes; the control: a prompt warmed on B lands on B.
Which replica served is read from each daemon's /metrics (its chat requests).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support.metrics import scrape, value
from tests.support.procs import child_env, free_port, run_daemon, stop_process, wait_for
from tests.support.tiny_models import build_tiny_model

BLOCK = 16
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
pytestmark = pytest.mark.skipif(not Path(ROUTER).exists(), reason="vllm-router is not installed")


def _chat_count(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        samples = scrape(r.read().decode())
    try:
        return value(samples, "gnosis_http_requests_total", path="/v1/chat/completions",
                     status="200")
    except (KeyError, AssertionError, StopIteration):
        return 0.0


def start_router(stack: ExitStack, model_dir: Path, workers: list[tuple[int, int]],
                 log_path: Path) -> int:
    """vllm-router in kv_aware mode over ``workers`` ((HTTP port, KV events port) each), on
    loopback, stopped with ``stack``; -> its port once its /health answers."""
    rport = free_port()
    argv = [ROUTER, "--policy", "kv_aware", "--host", "127.0.0.1", "--port", str(rport),
            "--worker-urls", *[f"http://127.0.0.1:{p}" for p, _ in workers],
            "--kv-event-block-size", str(BLOCK), "--kv-event-model", str(model_dir),
            "--log-level", "debug"]
    for port, zport in workers:
        argv += ["--kv-event-source", f"http://127.0.0.1:{port}=tcp://127.0.0.1:{zport}"]
    with open(log_path, "ab") as log:
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stack.callback(stop_process, router)
    wait_for(lambda: _router_ready(rport), 60, "vllm-router /health", router)
    return rport


def _router_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvaware")
    model_dir = build_tiny_model(root / "tiny", "llama")
    with ExitStack() as stack:
        replicas = []
        for name in ("a", "b"):
            port, zport = free_port(), free_port()
            env = child_env(GNOSIS_KV_EVENTS_ENDPOINT=f"tcp://127.0.0.1:{zport}",
                            GNOSIS_STATE_DIR=str(root / f"state-{name}"),
                            GNOSIS_KV_BLOCK_SIZE=str(BLOCK))
            stack.enter_context(run_daemon(model_dir, root / f"run-{name}", port, env=env,
                                           log_path=root / f"daemon-{name}.log"))
            replicas.append((port, zport))
        rport = start_router(stack, model_dir, replicas, root / "router.log")
        time.sleep(1.0)  # the router's SUB sockets connect to both publishers
        yield replicas, rport, root


def _client(port: int) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                  timeout=60)


def _ask(client: OpenAI, text: str):
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": text}],
                                          max_tokens=2, temperature=0)


@pytest.mark.parametrize("warm_on", [0, 1], ids=["warmed-on-A", "control-warmed-on-B"])
def test_kv_aware_routes_to_the_replica_holding_the_prefix(fleet, warm_on):
    replicas, rport, root = fleet
    prefix = (f"Replica {warm_on} keeps this long shared system preamble about routing "
              "tokens to the cache that already holds them, repeated. " * 3)
    _ask(_client(replicas[warm_on][0]), prefix + "first question")
    time.sleep(0.5)  # the BlockStored batch reaches the router
    before = [_chat_count(p) for p, _ in replicas]
    router = _client(rport)
    for i in range(4):
        resp = _ask(router, prefix + f"question number {i}")
        assert resp.usage.prompt_tokens_details.cached_tokens >= BLOCK, (
            i, (root / "router.log").read_text()[-3000:])
    after = [_chat_count(p) for p, _ in replicas]
    served = [a - b for a, b in zip(after, before)]
    assert served[warm_on] == 4 and served[1 - warm_on] == 0, (served,
                                                               (root / "router.log").read_text()[-3000:])


def _post(port: int, path: str, body: dict) -> dict:
    import json
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_tokenize_render_and_sources_use_the_station_tokenizer(fleet):
    from transformers import AutoTokenizer

    replicas, _, root = fleet
    port, zport = replicas[0]
    tok = AutoTokenizer.from_pretrained(root / "tiny")
    messages = [{"role": "user", "content": "Tokens <|im_end|> as text, please."}]
    expected = tok.apply_chat_template([{"role": "user", "content": "Tokens x"}],
                                       add_generation_prompt=True, tokenize=True)["input_ids"]
    plain = [{"role": "user", "content": "Tokens x"}]
    out = _post(port, "/tokenize", {"messages": plain})
    assert out == {"count": len(expected), "max_model_len": out["max_model_len"],
                   "tokens": expected, "token_strs": None} and out["max_model_len"] > 0
    assert _post(port, "/v1/chat/completions/render", {"messages": plain})["token_ids"] == expected
    text = _post(port, "/tokenize", {"prompt": "hello"})["tokens"]
    assert text == tok.encode("hello") and _post(port, "/detokenize", {"tokens": text}) == {
        "prompt": "hello"}
    # special-token text in a content stays text, exactly as a completion's prefill reads it
    rendered = _post(port, "/v1/chat/completions/render", {"messages": messages})["token_ids"]
    assert rendered.count(tok.convert_tokens_to_ids("<|im_end|>")) == 1  # the template's own
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/kv_event_sources", timeout=5) as r:
        import json
        assert json.loads(r.read()) == [{"data_parallel_rank": 0,
                                         "endpoint": f"tcp://127.0.0.1:{zport}",
                                         "replay_endpoint": None, "topic": ""}]
