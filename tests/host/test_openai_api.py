"""Request validation and response shapes, pure: exact error bodies and station args."""

from __future__ import annotations

import pytest

from host import errors, formatting, sse
from host.errors import ApiError
from host.openai_api import parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"messages": USER, **fields}


def rejected(parse, body) -> tuple[int, dict]:
    with pytest.raises(ApiError) as info:
        parse(body)
    return info.value.status, info.value.body()["error"]


def test_chat_defaults_follow_openai():
    req = parse_chat(chat())
    assert req.kind == "chat" and req.model is None and not req.stream and not req.include_usage
    assert req.station_args == {"messages": USER, "temperature": 1.0, "top_p": 1.0}
    assert req.prompt_param == "messages"


def test_chat_all_supported_fields_reach_the_station():
    req = parse_chat(chat(model="m", max_tokens=7, temperature=0, top_p=0.5, n=1, stop="x",
                          seed=3, stream=True, stream_options={"include_usage": True},
                          user="u", logprobs=False, presence_penalty=0))
    assert req.model == "m" and req.stream and req.include_usage
    assert req.station_args == {"messages": USER, "max_tokens": 7, "temperature": 0.0,
                                "top_p": 0.5, "stop": ["x"], "seed": 3}


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_chat(chat(max_tokens=9, max_completion_tokens=4)).station_args["max_tokens"] == 4


def test_content_parts_are_joined_and_developer_is_system():
    req = parse_chat({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "},
                                          {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42"}]})
    assert req.station_args["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"}]


@pytest.mark.parametrize("body, param, code, message", [
    ({}, "messages", "missing_required_parameter", "Missing required parameter: 'messages'."),
    ({"messages": "hi"}, "messages", "invalid_type",
     "Invalid type for 'messages': expected an array, but got a string instead."),
    ({"messages": []}, "messages", "invalid_value",
     "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an "
     "empty array instead."),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value",
     "Invalid 'messages[0].role': value must be one of 'system', 'user', 'assistant', 'tool', "
     "'developer', but got 'robot'."),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter",
     "Missing required parameter: 'messages[0].role'."),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter",
     "Missing required parameter: 'messages[0].content'."),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type",
     "Invalid type for 'messages[0].content': expected a string or an array of text parts, but "
     "got an integer instead."),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "invalid_value",
     "Invalid 'messages[0].content[0].type': only 'text' content parts are supported, but got "
     "'image_url'."),
    (chat(model=3), "model", "invalid_type",
     "Invalid type for 'model': expected a string, but got an integer instead."),
    (chat(max_tokens=0), "max_tokens", "invalid_value",
     "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got 0 "
     "instead."),
    (chat(max_completion_tokens=1.5), "max_completion_tokens", "invalid_type",
     "Invalid type for 'max_completion_tokens': expected an integer, but got a decimal instead."),
    (chat(max_tokens=True), "max_tokens", "invalid_type",
     "Invalid type for 'max_tokens': expected an integer, but got a boolean instead."),
    (chat(temperature=2.5), "temperature", "invalid_value",
     "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.5 "
     "instead."),
    (chat(temperature=-1), "temperature", "invalid_value",
     "Invalid 'temperature': decimal below minimum value. Expected a value >= 0, but got -1 "
     "instead."),
    (chat(temperature="hot"), "temperature", "invalid_type",
     "Invalid type for 'temperature': expected a decimal, but got a string instead."),
    (chat(top_p=0), "top_p", "invalid_value",
     "Invalid 'top_p': decimal below minimum value. Expected a value > 0, but got 0 instead."),
    (chat(top_p=1.01), "top_p", "invalid_value",
     "Invalid 'top_p': decimal above maximum value. Expected a value <= 1, but got 1.01 "
     "instead."),
    (chat(n=0), "n", "invalid_value", "Invalid 'n': must be in [1, 16], but got 0."),
    (chat(n=17), "n", "invalid_value", "Invalid 'n': must be in [1, 16], but got 17."),
    (chat(n="1"), "n", "invalid_type",
     "Invalid type for 'n': expected an integer, but got a string instead."),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value",
     "Invalid 'stop': array too long. Expected an array with maximum length 4, but got an "
     "array with length 5 instead."),
    (chat(stop=[1]), "stop", "invalid_type",
     "Invalid type for 'stop': expected a string or an array of strings, but got an array "
     "instead."),
    (chat(seed=1.0), "seed", "invalid_type",
     "Invalid type for 'seed': expected an integer, but got a decimal instead."),
    (chat(stream="yes"), "stream", "invalid_type",
     "Invalid type for 'stream': expected a boolean, but got a string instead."),
    (chat(stream_options={"include_usage": True}), "stream_options", "invalid_value",
     "The 'stream_options' parameter is only allowed when 'stream' is enabled."),
    (chat(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage",
     "invalid_type", "Invalid type for 'stream_options.include_usage': expected a boolean, but "
     "got an integer instead."),
    (chat(user=7), "user", "invalid_type",
     "Invalid type for 'user': expected a string, but got an integer instead."),
    (chat(logprobs=1), "logprobs", "invalid_type",
     "Invalid type for 'logprobs': expected a boolean, but got an integer instead."),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value",
     "Invalid 'top_logprobs': must be in [0, 20], but got 21."),
    (chat(top_logprobs=2, logprobs=False), "top_logprobs", "invalid_value",
     "Invalid 'top_logprobs': requires 'logprobs' to be true."),
    (chat(echo=True), "echo", "unknown_parameter",
     "Unrecognized request argument supplied: echo"),
])
def test_chat_bad_fields_get_the_exact_openai_error(body, param, code, message):
    assert rejected(parse_chat, body) == (400, {"message": message, "type": "invalid_request_error",
                                                "param": param, "code": code})


