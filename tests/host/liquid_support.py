"""Helpers shared by the liquid-memory tests (real station and host children)."""

from __future__ import annotations

import json
import subprocess

import httpx

from tests.support.metrics import scrape, value
from tests.support.procs import http_json, wait_for

START_TIMEOUT_S = 90.0
# The liquid hosts run with API keys, so tenants come from keys; a request that names none
# uses DEFAULT_KEY. The other keys are the tenants the tests compare.
DEFAULT_KEY = "liquid-default"
API_KEYS = (DEFAULT_KEY, "k1", "tenant-a", "tenant-b", "key-a", "key-b")
HOST_ENV = {"GNOSIS_API_KEYS": ",".join(API_KEYS)}


def wait_health(base_url: str, proc: subprocess.Popen, station_pid: int, **want) -> dict:
    """/health of ``base_url`` once it serves ``station_pid`` (and shows every ``want``)."""

    def ready():
        status, body = http_json(base_url + "/health", timeout=5)
        if status != 200 or body.get("station_pid") != station_pid:
            return None
        return body if all(body.get(k) == v for k, v in want.items()) else None

    return wait_for(ready, START_TIMEOUT_S, f"{base_url} /health {want}", proc)


def post(base_url: str, path: str, body: dict, api_key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api_key or DEFAULT_KEY}"}
    return httpx.post(base_url + path, json=body, headers=headers, timeout=60)


def stream_chat(base_url: str, body: dict, api_key: str | None = None,
                ) -> tuple[httpx.Headers, list]:
    """A streamed chat completion: the response headers (read before any body byte) and
    the decoded SSE events."""
    headers = {"Authorization": f"Bearer {api_key or DEFAULT_KEY}"}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json={**body, "stream": True},
                      headers=headers, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        head = resp.headers
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return head, events


def metric(base_url: str, outcome: str) -> int:
    samples = scrape(httpx.get(base_url + "/metrics", timeout=5).text)
    return int(value(samples, "gnosis_liquid_memory_total", outcome=outcome))
