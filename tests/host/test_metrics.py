"""/metrics, parsed with prometheus-client's own parser.

The units build records by hand (every time in them is given, none is measured). The rest
runs a real host against a real station (the module's ``stack``, native path) with the
official openai client, and checks exact counts and sums after known requests. A request is
observed when its task ends, which may be just after its client has the answer: each check
first waits for the request count it expects.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from openai import OpenAI
from prometheus_client import CONTENT_TYPE_LATEST

from host.metrics import Metrics, RequestRecord, token_buckets
from host.scrape_metrics import ScrapeCollector, supervisor_restarts
from tests.support.metrics import scrape, value
from tests.support.procs import stop_process, wait_for

N = 7  # completion tokens of every request (ignore_eos)
MESSAGES = [{"role": "system", "content": "You are terse and precise. " * 6},
            {"role": "user", "content": "Name three colours."}]
VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
              "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count")
STATION_DERIVED = ("gnosis_requests_running", "gnosis_requests_waiting",
                   "gnosis_kv_cache_usage_ratio", "gnosis_kv_tier_sessions",
                   "vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc")


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


# -- units


def test_token_buckets_are_1_2_5_up_to_the_context():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(8192)[-1] == 5000


def test_a_record_is_observed_in_both_name_sets():
    metrics = Metrics(max_model_len=64)
    record = RequestRecord("r1", "POST", "/v1/chat/completions", route="/v1/chat/completions",
                           started=10.0, status=200, model="m", prompt_tokens=12,
                           completion_tokens=3, cached_tokens=8, liquid_memory="hit",
                           liquid_tier="disk", admitted=10.25, prefill_at=11.0,
                           first_token_at=11.5, token_gaps=[0.125, 0.25], finished_at=12.0,
                           finish_reason="length")
    metrics.observe(record)
    s = scrape(metrics.render().decode())
    assert value(s, "gnosis_http_requests_total", path="/v1/chat/completions", status="200") == 1
    assert value(s, "gnosis_liquid_memory_total", outcome="hit") == 1
    assert value(s, "gnosis_liquid_hits_total", tier="disk") == 1
    for gnosis, vllm, count, total in [
            ("gnosis_time_to_first_token_seconds", "vllm:time_to_first_token_seconds", 1, 1.5),
            ("gnosis_inter_token_latency_seconds", "vllm:inter_token_latency_seconds", 2, 0.375),
            ("gnosis_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds", 1, 2.0),
            ("gnosis_request_prompt_tokens", "vllm:request_prompt_tokens", 1, 12),
            ("gnosis_request_completion_tokens", "vllm:request_generation_tokens", 1, 3)]:
        gnosis_labels = {"liquid_memory": "hit"} if "first_token" in gnosis else {}
        assert value(s, gnosis + "_count", **gnosis_labels) == count
        assert value(s, gnosis + "_sum", **gnosis_labels) == total
        assert (value(s, vllm + "_count", model_name="m"),
                value(s, vllm + "_sum", model_name="m")) == (count, total)
    assert value(s, "gnosis_time_to_first_token_seconds_count", liquid_memory="miss") == 0
    assert (value(s, "gnosis_request_queue_time_seconds_count"),
            value(s, "gnosis_request_queue_time_seconds_sum")) == (1, 0.75)
    assert value(s, "gnosis_inter_token_latency_seconds_bucket", le="0.3") == 2
    assert value(s, "gnosis_inter_token_latency_seconds_bucket", le="0.15") == 1
    for name, expected in [("prefix_cache_queries_total", 12), ("prefix_cache_hits_total", 8)]:
        assert value(s, "gnosis_" + name) == value(s, "vllm:" + name, model_name="m") == expected
    assert value(s, "vllm:request_success_total", model_name="m", finished_reason="length") == 1
    assert value(s, "vllm:generation_tokens_total", model_name="m") == 3


def test_requests_are_counted_by_dialect_and_pins_by_ttl_and_outcome():
    metrics = Metrics(max_model_len=64)
    for route, method in [("/v1/messages", "POST"), ("/v1/messages", "POST"),
                          ("/v1/chat/completions", "POST"), ("/v1/models", "GET")]:
        metrics.observe(RequestRecord("r", method, route, route=route, status=200))
    metrics.observe(RequestRecord("r", "POST", "/v1/messages", route="/v1/messages",
                                  status=200, pins=[("5m", "created"), ("1h", "read"),
                                                    ("1h", "read"), ("5m", "nonsense")]))
    s = scrape(metrics.render().decode())
    assert {d: value(s, "gnosis_requests_by_dialect_total", dialect=d)
            for d in ("chat", "completions", "messages", "responses")} == \
        {"chat": 1, "completions": 0, "messages": 3, "responses": 0}
    assert value(s, "gnosis_cache_pins_total", ttl="5m", outcome="created") == 1
    assert value(s, "gnosis_cache_pins_total", ttl="1h", outcome="read") == 2
    assert value(s, "gnosis_cache_pins_total", ttl="24h", outcome="downgraded") == 0
    assert sum(v for (name, _), v in s.items() if name == "gnosis_cache_pins_total") == 3


def test_a_request_without_a_completion_touches_no_histogram():
    metrics = Metrics(max_model_len=64)
    metrics.observe(RequestRecord("r2", "GET", "/nowhere", status=404))
    s = scrape(metrics.render().decode())
    assert value(s, "gnosis_http_requests_total", path="unmatched", status="404") == 1
    assert value(s, "gnosis_e2e_request_latency_seconds_count") == 0
    assert not any(name.startswith("vllm:") for name in names(s))


def test_station_figures_come_from_stats_and_are_absent_without_it():
    stats = {"running": 2, "waiting": 5, "blocks_total": 200, "blocks_free": 150,
             "kv_sessions": 3, "kv_disk_sessions": 4, "read_back_done": 6, "kv_io_cpu_s": 1.25}
    s = scrape(Metrics(64).render(ScrapeCollector({"station_up": 1.0}, stats, "m")).decode())
    assert (value(s, "gnosis_requests_running"), value(s, "gnosis_requests_waiting")) == (2, 5)
    assert (value(s, "vllm:num_requests_running", model_name="m"),
            value(s, "vllm:num_requests_waiting", model_name="m")) == (2, 5)
    assert value(s, "gnosis_kv_cache_usage_ratio") == 0.25
    assert value(s, "vllm:kv_cache_usage_perc", model_name="m") == 0.25
    assert value(s, "gnosis_kv_tier_sessions", tier="pool") == 3
    assert value(s, "gnosis_kv_tier_sessions", tier="disk") == 4
    assert value(s, "gnosis_kv_tier_loads_total", tier="disk") == 6
    assert value(s, "gnosis_kv_tier_io_cpu_seconds_total", tier="disk") == 1.25
    assert value(s, "gnosis_station_up") == 1
    # A stats answer without a figure leaves that figure out; no answer leaves them all out.
    s = scrape(Metrics(64).render(ScrapeCollector({}, {"running": 1}, "m")).decode())
    assert "gnosis_kv_cache_usage_ratio" not in names(s) and "gnosis_requests_waiting" not in names(s)
    s = scrape(Metrics(64).render(ScrapeCollector({"station_up": 0.0}, None, "m")).decode())
    assert not names(s) & set(STATION_DERIVED)


def test_child_restarts_come_from_this_hosts_supervisor_only(tmp_path):
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"supervisor": {"pid": 4242}, "children": {
        "station": {"restarts": 2}, "host": {"restarts": 1}}}))
    assert supervisor_restarts(status, parent_pid=4242) == {"station": 2, "host": 1}
    assert supervisor_restarts(status, parent_pid=os.getpid()) is None  # another supervisor
    assert supervisor_restarts(tmp_path / "missing.json", parent_pid=4242) is None
    status.write_text("{not json")
    assert supervisor_restarts(status, parent_pid=4242) is None
    s = scrape(Metrics(64).render(ScrapeCollector({}, None, None, {"station": 2, "host": 1}))
               .decode())
    assert value(s, "gnosis_child_restarts_total", child="station") == 2
    assert value(s, "gnosis_child_restarts_total", child="host") == 1


# -- a real host and station


@pytest.fixture(scope="module")
def client(stack):
    return OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def metrics(stack) -> dict:
    response = httpx.get(stack.base_url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST
    return scrape(response.text)


def completions_seen(stack, count: int) -> dict:
    """The scrape once ``count`` completions have been observed."""
    return wait_for(lambda: (s := metrics(stack))[("gnosis_request_completion_tokens_count", ())]
                    == count and s, 10, f"{count} completions in /metrics")


def test_a_fresh_host_shows_every_name_at_zero(stack, model_id):
    s = metrics(stack)
    for name in VLLM_NAMES:
        assert (name, (("model_name", model_id),)) in s, name
    assert value(s, "vllm:prefix_cache_queries_total", model_name=model_id) == 0
    assert value(s, "vllm:time_to_first_token_seconds_count", model_name=model_id) == 0
    assert value(s, "vllm:num_requests_running", model_name=model_id) == 0
    assert 0 <= value(s, "vllm:kv_cache_usage_perc", model_name=model_id) <= 1
    assert value(s, "gnosis_station_up") == 1
    assert value(s, "gnosis_kv_tier_sessions", tier="pool") == 0
    assert {dict(labels)["model_name"] for name, labels in s if name.startswith("vllm:")} == \
        {model_id}


def test_json_then_stream_give_exact_counts_and_sums(stack, client, model_id):
    first = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=N,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert first.usage.completion_tokens == N
    s = completions_seen(stack, 1)
    prompt = first.usage.prompt_tokens
    for name, labels in [("gnosis_request_completion_tokens", {}),
                         ("vllm:request_generation_tokens", {"model_name": model_id})]:
        assert (value(s, name + "_count", **labels), value(s, name + "_sum", **labels)) == (1, N)
    assert (value(s, "gnosis_request_prompt_tokens_count"),
            value(s, "gnosis_request_prompt_tokens_sum")) == (1, prompt)
    assert value(s, "gnosis_time_to_first_token_seconds_count", liquid_memory="disabled") == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert value(s, f"vllm:{name}_count", model_name=model_id) == 1
    assert value(s, "gnosis_request_queue_time_seconds_count") == 1
    assert value(s, "vllm:inter_token_latency_seconds_count", model_name=model_id) == N - 1
    assert value(s, "gnosis_inter_token_latency_seconds_count") == N - 1
    assert value(s, "vllm:request_success_total", model_name=model_id,
                 finished_reason="length") == 1

    stream = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = list(stream)[-1].usage
    assert usage.completion_tokens == N and usage.prompt_tokens == prompt
    cached = first.usage.prompt_tokens_details.cached_tokens + \
        usage.prompt_tokens_details.cached_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a cache hit
    s = completions_seen(stack, 2)
    assert value(s, "gnosis_request_completion_tokens_sum") == 2 * N
    assert value(s, "vllm:time_to_first_token_seconds_count", model_name=model_id) == 2
    assert value(s, "vllm:inter_token_latency_seconds_count", model_name=model_id) == 2 * (N - 1)
    assert value(s, "vllm:e2e_request_latency_seconds_count", model_name=model_id) == 2
    for name, expected in [("prefix_cache_queries_total", 2 * prompt),
                           ("prefix_cache_hits_total", cached)]:
        assert value(s, "vllm:" + name, model_name=model_id) == expected
        assert value(s, "gnosis_" + name) == expected
    assert value(s, "vllm:prompt_tokens_total", model_name=model_id) == 2 * prompt
    assert value(s, "gnosis_completion_tokens_total") == 2 * N
    assert value(s, "gnosis_http_requests_total", path="/v1/chat/completions", status="200") == 2
    # Both requests are over: the station runs and queues nothing.
    s = wait_for(lambda: (s := metrics(stack))[("vllm:num_requests_running",
                                                 (("model_name", model_id),))] == 0 and s,
                 10, "nothing running")
    assert value(s, "vllm:num_requests_waiting", model_name=model_id) == 0


def test_a_client_chosen_model_name_never_becomes_a_label(stack, client, model_id):
    before = metrics(stack)
    r = httpx.post(stack.base_url + "/v1/chat/completions", timeout=30,
                   json={"model": "someone-else", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 404
    wait_for(lambda: value(metrics(stack), "gnosis_http_requests_total",
                           path="/v1/chat/completions", status="404") == 1, 10, "the 404 counted")
    after = metrics(stack)
    assert {labels for _, labels in after} - {labels for _, labels in before} == \
        {(("path", "/v1/chat/completions"), ("status", "404"))}


def test_station_figures_are_absent_while_the_station_is_down(stack, model_id):
    # Last in this module: it stops the module's station.
    stop_process(stack.station)
    s = wait_for(lambda: (s := metrics(stack))[("gnosis_station_up", ())] == 0 and s, 30,
                 "station_up 0")
    assert not names(s) & set(STATION_DERIVED)
    # What the host counted itself is still there.
    assert value(s, "vllm:time_to_first_token_seconds_count", model_name=model_id) == 2