@pytest.mark.parametrize("body", [[1, 2], "text", None, 3])
def test_body_must_be_an_object(body):
    status, error = rejected(parse_chat, body)
    assert status == 400 and error["param"] is None and error["code"] is None
    assert error["message"].startswith("The request body must be a JSON object, but got ")


@pytest.mark.parametrize("prompt, args", [
    ("abc", {"prompt": "abc"}),
    (["abc"], {"prompt": "abc"}),
    ([5, 6, 7], {"tokens": [5, 6, 7]}),
    ([[5, 6]], {"tokens": [5, 6]}),
])
def test_completion_prompt_forms(prompt, args):
    req = parse_completion({"prompt": prompt, "temperature": 0})
    assert req.kind == "text" and req.prompt_param == "prompt"
    assert req.station_args == {**args, "temperature": 0.0, "top_p": 1.0}


@pytest.mark.parametrize("body, param, code", [
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": []}, "prompt", "invalid_type"),
    ({"prompt": [1, "a"]}, "prompt", "invalid_type"),
    ({"prompt": [-1]}, "prompt", "invalid_value"),
    ({"prompt": ["a", {"x": 1}]}, "prompt[1]", "invalid_type"),
    ({"prompt": [[1], [-1]]}, "prompt[1]", "invalid_value"),
    ({"prompt": "a", "logprobs": True}, "logprobs", "invalid_type"),
    ({"prompt": "a", "logprobs": "2"}, "logprobs", "invalid_type"),
    ({"prompt": "a", "logprobs": 21}, "logprobs", "invalid_value"),
    ({"prompt": "a", "echo": "yes"}, "echo", "invalid_type"),
    ({"prompt": "a", "n": 2, "best_of": 3}, "best_of", "unsupported_value"),
    ({"prompt": "a", "suffix": "z"}, "suffix", "unsupported_value"),
    ({"prompt": "a", "max_tokens": -3}, "max_tokens", "invalid_value"),
])
def test_completion_bad_fields(body, param, code):
    status, error = rejected(parse_completion, body)
    assert (status, error["type"], error["param"], error["code"]) == \
        (400, "invalid_request_error", param, code)


def test_chat_formatting():
    fmt = formatting.Formatter("chat", "tiny", include_usage=True)
    assert fmt.id.startswith("chatcmpl-")
    usage = formatting.usage(5, 3, 0)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                     "prompt_tokens_details": {"cached_tokens": 0}}
    full = fmt.completion("hey", "stop", usage, {"g": 1})
    assert full == {"id": fmt.id, "object": "chat.completion", "created": fmt.created,
                    "model": "tiny", "choices": [{"index": 0, "message": {
                        "role": "assistant", "content": "hey"}, "logprobs": None,
                        "finish_reason": "stop"}], "usage": usage, "_gnosis": {"g": 1}}
    env = {"id": fmt.id, "object": "chat.completion.chunk", "created": fmt.created,
           "model": "tiny", "usage": None}
    assert fmt.role_chunk() == {**env, "choices": [{"index": 0, "delta": {
        "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    assert fmt.delta_chunk("a") == {**env, "choices": [{"index": 0, "delta": {"content": "a"},
                                                        "logprobs": None, "finish_reason": None}]}
    assert fmt.finish_chunk("length", None) == {**env, "choices": [{
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]}
    assert fmt.usage_chunk(usage, {"g": 1}) == {**env, "choices": [], "usage": usage,
                                                 "_gnosis": {"g": 1}}


def test_text_formatting_without_usage():
    fmt = formatting.Formatter("text", "tiny")
    assert fmt.id.startswith("cmpl-") and fmt.role_chunk() is None
    env = {"id": fmt.id, "object": "text_completion", "created": fmt.created, "model": "tiny"}
    assert fmt.delta_chunk("a") == {**env, "choices": [{"index": 0, "text": "a", "logprobs": None,
                                                        "finish_reason": None}]}
    assert fmt.finish_chunk("stop", {"g": 2}) == {**env, "choices": [{
        "index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}], "_gnosis": {"g": 2}}


def test_sse_framing():
    assert sse.event({"a": "é\n"}) == 'data: {"a":"é\\n"}\n\n'.encode()
    assert sse.DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize("code, status, api_code, retry_after", [
    ("context_overflow", 400, "context_length_exceeded", None),
    ("bad_request", 400, "invalid_value", None),
    ("capacity", 503, "capacity", "1"),
    ("shutting_down", 503, "shutting_down", "1"),
    ("internal", 500, "internal_error", None),
])
def test_station_errors_map_to_http(code, status, api_code, retry_after):
    from gnosis_daemon.client import StationError

    api = errors.from_station(StationError(code, "boom"), "messages")
    assert (api.status, api.code, api.headers.get("Retry-After")) == (status, api_code, retry_after)
    if code == "context_overflow":
        assert api.param == "messages"


def test_unavailable_is_503_with_retry_after():
    from gnosis_daemon.client import StationUnavailable

    api = errors.from_station(StationUnavailable("gone"), "prompt")
    assert api.status == 503 and api.headers == {"Retry-After": "1"}
    assert api.body()["error"] == {
        "message": "The model station is not available right now; retry shortly. (gone)",
        "type": "service_unavailable", "param": None, "code": "station_unavailable"}


def test_ignore_eos_is_passed_through_and_type_checked():
    from host.openai_api import parse_chat

    ok = parse_chat({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert ok.station_args["ignore_eos"] is True
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": "yes"})
    assert info.value.status == 400 and info.value.param == "ignore_eos"
