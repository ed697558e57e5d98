"""The sampling controls of the OpenAI routes: what reaches the station, and OpenAI's 400
body naming the field for every bad value."""

from __future__ import annotations

import pytest

from host.completions import check_prompt_fits
from host.errors import ApiError
from host.openai_api import parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]
CONTROLS = {"presence_penalty": 0.5, "frequency_penalty": -1, "min_p": 0.05,
            "repetition_penalty": 1.2, "logit_bias": {"5": 100, "17": -2.5},
            "stop_token_ids": [3, 9], "min_tokens": 4, "max_tokens": 8}
STATION = {"presence_penalty": 0.5, "frequency_penalty": -1.0, "min_p": 0.05,
           "repetition_penalty": 1.2, "logit_bias": {5: 100.0, 17: -2.5},
           "stop_token_ids": [3, 9], "min_tokens": 4, "max_tokens": 8}


@pytest.mark.parametrize("parse, body", [(parse_chat, {"messages": USER}),
                                         (parse_completion, {"prompt": "a"})])
def test_every_control_reaches_the_station(parse, body):
    args = parse({**body, **CONTROLS, "stream": True}).station_args
    assert {k: args[k] for k in STATION} == STATION


def test_default_values_add_no_argument():
    plain = parse_chat({"messages": USER}).station_args
    assert parse_chat({"messages": USER, "presence_penalty": 0, "frequency_penalty": 0.0,
                       "min_p": 0, "repetition_penalty": 1, "logit_bias": {},
                       "stop_token_ids": [], "min_tokens": 0}).station_args == plain


def error_of(body, parse=parse_chat) -> tuple[str, str, str]:
    with pytest.raises(ApiError) as info:
        parse(body)
    error = info.value.body()["error"]
    assert info.value.status == 400 and error["type"] == "invalid_request_error"
    return error["param"], error["code"], error["message"]


@pytest.mark.parametrize("fields, param, code, message", [
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value",
     "Invalid 'presence_penalty': decimal above maximum value. Expected a value <= 2, but got "
     "2.5 instead."),
    ({"frequency_penalty": -3}, "frequency_penalty", "invalid_value",
     "Invalid 'frequency_penalty': decimal below minimum value. Expected a value >= -2, but got "
     "-3 instead."),
    ({"frequency_penalty": "x"}, "frequency_penalty", "invalid_type",
     "Invalid type for 'frequency_penalty': expected a decimal, but got a string instead."),
    ({"min_p": 1.5}, "min_p", "invalid_value",
     "Invalid 'min_p': decimal above maximum value. Expected a value <= 1, but got 1.5 "
     "instead."),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value",
     "Invalid 'repetition_penalty': decimal below minimum value. Expected a value > 0, but got "
     "0 instead."),
    ({"logit_bias": [1]}, "logit_bias", "invalid_type",
     "Invalid type for 'logit_bias': expected an object, but got an array instead."),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value",
     "Invalid 'logit_bias': keys must be token ids (non-negative integers as strings), but got "
     "'abc'."),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "invalid_value",
     "Invalid 'logit_bias': keys must be token ids (non-negative integers as strings), but got "
     "'-1'."),
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value",
     "Invalid 'logit_bias': the bias of token 5 must be in [-100, 100], but got 101."),
    ({"logit_bias": {"5": "up"}}, "logit_bias.5", "invalid_type",
     "Invalid type for 'logit_bias.5': expected a decimal, but got a string instead."),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value",
     "Invalid 'logit_bias': too many entries. Expected at most 300, but got 301 instead."),
    ({"stop_token_ids": [1, 2.5]}, "stop_token_ids", "invalid_type",
     "Invalid type for 'stop_token_ids': expected an array of integers, but got an array "
     "instead."),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "invalid_value",
     "Invalid 'stop_token_ids': token ids must be integers in [0, 2147483647]."),
    ({"min_tokens": -1}, "min_tokens", "invalid_value",
     "Invalid 'min_tokens': integer below minimum value. Expected a value >= 0, but got -1 "
     "instead."),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "invalid_value",
     "Invalid 'min_tokens': must be less than or equal to max_tokens=4, but got 5."),
])
def test_bad_values_get_openais_400_naming_the_field(fields, param, code, message):
    assert error_of({"messages": USER, **fields}) == (param, code, message)
    assert error_of({"prompt": "a", **fields}, parse_completion)[:2] == (param, code)


@pytest.mark.parametrize("fields, param", [({"logit_bias": {"300": 1}}, "logit_bias"),
                                           ({"stop_token_ids": [3, 300]}, "stop_token_ids")])
def test_token_ids_past_the_vocabulary_are_refused_before_the_station(fields, param):
    req = parse_chat({"messages": USER, **fields})
    with pytest.raises(ApiError) as info:
        check_prompt_fits(req, {"vocab_size": 300, "max_model_len": 64}, 1 << 24)
    error = info.value.body()["error"]
    assert (info.value.status, error["param"], error["code"]) == (400, param, "invalid_value")
    assert error["message"] == (f"Invalid '{param}': token ids must be below the vocabulary "
                                f"size 300, but got 300.")
    check_prompt_fits(parse_chat({"messages": USER, "logit_bias": {"299": 1}}),
                      {"vocab_size": 300, "max_model_len": 64}, 1 << 24)
