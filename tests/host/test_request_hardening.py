"""Every bad value is a 400 naming the field; every field that would change the answer and
is not implemented is refused; unknown fields are refused the way OpenAI refuses them.

Pure parsing plus the app through Quart's ASGI test client (no station: each of these is
answered before the station is needed). The same values through a real station are in
``test_overload.py``, where the old code answered them 500.
"""

from __future__ import annotations

import json

import pytest

from gnosis_daemon.settings import Settings
from host import embeddings, json_body
from host.app import create_app
from host.errors import ApiError
from host.openai_api import parse_chat, parse_completion
from host.station_link import StationLink

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(tmp_path):
    settings = Settings(runtime_dir=str(tmp_path), max_request_bytes=4096)
    link = StationLink(settings.station_socket, max_frame_bytes=settings.max_frame_bytes)
    return create_app(settings, link).test_client()


async def post(client, path, raw: bytes):
    response = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    return response.status_code, json.loads(await response.get_data())


def refused(parse, body) -> dict:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value.body()["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
@pytest.mark.parametrize("opener, closer", [("[", "]"), ('{"a":', "}")])
async def test_nesting_100k_deep_is_a_400_not_a_recursion_error(client, path, opener, closer):
    raw = b'{"messages": ' + (opener * 100_000).encode() + b"1" + (closer * 100_000).encode() + b"}"
    client.app.config["MAX_CONTENT_LENGTH"] = len(raw) + 1
    status, body = await post(client, path, raw)
    assert (status, body) == (400, {"error": {
        "message": "The JSON body nests arrays and objects more than a thousand levels deep; "
                   "at most 64 are allowed.", "type": "invalid_request_error", "param": None,
        "code": None}})


def test_nesting_just_past_the_limit_is_a_400_naming_the_depth():
    with pytest.raises(ApiError) as info:
        json_body.decode(b'{"messages": ' + b"[" * 65 + b"]" * 65 + b"}")
    assert info.value.status == 400
    assert info.value.message.startswith("The JSON body nests arrays and objects 66 levels deep")
    assert json_body.nesting_depth(json.loads(b"[" * 64 + b"]" * 64)) == 64


def test_nesting_counts_brackets_in_strings_as_text():
    inside = json.dumps({"messages": [{"role": "user", "content": "[{" * 5000}]}).encode()
    assert json_body.nesting_depth(json.loads(inside)) == 3
    assert json_body.decode(inside)["messages"][0]["content"] == "[{" * 5000


def test_an_unterminated_string_of_escaped_quotes_is_rejected_in_one_pass():
    # Skipping strings with a pattern rescans to the end from every quote of this body:
    # 200k escaped quotes took minutes of a frozen event loop. One pass answers at once.
    raw = b"[" * 70 + b'"' + b'\\"' * 200_000
    with pytest.raises(ApiError) as info:
        json_body.decode(raw)
    assert info.value.status == 400 and "could not parse the JSON body" in info.value.message


SURROGATE_CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[1].text"),
    ("/v1/chat/completions", {"messages": USER, "stop": ["x", "\udc00"]}, "stop[1]"),
    ("/v1/chat/completions", {"messages": USER, "user": "x\udbff"}, "user"),
    ("/v1/chat/completions", {"messages": USER, "session_id": "\ud800"}, "session_id"),
    ("/v1/chat/completions", {"messages": USER, "metadata": {"k": "\ud800"}}, "metadata.k"),
    ("/v1/chat/completions", {"messages": USER, "\ud800": 1}, "\\ud800"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["\udfff"]}, "prompt[0]"),
    ("/v1/embeddings", {"input": ["fine", "\udc00"]}, "input[1]"),
]


@pytest.mark.parametrize("path, body, param", SURROGATE_CASES)
async def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, body, param):
    # json.dumps writes the surrogate as the escape a client would send (\ud800).
    status, answer = await post(client, path, json.dumps(body).encode())
    assert (status, answer) == (400, {"error": {
        "message": f"Invalid '{param}': the text holds a lone UTF-16 surrogate (an unpaired "
                   f"\\ud800-\\udfff escape), which is not valid Unicode.",
        "type": "invalid_request_error", "param": param, "code": "invalid_value"}})


async def test_raw_surrogate_bytes_are_named_too(client):
    raw = b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
    status, answer = await post(client, "/v1/chat/completions", raw)
    assert (status, answer["error"]["param"]) == (400, "messages[0].content")


def test_a_surrogate_pair_is_text_not_an_error():
    assert json_body.decode(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}


@pytest.mark.parametrize("parse, body, param, message", [
    (parse_chat, {"messages": USER, "max_tokens": 10**30}, "max_tokens",
     "Invalid 'max_tokens': integer above maximum value. Expected a value <= 2147483647, but "
     f"got {10**30} instead."),
    (parse_chat, {"messages": USER, "max_completion_tokens": 2**64}, "max_completion_tokens",
     "Invalid 'max_completion_tokens': integer above maximum value. Expected a value <= "
     f"2147483647, but got {2**64} instead."),
    (parse_chat, {"messages": USER, "seed": 2**70}, "seed",
     "Invalid 'seed': integer above maximum value. Expected a value <= 9223372036854775807, "
     f"but got {2**70} instead."),
    (parse_chat, {"messages": USER, "seed": -2**63 - 1}, "seed",
     "Invalid 'seed': integer below minimum value. Expected a value >= -9223372036854775808, "
     f"but got {-2**63 - 1} instead."),
    (parse_chat, {"messages": USER, "top_k": 2**40}, "top_k",
     "Invalid 'top_k': integer above maximum value. Expected a value <= 2147483647, but got "
     f"{2**40} instead."),
    (parse_chat, {"messages": USER, "top_k": -2}, "top_k",
     "Invalid 'top_k': integer below minimum value. Expected a value >= -1, but got -2 "
     "instead."),
    (parse_completion, {"prompt": [10**30]}, "prompt",
     "Invalid 'prompt': token ids must be below the vocabulary size 2147483648, but got "
     f"{10**30}."),
    (parse_completion, {"prompt": [[1, 2**31]]}, "prompt",
     "Invalid 'prompt': token ids must be below the vocabulary size 2147483648, but got "
     "2147483648."),
    (embeddings.parse, {"input": [[2**64]]}, "input",
     "Invalid 'input': token ids must be below the vocabulary size 2147483648, but got "
     f"{2**64}."),
])
def test_integers_outside_what_the_station_takes_are_a_400(parse, body, param, message):
    assert refused(parse, body) == {"message": message, "type": "invalid_request_error",
                                    "param": param, "code": "invalid_value"}


