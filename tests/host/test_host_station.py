"""The host child against a real station child: real HTTP, the official openai client.

Greedy output equals ``model.generate`` token for token: the returned text equals the
reference ids decoded with ``skip_special_tokens`` (the station's detokenizer never emits
special tokens, and a finished EOS is not text), and ``completion_tokens`` equals the
number of reference ids (EOS included when greedy produced it).
The station-kill test runs last: it restarts the station the module shares.
"""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from openai import NotFoundError, OpenAI
from transformers import AutoTokenizer

from tests.host.conftest import log_lines, spawn, station_call
from tests.support.procs import free_port, stop_process, wait_for
from tests.support.tiny_models import reference_generate

MAX_TOKENS = 24
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def reference(tiny_llama, tokenizer):
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                               tokenize=True)["input_ids"]
    ref_ids = reference_generate(tiny_llama, prompt_ids, MAX_TOKENS)
    return prompt_ids, ref_ids, tokenizer.decode(ref_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def client(stack):
    return OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(stack):
    return station_call(stack.socket, "hello")["model"]["id"]


def sse_events(lines) -> list:
    """Parse an SSE body: every event is one `data:` line followed by a blank line."""
    events, blank_expected = [], False
    for line in lines:
        if blank_expected:
            assert line == "", f"an event is not followed by a blank line: {line!r}"
            blank_expected = False
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
        blank_expected = True
    return events


def test_models_and_health_describe_the_station(stack, model_id):
    body = httpx.get(stack.base_url + "/v1/models").json()
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == \
        [(model_id, "model", "gnosis-daemon")]
    status, health = stack.health()
    assert status == 200 and health["status"] == "ok" and health["station_reachable"] is True
    assert health["station_pid"] == stack.station.pid and health["host_pid"] == stack.host.pid
    assert health["model"] == model_id and health["station_capabilities"]["generate"] is True
    # The module's host runs with THOTH_LIQUID_MEMORY=0 (the native path).
    assert (health["liquid_memory"], health["liquid_memory_env"]) == (False, False)
    assert health["liquid_memory_reason"].startswith("disabled by THOTH_LIQUID_MEMORY=0")


def test_chat_json_equals_model_generate(client, model_id, reference):
    prompt_ids, ref_ids, ref_text = reference
    resp = client.chat.completions.create(model=model_id, messages=MESSAGES,
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.model == model_id
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref_text
    assert resp.choices[0].finish_reason == ("stop" if len(ref_ids) < MAX_TOKENS else "length")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt_ids),
                                                                       len(ref_ids))
    assert resp.usage.total_tokens == len(prompt_ids) + len(ref_ids)


def test_raw_json_carries_gnosis_block_headers_and_request_id(stack, reference):
    prompt_ids, ref_ids, _ = reference
    r = httpx.post(stack.base_url + "/v1/chat/completions", headers={"X-Request-Id": "rid-json-1"},
                   json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "rid-json-1"
    assert r.headers["X-Thoth-Liquid-Memory"] == "disabled"
    assert r.headers["X-Thoth-Liquid-KV-Saved"] == "false"
    body = r.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(cached, int) and 0 <= cached <= len(prompt_ids)
    gnosis = body["_gnosis"]
    assert (gnosis["liquid_memory"], gnosis["liquid_kv_saved"], gnosis["path"]) == \
        ("disabled", False, "native")
    assert gnosis["liquid_miss_reason"].startswith("disabled by THOTH_LIQUID_MEMORY=0")
    assert (gnosis["prompt_tokens"], gnosis["completion_tokens"], gnosis["cached_tokens"]) == \
        (len(prompt_ids), len(ref_ids), cached)
    assert gnosis["ttft_ms"] > 0 and gnosis["tokens_per_second"] >= 0
    # The canonical line is written as the response completes: it may land just after the
    # client has the body, so wait for it (briefly) rather than read the log once.
    record = wait_for(lambda: request_line(stack, "rid-json-1"), 10, "the request's log line")
    assert record["status"] == 200 and record["outcome"] == "ok"
    assert record["completion_tokens"] == len(ref_ids)


def test_chat_stream_equals_model_generate_with_usage(client, model_id, reference):
    prompt_ids, ref_ids, ref_text = reference
    stream = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices
               and c.choices[0].finish_reason]
    assert reasons == ["stop" if len(ref_ids) < MAX_TOKENS else "length"]
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (len(prompt_ids), len(ref_ids))
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_sse_framing_on_the_wire(stack, reference):
    _, ref_ids, ref_text = reference
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["X-Thoth-Liquid-Memory"] == "disabled"
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    finish = events[-2]
    assert finish["choices"][0]["delta"] == {} and "usage" not in finish
    assert finish["_gnosis"]["completion_tokens"] == len(ref_ids)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == ref_text


