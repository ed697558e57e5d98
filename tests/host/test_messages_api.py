"""``POST /v1/messages`` through the official ``anthropic`` client against a real station and
host (a tiny random model, liquid memory on, API keys): text, system, multi-turn, the
streamed event order, tools out and results in, stop sequences, max_tokens, the errors'
Anthropic shapes naming their fields, x-api-key auth; and parity with the chat path."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.host.conftest import spawn
from tests.host.liquid_support import wait_health
from tests.support.procs import free_port, stop_process

KEY, OTHER = "msg-key-a", "msg-key-b"
MAX_TOKENS = 8
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("messages")
    run = root / "run"
    station = spawn("station", run, root / "station.log", "--model", str(tiny_llama))
    port = free_port()
    proc = spawn("host", run, root / "host.log", "--port", str(port),
                 env={"GNOSIS_API_KEYS": f"{KEY},{OTHER}"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, station.pid, liquid_memory=True)
        yield url
    finally:
        stop_process(proc)
        stop_process(station)


@pytest.fixture(scope="module")
def client(host) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=KEY, base_url=host, max_retries=0)


@pytest.fixture(scope="module")
def model(host) -> str:
    return httpx.get(host + "/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]


# This client has no temperature argument any more; the API still takes it (greedy here).
GREEDY = {"temperature": 0}


def ask(client, model, **kw):
    return client.messages.create(model=model, max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                                  extra_body=GREEDY, **kw)


def chat(host, model, messages, **kw):
    resp = httpx.post(host + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": model, "messages": messages, "max_tokens": MAX_TOKENS,
                            "temperature": 0, **kw}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_text_message_is_anthropics_message_and_the_chat_paths_answer(client, model, host):
    msg = ask(client, model, messages=[{"role": "user", "content": "Name a colour."}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model
    assert msg.id.startswith("msg_") and msg.stop_reason == "max_tokens"
    assert msg.stop_sequence is None and [b.type for b in msg.content] == ["text"]
    same = chat(host, model, [{"role": "user", "content": "Name a colour."}])
    assert msg.content[0].text == same["choices"][0]["message"]["content"]
    # The same prompt in the other dialect, same tenant: the session the message saved.
    assert same["_gnosis"]["liquid_memory"] == "hit"
    # Every prompt token: the first token comes from the logits the message's prefill kept.
    assert same["_gnosis"]["cached_tokens"] == same["usage"]["prompt_tokens"]
    assert msg.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == MAX_TOKENS
    assert msg.usage.cache_creation_input_tokens == 0 and msg.usage.cache_read_input_tokens == 0
    raw = msg.model_dump()
    assert raw["usage"]["cache_creation"] == {"ephemeral_5m_input_tokens": 0,
                                              "ephemeral_1h_input_tokens": 0}
    assert raw["_gnosis"]["liquid_memory"] in ("hit", "miss")
    assert raw["_gnosis"]["cache_pins"] == []


def test_system_blocks_and_turns_are_the_chat_paths_messages(client, model, host):
    turns = [{"role": "user", "content": "Hello there."},
             {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
             {"role": "user", "content": [{"type": "text", "text": "One more "},
                                          {"type": "text", "text": "word?"}]}]
    msg = ask(client, model, system=[{"type": "text", "text": "Be terse. "},
                                     {"type": "text", "text": "Be kind."}], messages=turns)
    same = chat(host, model, [{"role": "system", "content": "Be terse. Be kind."},
                              {"role": "user", "content": "Hello there."},
                              {"role": "assistant", "content": "Hi."},
                              {"role": "user", "content": "One more word?"}])
    assert msg.content[0].text == same["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens == same["usage"]["prompt_tokens"]
    plain = ask(client, model, system="Be terse. Be kind.", messages=turns)
    assert plain.content[0].text == msg.content[0].text


def test_the_stream_is_anthropics_event_sequence(client, model, host):
    with client.messages.stream(model=model, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Count to three."}]) as s:
        kinds = [e.type for e in s if e.type in (
            "message_start", "content_block_start", "content_block_delta",
            "content_block_stop", "message_delta", "message_stop")]
        final = s.get_final_message()
    whole = ask(client, model, messages=[{"role": "user", "content": "Count to three."}])
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == MAX_TOKENS
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    created = [e.type for e in client.messages.create(
        model=model, max_tokens=MAX_TOKENS, extra_body=GREEDY, stream=True,
        messages=[{"role": "user", "content": "Count to three."}])]
    assert created == kinds  # the client drops ping events
    # On the wire: each event's type on its event line, the same as its data's type.
    with httpx.stream("POST", host + "/v1/messages", headers={"x-api-key": KEY}, json={
            "model": model, "max_tokens": MAX_TOKENS, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": "Count to three."}]}, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    wire = [line.removeprefix("event: ") for line in lines[::2]]
    assert wire == kinds[:2] + ["ping"] + kinds[2:]
    assert [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]] == wire


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(client, model):
    msg = ask(client, model, max_tokens=240, tools=TOOLS,
              tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert msg.stop_reason == "tool_use"
    use = [b for b in msg.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    assert use[0].input["city"] in ("Paris", "Oslo")
    with client.messages.stream(model=model, max_tokens=240, extra_body=GREEDY, tools=TOOLS,
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(use[0].name, use[0].input)]
    follow = ask(client, model, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                      "content": "sunny"}]}])
    assert follow.type == "message" and follow.usage.input_tokens > msg.usage.input_tokens


def test_a_stop_sequence_is_named_when_it_ends_the_answer(client, model):
    free = ask(client, model, max_tokens=16, messages=[{"role": "user", "content": "Go on."}])
    text = free.content[0].text
    # A character the answer holds past its first: the answer up to it is not empty.
    cut = next(c for c in text if c.strip() and text.index(c) >= 1)
    stop = ask(client, model, max_tokens=16, stop_sequences=[cut],
               messages=[{"role": "user", "content": "Go on."}])
    assert stop.stop_reason == "stop_sequence" and stop.stop_sequence == cut
    assert stop.content[0].text == text[:text.index(cut)]
    with client.messages.stream(model=model, max_tokens=16, extra_body=GREEDY, stop_sequences=[cut],
                                messages=[{"role": "user", "content": "Go on."}]) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", cut)


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
     "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
     "frobnicate"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "long " * 40000}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": "t", "input_schema": {"type": "object"}}], "tool_choice": {"type": "maybe"}},
     "tool_choice.type"),
    ({"max_tokens": 5, "system": [{"type": "text", "text": "a", "cache_control": {
        "type": "ephemeral", "ttl": "5m"}}, {"type": "text", "text": "b", "cache_control": {
            "type": "ephemeral", "ttl": "1h"}}], "messages": [{"role": "user", "content": "hi"}]},
     "system.1.cache_control"),
    ({"max_tokens": 5, "system": [{"type": "text", "text": str(i), "cache_control": {
        "type": "ephemeral"}} for i in range(5)], "messages": [{"role": "user", "content": "hi"}]},
     "system.4.cache_control"),
])
def test_a_bad_request_is_anthropics_400_naming_the_field(host, model, body, field):
    resp = httpx.post(host + "/v1/messages", headers={"x-api-key": KEY,
                                                      "anthropic-version": "2023-06-01"},
                      json={"model": model, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(f"{field}: ")
    assert error["request_id"] == resp.headers["request-id"] == resp.headers["x-request-id"]


def test_the_client_raises_the_class_of_each_status(host, model):
    bad_key = anthropic.Anthropic(api_key="nope", base_url=host, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        ask(bad_key, model, messages=[{"role": "user", "content": "hi"}])
    assert auth.value.body["error"] == {"type": "authentication_error",
                                        "message": "invalid x-api-key"}
    no_key = httpx.post(host + "/v1/messages", json={}, timeout=10)
    assert no_key.status_code == 401
    assert no_key.json()["error"]["message"] == "x-api-key header is required"
    client = anthropic.Anthropic(api_key=KEY, base_url=host, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        ask(client, "no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        ask(client, model, messages=[{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "Sure"}])
    assert bad.value.body["error"]["message"].startswith("messages.1: ")
    bearer = httpx.post(host + "/v1/messages", headers={"Authorization": f"Bearer {OTHER}"},
                        json={"model": model, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"


def test_an_answer_carries_the_liquid_headers_and_gnosis_block(host, model):
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Headers, please."}]}
    first = httpx.post(host + "/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=30)
    again = httpx.post(host + "/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=30)
    assert first.headers["x-thoth-liquid-kv-saved"] == "true"
    assert again.headers["x-thoth-liquid-memory"] == "hit"
    assert again.json()["_gnosis"]["liquid_memory"] == "hit"
    assert again.json()["content"] == first.json()["content"]
    assert json.loads(again.text)["_gnosis"]["cached_tokens"] > 0


def test_count_tokens_is_the_prompt_a_message_prefills(client, model):
    turns = [{"role": "user", "content": "How many tokens is this?"}]
    counted = client.messages.count_tokens(model=model, system="Be brief.", messages=turns,
                                           tools=TOOLS)
    asked = ask(client, model, system="Be brief.", messages=turns, tools=TOOLS)
    assert counted.input_tokens == asked.usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.count_tokens(model=model, messages=turns, extra_body={"max_tokens": 4})
    assert bad.value.body["error"]["message"].startswith("max_tokens: ")