def test_seed_takes_the_whole_int64_range_and_top_k_is_passed_on():
    assert parse_chat({"messages": USER, "seed": -2**63}).station_args["seed"] == -2**63
    assert parse_chat({"messages": USER, "seed": 2**63 - 1}).station_args["seed"] == 2**63 - 1
    assert parse_chat({"messages": USER, "max_tokens": 2**31 - 1}).station_args["max_tokens"] \
        == 2**31 - 1
    assert parse_completion({"prompt": "a", "top_k": 40}).station_args["top_k"] == 40
    # vLLM's "off" values: nothing reaches the station.
    assert "top_k" not in parse_chat({"messages": USER, "top_k": -1}).station_args
    assert "top_k" not in parse_chat({"messages": USER, "top_k": 0}).station_args


UNSUPPORTED_CHAT = [
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", {"name": "f"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}), ("reasoning_effort", "low"), ("verbosity", "high"),
]


@pytest.mark.parametrize("field, value", UNSUPPORTED_CHAT)
def test_chat_fields_that_would_change_the_answer_are_refused(field, value):
    error = refused(parse_chat, {"messages": USER, field: value})
    assert (error["param"], error["code"]) == (field, "unsupported_value")


@pytest.mark.parametrize("field, value", [
    ("suffix", "z"), ("best_of", 3),
])
def test_completion_fields_that_would_change_the_answer_are_refused(field, value):
    error = refused(parse_completion, {"prompt": "a", field: value})
    assert (error["param"], error["code"]) == (field, "unsupported_value")


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "x", "name": "alice"}, "messages[0].name"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f"}},
     "messages[0].function_call"),
    ({"role": "assistant", "content": "", "refusal": "no"}, "messages[0].refusal"),
    ({"role": "assistant", "content": None, "audio": {"id": "a"}}, "messages[0].audio"),
])
def test_message_fields_that_would_change_the_answer_are_refused(message, param):
    error = refused(parse_chat, {"messages": [message]})
    assert (error["param"], error["code"]) == (param, "unsupported_value")


def test_defaults_and_no_op_fields_are_accepted_and_change_nothing():
    plain = parse_chat({"messages": USER}).station_args
    noisy = parse_chat({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": "yo", "tool_calls": [], "refusal": None},
                     {"role": "tool", "content": "1", "tool_call_id": "c1"}],
        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [],
        "tool_choice": "none", "functions": [], "function_call": "auto", "top_logprobs": 0,
        "response_format": {"type": "text"}, "modalities": ["text"], "logprobs": False,
        "prediction": None, "audio": None, "reasoning_effort": None, "min_p": 0,
        "repetition_penalty": 1, "n": 1, "top_k": -1, "metadata": {"team": "a"},
        "store": False, "service_tier": "auto", "parallel_tool_calls": True,
        "safety_identifier": "u-1", "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False}}).station_args
    assert {k: v for k, v in noisy.items() if k != "messages"} == \
        {k: v for k, v in plain.items() if k != "messages"}
    text = parse_completion({"prompt": "a", "echo": False, "best_of": 1, "logprobs": None,
                             "suffix": None, "presence_penalty": 0, "logit_bias": {}})
    assert text.station_args == parse_completion({"prompt": "a"}).station_args


@pytest.mark.parametrize("parse, body, param", [
    (parse_chat, {"messages": USER, "temprature": 0}, "temprature"),
    (parse_chat, {"messages": USER, "guided_json": {}}, "guided_json"),
    (parse_chat, {"messages": [{"role": "user", "content": "x", "weight": 1}]},
     "messages[0].weight"),
    (parse_chat, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {}}]}]}, "messages[0].content[0].cache_control"),
    (parse_chat, {"messages": USER, "stream": True, "stream_options": {"chunk": 1}},
     "stream_options.chunk"),
    (parse_completion, {"prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens"),
    (parse_completion, {"prompt": "a", "tools": []}, "tools"),
    (embeddings.parse, {"input": "a", "truncate": True}, "truncate"),
])
def test_unknown_fields_are_refused_like_openai(parse, body, param):
    assert refused(parse, body) == {
        "message": f"Unrecognized request argument supplied: {param}",
        "type": "invalid_request_error", "param": param, "code": "unknown_parameter"}


async def test_a_body_over_max_request_bytes_is_413_with_the_openai_body(client):
    raw = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    response = await client.post("/v1/chat/completions", data=raw,
                                 headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert json.loads(await response.get_data()) == {"error": {
        "message": "The request body is larger than this server's limit of 4096 bytes.",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
