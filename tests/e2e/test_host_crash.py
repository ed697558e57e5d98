"""A host SIGKILLed under 8 streaming requests.

Every client gets a clean error (its stream ends early; nothing hangs), the supervisor has
the host back, and the station's KV sessions survived: the next request is a liquid hit.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import httpx

from tests.support.metrics import scrape, value
from tests.support.procs import child_env, free_port, http_json, run_daemon, wait_for
from tests.support.tiny_models import build_tiny_model

PROMPT = [{"role": "system", "content": "You keep the lighthouse log. " * 8},
          {"role": "user", "content": "What happened tonight?"}]


def _stream_until_killed(base: str, i: int, started: threading.Barrier) -> str:
    body = {"messages": [{"role": "user", "content": f"stream {i}: tell a long story"}],
            "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            next(lines)  # the first chunk arrived: the request is in flight
            started.wait(timeout=60)
            for line in lines:
                if line == "data: [DONE]":
                    return "completed"
    except httpx.HTTPError as exc:  # connection cut mid-body: the clean error a client sees
        return f"error:{type(exc).__name__}"
    return "ended-without-done"


def test_host_sigkill_under_streaming_load_keeps_sessions(tmp_path):
    model_dir = build_tiny_model(tmp_path / "llama", "llama")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = child_env(GNOSIS_KV_BLOCK_SIZE="8", GNOSIS_BACKOFF_INITIAL_S="0.1")
    with run_daemon(model_dir, tmp_path / "run", port, log_path=tmp_path / "daemon.log", env=env):
        with httpx.Client(base_url=base, timeout=60) as http:
            first = http.post("/v1/chat/completions",
                              json={"messages": PROMPT, "max_tokens": 8, "temperature": 0}).json()
            assert first["_gnosis"]["liquid_memory"] == "miss"
            assert first["_gnosis"]["liquid_kv_saved"] is True
        old_pid = http_json(f"{base}/health")[1]["host_pid"]

        started = threading.Barrier(9)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_stream_until_killed, base, i, started) for i in range(8)]
            started.wait(timeout=60)  # all 8 streams are mid-body
            os.kill(old_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            outcomes = [f.result(timeout=60) for f in futures]
        assert all(o.startswith("error:") or o == "ended-without-done" for o in outcomes), outcomes

        health = wait_for(lambda: (h := http_json(f"{base}/health", timeout=2))[0] == 200
                          and h[1]["host_pid"] != old_pid and h[1], 60, "a new host")
        print(f"host back after {time.monotonic() - killed_at:.2f} s")
        assert health["liquid_memory"] is True
        # The new host reports its supervisor's count of child restarts.
        restarts = wait_for(lambda: (s := scrape(httpx.get(f"{base}/metrics", timeout=5).text))
                            .get(("gnosis_child_restarts_total", (("child", "host"),))) == 1
                            and s, 30, "one host restart in /metrics")
        assert value(restarts, "gnosis_child_restarts_total", child="station") == 0

        with httpx.Client(base_url=base, timeout=60) as http:
            again = http.post("/v1/chat/completions",
                              json={"messages": PROMPT, "max_tokens": 8, "temperature": 0}).json()
        assert again["_gnosis"]["liquid_memory"] == "hit"
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            again["usage"]["prompt_tokens"] - 8