def test_completions_prompt_and_token_ids(client, model_id, tiny_llama, tokenizer):
    prompt = "The quick brown fox"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ref_ids = reference_generate(tiny_llama, prompt_ids, MAX_TOKENS)
    ref_text = tokenizer.decode(ref_ids, skip_special_tokens=True)
    by_text = client.completions.create(model=model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0)
    assert by_text.object == "text_completion" and by_text.choices[0].text == ref_text
    assert by_text.usage.completion_tokens == len(ref_ids)
    by_ids = client.completions.create(model=model_id, prompt=prompt_ids,
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert by_ids.choices[0].text == ref_text
    assert by_ids.usage.prompt_tokens == len(prompt_ids)
    streamed = client.completions.create(model=model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_text
    assert chunks[-1].usage.completion_tokens == len(ref_ids)


def test_stop_string_cuts_the_text(client, model_id, reference):
    _, _, ref_text = reference
    assert len(ref_text) > 8
    stop = ref_text[5:7]
    expected = ref_text[:ref_text.index(stop)]
    resp = client.chat.completions.create(model=model_id, messages=MESSAGES, stop=[stop],
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == (expected, "stop")
    stream = client.chat.completions.create(model=model_id, messages=MESSAGES, stop=stop,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


@pytest.mark.parametrize("payload, status, error", [
    (b'{"messages": [', 400, {"message": "We could not parse the JSON body of your request. "
                              "The API expects a JSON object as the body (Content-Type: "
                              "application/json).", "type": "invalid_request_error",
                              "param": None, "code": None}),
    ({"messages": MESSAGES, "temperature": 9}, 400, {
        "message": "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, "
                   "but got 9 instead.", "type": "invalid_request_error",
        "param": "temperature", "code": "invalid_value"}),
    ({"messages": MESSAGES, "n": 17}, 400, {
        "message": "Invalid 'n': must be in [1, 16], but got 17.",
        "type": "invalid_request_error", "param": "n", "code": "invalid_value"}),
    ({"messages": [], "stream": True}, 400, {
        "message": "Invalid 'messages': empty array. Expected an array with minimum length 1, "
                   "but got an empty array instead.", "type": "invalid_request_error",
        "param": "messages", "code": "invalid_value"}),
    ({"messages": MESSAGES, "model": "gpt-4o"}, 404, {
        "message": "The model `gpt-4o` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}),
])
def test_bad_requests_get_exact_errors_and_the_host_keeps_serving(stack, reference, payload,
                                                                  status, error):
    kwargs = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    r = httpx.post(stack.base_url + "/v1/chat/completions",
                   headers={"Content-Type": "application/json"}, **kwargs)
    assert (r.status_code, r.json()) == (status, {"error": error})
    ok = httpx.post(stack.base_url + "/v1/chat/completions",
                    json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_unknown_model_through_the_openai_client(client):
    with pytest.raises(NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_context_overflow_is_400_before_any_streamed_byte(stack, model_id):
    max_len = station_call(stack.socket, "hello")["model"]["max_model_len"]
    for stream in (False, True):
        r = httpx.post(stack.base_url + "/v1/completions",
                       json={"prompt": [65] * (max_len + 1), "max_tokens": 1, "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == \
            ("invalid_request_error", "prompt", "context_length_exceeded")


# Greedy decoding from these token ids runs 400+ tokens without EOS on the seed-0 tiny
# llama, so a generation of them is still running when the tests below act on it.
LONG_PROMPT = [66, 67, 68]


def request_line(stack, request_id: str) -> dict | None:
    lines = [line for line in log_lines(stack.host_log)
             if line.get("event") == "request" and line.get("request_id") == request_id]
    assert len(lines) <= 1, lines
    return lines[0] if lines else None


def test_client_disconnect_mid_stream_cancels_in_the_station(stack):
    max_tokens = station_call(stack.socket, "hello")["model"]["max_model_len"] - 16
    with httpx.stream("POST", stack.base_url + "/v1/completions",
                      headers={"X-Request-Id": "rid-disconnect"},
                      json={"prompt": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        received = 0
        for line in r.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # leaving the block closes the connection mid-stream
    wait_for(lambda: station_call(stack.socket, "health")["running"] == 0, 30,
             "the station to have no running request")
    line = wait_for(lambda: request_line(stack, "rid-disconnect"), 10, "the request's log line")
    assert line["outcome"] == "client_disconnected" and line["status"] == 200
    assert 0 < line["completion_tokens"] < max_tokens


def test_sigterm_drains_an_in_flight_stream_then_exits_0(stack, tmp_path):
    port = free_port()
    host = spawn("host", stack.runtime_dir, tmp_path / "host2.log", "--port", str(port))
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, 30,
                 "second host /health 200", host)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                          json={"prompt": LONG_PROMPT, "max_tokens": 200, "temperature": 0,
                                "stream": True, "stream_options": {"include_usage": True}},
                          timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            host.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 200
        assert host.wait(timeout=30) == 0
    finally:
        stop_process(host)


def test_station_killed_is_503_then_the_same_host_serves_the_restarted_station(
        stack, client, model_id, reference):
    _, ref_ids, ref_text = reference
    old_pid = stack.station.pid
    with httpx.stream("POST", stack.base_url + "/v1/completions",
                      json={"prompt": LONG_PROMPT, "max_tokens": 3000, "temperature": 0,
                            "stream": True}) as r:
        lines = r.iter_lines()
        head = [next(lines), next(lines)]
        stack.station.kill()  # mid-stream: the headers (200) are gone, the error is an event
        stack.station.wait()
        events = sse_events([*head, *lines])
    assert "[DONE]" not in events
    assert events[-1] == {"error": {
        "message": "The model station is not available right now; retry shortly. (station "
                   "connection closed mid-request)",
        "type": "service_unavailable", "param": None, "code": "station_unavailable"}}
    wait_for(lambda: stack.health()[0] == 503, 30, "host /health 503")
    status, health = stack.health()
    assert health["station_reachable"] is False and health["host_pid"] == stack.host.pid
    for stream in (False, True):
        r = httpx.post(stack.base_url + "/v1/chat/completions",
                       json={"messages": MESSAGES, "max_tokens": 4, "stream": stream})
        assert (r.status_code, r.headers["Retry-After"]) == (503, "1")
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == \
            ("service_unavailable", None, "station_unavailable")
        assert error["message"].startswith("The model station is not available right now")
    stack.start_station()
    health = stack.wait_served()
    assert stack.host.poll() is None and health["host_pid"] == stack.host.pid
    assert health["station_pid"] == stack.station.pid != old_pid
    assert health["station_restarts"] == 1
    resp = client.chat.completions.create(model=model_id, messages=MESSAGES,
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.content == ref_text
    assert resp.usage.completion_tokens == len(ref_ids)
