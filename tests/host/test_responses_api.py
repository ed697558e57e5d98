"""``/v1/responses`` through the official ``openai`` client, on a real station and host: a
conversation whose state is the KV (each follow-up loads the previous response's session),
across a station SIGKILL; stored records and their deletion; another tenant's ids; store
false; the streamed event sequence; every field accepted and bad values refused by name."""

from __future__ import annotations

import openai
import pytest

from host.session_names import response_session
from tests.host import responses_support as rs
from tests.support.metrics import scrape, value

BS = 16  # the station's default KV block size
TURNS = ["What is the capital of France, in one word?", "And the capital of Spain?",
         "Which of the two is further north?"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama):
    s = rs.start(tmp_path_factory.mktemp("responses"), tiny_llama)
    yield s
    rs.stop(s)


def blocks(tokens: int) -> int:
    return tokens // BS * BS


def ask(client, text: str, previous: str | None = None, **kw):
    return client.responses.create(model="tiny", input=text, instructions=rs.INSTRUCTIONS,
                                   previous_response_id=previous, max_output_tokens=8,
                                   temperature=0, **kw)


def test_a_three_turn_chain_hits_the_previous_turns_kv_across_a_station_sigkill(stack):
    client = stack.client()
    tenant = stack.tenant_of(rs.KEY_A)
    first = ask(client, TURNS[0])
    assert first.model_extra["_gnosis"]["liquid_memory"] == "miss"
    assert first.output_text and first.status in ("completed", "incomplete")
    second = ask(client, TURNS[1], first.id)
    # The whole first conversation came from its session (in whole KV blocks; the prefix
    # cache may add a partial block's tokens past them).
    assert second.model_extra["_gnosis"]["liquid_memory"] == "hit"
    assert second.usage.input_tokens_details.cached_tokens >= blocks(first.usage.input_tokens)
    assert second.previous_response_id == first.id
    # Wait until the second turn's session is on disk, then kill the station.
    stack.wait_durable(response_session(tenant, second.id))
    stack.kill_station()
    third = ask(client, TURNS[2], second.id)
    gnosis = third.model_extra["_gnosis"]
    assert (gnosis["liquid_memory"], gnosis["tier"]) == ("hit", "disk")
    # Read back from disk: whole blocks only, every one of turn 2's prompt.
    assert third.usage.input_tokens_details.cached_tokens >= blocks(second.usage.input_tokens)
    # Turn 3's prompt is the rebuilt conversation: the instructions, turn 1 and 2 with their
    # answers, then the new input; its tokens are the chat rendering of exactly those.
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_get_returns_the_stored_response_and_delete_removes_record_and_session(stack):
    client = stack.client()
    tenant = stack.tenant_of(rs.KEY_A)
    before = {s["session_id"] for s in stack.sessions(tenant)}
    made = ask(client, "Say something short.", metadata={"topic": "test"})
    got = client.responses.retrieve(made.id)
    assert (got.id, got.output_text, got.metadata, got.usage.input_tokens) == (
        made.id, made.output_text, {"topic": "test"}, made.usage.input_tokens)
    # The response made one session, its own (the prompt's KV, then prompt + output).
    session = response_session(tenant, made.id)
    assert {s["session_id"] for s in stack.sessions(tenant)} - before == {session}
    assert any(made.id in p.name for p in stack.record_files())
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(made.id)
    assert info.value.body["code"] == "not_found"
    assert not any(made.id in p.name for p in stack.record_files())
    assert {s["session_id"] for s in stack.sessions(tenant)} == before
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)


def test_another_tenants_response_is_404_and_cannot_be_continued(stack):
    mine = ask(stack.client(rs.KEY_A), "A private question.")
    other = stack.client(rs.KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.BadRequestError) as info:
        ask(other, "Continue it.", mine.id)
    assert info.value.body["param"] == "previous_response_id"
    assert stack.client(rs.KEY_A).responses.retrieve(mine.id).id == mine.id  # still there


def test_store_false_leaves_no_record_and_no_session(stack):
    client = stack.client(rs.KEY_B)
    tenant = stack.tenant_of(rs.KEY_B)
    before_files, before = stack.record_files(), {s["session_id"] for s in stack.sessions(tenant)}
    made = ask(client, "Nothing of this may stay behind.", store=False)
    assert made.store is False and made.output_text
    assert made.model_extra["_gnosis"]["liquid_kv_saved"] is False
    assert stack.record_files() == before_files
    assert {s["session_id"] for s in stack.sessions(tenant)} == before
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


def test_streamed_events_follow_openais_sequence_and_match_the_whole_answer(stack):
    client = stack.client()
    whole = ask(client, "Count to three.", store=False)
    events = list(client.responses.create(model="tiny", input="Count to three.",
                                          instructions=rs.INSTRUCTIONS, max_output_tokens=8,
                                          temperature=0, store=False, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # The SDK's stream helper, which accumulates the events into the response. (Its
    # get_final_response needs response.completed: a tiny random model's answer is cut by
    # max_output_tokens, response.incomplete, so the last event is read instead.)
    with client.responses.stream(model="tiny", input="Count to three.",
                                 instructions=rs.INSTRUCTIONS, max_output_tokens=8,
                                 temperature=0) as stream:
        helped = list(stream)
    assert [e.type for e in helped if not e.type.endswith(".delta")] == [
        k for k in kinds if not k.endswith(".delta")]
    last = helped[-1].response
    assert last.output_text == whole.output_text and last.status == whole.status
    assert client.responses.retrieve(last.id).output_text == whole.output_text


def dialect_count(stack) -> float:
    text = stack.http("GET", "/metrics").text
    return value(scrape(text), "gnosis_requests_by_dialect_total", dialect="responses")


def test_every_field_is_accepted(stack):
    client = stack.client()
    counted = dialect_count(stack)
    made = client.responses.create(
        model="tiny", input=[{"role": "developer", "content": "Be brief."},
                             {"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": "Hi"}]}],
        instructions=rs.INSTRUCTIONS, store=True, max_output_tokens=4, temperature=0.5,
        top_p=0.9, prompt_cache_key="conv-1", prompt_cache_retention="in_memory",
        metadata={"a": "b"}, user="u-1", safety_identifier="s-1", service_tier="auto",
        background=False, include=[], parallel_tool_calls=True, tool_choice="auto", tools=[],
        truncation="disabled", text={"format": {"type": "text"}}, top_logprobs=0)
    assert (made.temperature, made.top_p, made.max_output_tokens, made.prompt_cache_key,
            made.user, made.metadata) == (0.5, 0.9, 4, "conv-1", "u-1", {"a": "b"})
    assert made.usage.output_tokens <= 4
    assert dialect_count(stack) == counted + 1  # counted as the responses dialect


BAD = [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "input[0].type"),
    ({"prompt_cache_retention": "1w"}, "prompt_cache_retention"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"store": "yes"}, "store"),
    ({"metadata": {"a": 1}}, "metadata"),
    ({"previous_response_id": "resp_" + "0" * 48}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"model": "not-this-one"}, "model"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_values_are_400_naming_the_field(stack, fields, param):
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, **fields}
    if body["input"] is None:
        del body["input"]
    response = stack.http("POST", "/v1/responses", json=body)
    expected = 404 if param == "model" else 400
    assert response.status_code == expected, response.text
    assert response.json()["error"]["param"] == param
