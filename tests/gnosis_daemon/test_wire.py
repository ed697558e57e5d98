"""The wire messages of ``generate``: each read, checked and written in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import msgpack
import pytest

from gnosis_daemon import wire
from gnosis_daemon.protocol import ErrorCode, OpError
from gnosis_daemon.wire import (ChoiceResult, Choices, GenerateArgs, GenerateResult, PrefillEvent,
                                PrefillReport, Sampling, Sessions, TokensEvent, event_from_wire)

ROOT = Path(__file__).resolve().parents[2]

EVERY_FIELD = {
    "messages": [{"role": "user", "content": "hi", "name": "ann"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"id": "c1", "type": "function",
                                  "function": {"name": "f", "arguments": {"a": 1}}}]}],
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "max_tokens": 9, "stop": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 4,
    "seed": -1, "ignore_eos": True, "min_p": 0.1, "presence_penalty": -2.0,
    "frequency_penalty": 2.0, "repetition_penalty": 1.3, "min_tokens": 3,
    "stop_token_ids": [5, 6], "logit_bias": {7: -100.0, 8: 100.0},
    "n": 3, "logprobs": 0, "prompt_logprobs": 20,
    "tenant": "alice", "load_session": "a.s", "save_session": "b.s",
    "save_final_session": "c.s", "match_session": True,
}


def refusal(args: dict, **kwargs) -> str:
    with pytest.raises(OpError) as err:
        GenerateArgs.from_wire(args, **kwargs)
    assert err.value.code is ErrorCode.BAD_REQUEST
    return err.value.message


def test_every_field_round_trips():
    args = GenerateArgs.from_wire(EVERY_FIELD)
    assert args.to_wire() == EVERY_FIELD
    assert GenerateArgs.from_wire(args.to_wire()) == args
    assert args.sampling.logit_bias == ((7, -100.0), (8, 100.0))
    assert args.choices == Choices(n=3, logprobs=0, prompt_logprobs=20)
    assert args.sessions == Sessions(tenant="alice", load_session="a.s", match_session=True,
                                     save_session="b.s", save_final_session="c.s")
    # What the station's frame decoder hands over is what was packed.
    packed = msgpack.unpackb(msgpack.packb(args.to_wire()), strict_map_key=False)
    assert GenerateArgs.from_wire(packed) == args


def test_defaults_add_nothing_to_the_frame():
    args = GenerateArgs.from_wire({"tokens": [1, 2], "temperature": 1.0, "n": 1,
                                   "match_session": False, "stop": ["", ""], "tenant": ""})
    assert args == GenerateArgs(tokens=(1, 2))
    assert args.to_wire() == {"tokens": [1, 2]}
    assert not args.choices.asked and not args.sessions.asked


def test_text_prompt_and_its_special_tokens():
    args = GenerateArgs.from_wire({"prompt": "hi", "add_special_tokens": False, "stop": "x"})
    assert (args.prompt, args.add_special_tokens, args.stop) == ("hi", False, ("x",))
    assert args.to_wire() == {"prompt": "hi", "add_special_tokens": False, "stop": ["x"]}


def test_logit_bias_keys_as_json_writes_them():
    args = GenerateArgs.from_wire({"tokens": [1], "logit_bias": {"3": 1, 4: -2.5}})
    assert args.sampling.logit_bias == ((3, 1.0), (4, -2.5))


def test_unknown_fields_are_ignored():
    """Fields the protocol does not name are not read (docs/protocol.md): nor carried on."""
    args = GenerateArgs.from_wire({"tokens": [1], "frobnicate": 3, 7: "x"})
    assert args.to_wire() == {"tokens": [1]}


@pytest.mark.parametrize(("args", "message"), [
    ({"tokens": [1], "max_tokens": "x"}, "argument 'max_tokens' must be int, got str"),
    ({"tokens": [1], "max_tokens": 1e30}, "argument 'max_tokens' must be int, got float"),
    ({"tokens": [1], "top_k": True}, "argument 'top_k' must be int, got a bool"),
    ({"tokens": [1], "temperature": "hot"}, "argument 'temperature' must be int or float, got str"),
    ({"tokens": "abc"}, "argument 'tokens' must be list, got str"),
    ({"tokens": [1, "2"]}, "argument 'tokens' must be a list of ints"),
    ({"tokens": [1, True]}, "argument 'tokens' must be a list of ints"),
    ({"prompt": None}, "argument 'prompt' is required"),
    ({"tokens": [1], "tenant": 5}, "argument 'tenant' must be str, got int"),
    ({"tokens": [1], "match_session": 1}, "argument 'match_session' must be bool, got int"),
    ({"tokens": [1], "stop": [1]}, "argument 'stop' must be a string or a list of strings"),
    ({"tokens": [1], "logit_bias": {"x": 1.0}},
     "argument 'logit_bias' must map token ids (ints or decimal strings) to numbers"),
    ({"tokens": [1], "logit_bias": {3: None}},
     "argument 'logit_bias' must map token ids (ints or decimal strings) to numbers"),
    ({"tokens": [1], "logit_bias": [3]}, "argument 'logit_bias' must be dict, got list"),
    ({"messages": []}, "argument 'messages' must be a non-empty list of {role, content} maps"),
    ({"messages": [{"role": "user"}]}, "messages[0] must be a map with string 'role' and 'content'"),
    ({"messages": [{"role": "u", "content": "c"}], "tools": [{"function": {}}]},
     "tools[0] must be a map with 'function': {'name': string, ...}"),
    ({"tokens": [1], "grammar": {"type": "regex"}},
     "argument 'grammar' type 'regex' needs 'regex'"),
], ids=lambda v: str(v)[:40] if isinstance(v, str) else None)
def test_ill_typed_fields(args, message):
    assert refusal(args) == message


@pytest.mark.parametrize(("args", "message"), [
    ({}, "generate takes exactly one of 'tokens', 'prompt' or 'messages'"),
    ({"tokens": [1], "prompt": "x"}, "generate takes exactly one of 'tokens', 'prompt' or 'messages'"),
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "argument 'tools' needs 'messages' (the chat template renders them)"),
    ({"tokens": [1], "max_tokens": 0}, "argument 'max_tokens' must be at least 1"),
    ({"tokens": [1], "max_tokens": 4, "min_tokens": 5},
     "argument 'min_tokens' (5) must be at most max_tokens (4)"),
    ({"tokens": [1], "min_tokens": -1}, "argument 'min_tokens' must be >= 0"),
    ({"tokens": [1], "temperature": -0.5}, "argument 'temperature' must be a finite number >= 0"),
    ({"tokens": [1], "temperature": float("nan")},
     "argument 'temperature' must be a finite number >= 0"),
    ({"tokens": [1], "temperature": float("inf")},
     "argument 'temperature' must be a finite number >= 0"),
    ({"tokens": [1], "top_p": 0}, "argument 'top_p' must be in (0, 1]"),
    ({"tokens": [1], "top_p": 1.5}, "argument 'top_p' must be in (0, 1]"),
    ({"tokens": [1], "top_k": -1}, "argument 'top_k' must be >= 0"),
    ({"tokens": [1], "seed": 2**64}, "argument 'seed' must be in [-2**63, 2**64)"),
    ({"tokens": [1], "seed": -(2**63) - 1}, "argument 'seed' must be in [-2**63, 2**64)"),
    ({"tokens": [1], "min_p": 1.5}, "argument 'min_p' must be in [0, 1]"),
    ({"tokens": [1], "presence_penalty": 2.5}, "argument 'presence_penalty' must be in [-2, 2]"),
    ({"tokens": [1], "frequency_penalty": float("nan")},
     "argument 'frequency_penalty' must be in [-2, 2]"),
    ({"tokens": [1], "repetition_penalty": 0},
     "argument 'repetition_penalty' must be a finite number > 0"),
    ({"tokens": [1], "logit_bias": {i: 1.0 for i in range(301)}},
     "argument 'logit_bias' has 301 entries, more than 300"),
    ({"tokens": [1], "logit_bias": {"3": 100.5}},
     "argument 'logit_bias' gives token 3 the bias 100.5: a bias must be in [-100, 100]"),
    ({"tokens": [1], "logit_bias": {3: 1.0, "3": 2.0}}, "argument 'logit_bias' names a token twice"),
    ({"tokens": [1], "n": 17}, "argument 'n' must be in [1, 16], got 17"),
    ({"tokens": [1], "n": 0}, "argument 'n' must be in [1, 16], got 0"),
    ({"tokens": [1], "logprobs": 21}, "argument 'logprobs' must be in [0, 20] or null, got 21"),
    ({"tokens": [1], "prompt_logprobs": -1},
     "argument 'prompt_logprobs' must be in [0, 20] or null, got -1"),
    ({"tokens": [1], "stop": ["s"] * 17},
     "argument 'stop' takes at most 16 strings of at most 512 characters"),
    ({"tokens": [1], "stop": ["x" * 513]},
     "argument 'stop' takes at most 16 strings of at most 512 characters"),
    ({"tokens": [1], "stop": ["x"], "grammar": {"type": "json_object"}},
     "argument 'stop' cannot be used with 'grammar': a stop string would end the output "
     "before the grammar is complete"),
], ids=lambda v: str(v)[:40] if isinstance(v, str) else None)
def test_each_bound_refuses_with_its_message(args, message):
    assert refusal(args) == message


def test_bounds_at_their_edges_are_taken():
    args = GenerateArgs.from_wire({
        "tokens": [1], "max_tokens": 3, "min_tokens": 3, "temperature": 0, "top_p": 1,
        "seed": 2**64 - 1, "min_p": 1, "presence_penalty": -2, "frequency_penalty": 2,
        "logit_bias": {i: 100 for i in range(300)}, "n": 16, "logprobs": 20,
        "stop": ["x" * 512] * 16})
    assert args.sampling.greedy and len(args.sampling.logit_bias) == 300


def test_grammar_node_bound_and_the_station_budget():
    spec = {"type": "json_schema", "schema": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(8)}}}
    assert GenerateArgs.from_wire({"tokens": [1], "grammar": spec}).grammar == spec
    assert refusal({"tokens": [1], "grammar": spec}, grammar_max_nodes=4).startswith(
        "argument 'grammar' holds more than 4 JSON values")
    args = GenerateArgs.from_wire({"tokens": [1], "min_tokens": 5})
    assert args.token_budget(8) == 8
    with pytest.raises(OpError, match=r"^argument 'min_tokens' \(5\) must be at most "
                       r"max_tokens \(4\)$"):
        args.token_budget(4)


def test_values_built_in_code_meet_the_same_bounds():
    with pytest.raises(OpError, match=r"^argument 'top_p' must be in \(0, 1\]$"):
        Sampling(top_p=0)
    with pytest.raises(OpError, match=r"^argument 'n' must be in \[1, 16\], got 99$"):
        Choices(n=99)
    with pytest.raises(OpError, match="exactly one of"):
        GenerateArgs()


def test_the_engine_params_are_the_wire_sampling_with_a_budget():
    from station.core.requests import SamplingParams

    sampling = GenerateArgs.from_wire(EVERY_FIELD).sampling
    params = SamplingParams.of(sampling, 7)
    assert params.max_tokens == 7 and isinstance(params, Sampling)
    assert {f: getattr(params, f) for f in Sampling.__dataclass_fields__} == \
        {f: getattr(sampling, f) for f in Sampling.__dataclass_fields__}
    with pytest.raises(OpError, match=r"^argument 'max_tokens' must be at least 1$"):
        SamplingParams(max_tokens=0)
    with pytest.raises(OpError, match=r"^argument 'presence_penalty' must be in \[-2, 2\]$"):
        SamplingParams(max_tokens=1, presence_penalty=3.0)


# -- events
ENTRY = {"token_id": 5, "token": "a", "bytes": [97], "logprob": -0.5,
         "top_logprobs": [{"token_id": 5, "token": "a", "bytes": [97], "logprob": -0.5}]}


def test_prefill_event_bytes_and_round_trip():
    report = PrefillReport(prompt_tokens=9, cached_tokens=8, session_loaded=True,
                           session_id="s", session_tokens=8, session_tier="disk", saved=True)
    event = PrefillEvent.of(report, (ENTRY,))
    wired = event.to_wire()
    # The protocol's field order, as the station has always sent it.
    assert list(wired) == ["type", "prompt_tokens", "cached_tokens", "session_loaded",
                           "session_id", "session_tokens", "session_tier", "session_error",
                           "saved", "save_error", "pins", "prompt_logprobs"]
    assert wired["type"] == "prefill" and wired["prompt_logprobs"] == [ENTRY]
    assert event_from_wire(msgpack.unpackb(msgpack.packb(wired))) == event
    assert "prompt_logprobs" not in PrefillEvent.of(report).to_wire()


def test_prefill_fields_an_older_station_leaves_out_read_as_defaults():
    event = event_from_wire({"type": "prefill", "prompt_tokens": 3, "cached_tokens": 0})
    assert event == PrefillEvent(prompt_tokens=3, cached_tokens=0)
    assert (event.saved, event.save_error, event.session_tier) == (False, None, None)


def test_tokens_event():
    event = TokensEvent(token_ids=(4, 5), text="hi", logprobs=(ENTRY, ENTRY), index=2)
    assert event.to_wire() == {"type": "tokens", "token_ids": [4, 5], "text": "hi",
                               "logprobs": [ENTRY, ENTRY], "index": 2}
    assert event_from_wire(event.to_wire()) == event
    plain = event_from_wire({"type": "tokens", "token_ids": [4], "text": ""})
    assert plain == TokensEvent(token_ids=(4,), text="") and plain.choice == 0
    assert TokensEvent(token_ids=(), text="x").to_wire() == {"type": "tokens", "token_ids": [],
                                                             "text": "x"}


def test_unknown_or_ill_typed_event():
    with pytest.raises(OpError, match=r"^unknown generate event type 'nope'$"):
        event_from_wire({"type": "nope"})
    with pytest.raises(OpError, match=r"^argument 'token_ids' must be a list of ints$"):
        event_from_wire({"type": "tokens", "token_ids": ["a"], "text": ""})


def test_result_with_choices():
    each = tuple(ChoiceResult(index=i, finish_reason="stop", completion_tokens=2,
                              token_ids=(i, 9), text=f"t{i}") for i in range(2))
    result = GenerateResult(first=each[0], prompt_tokens=4, completion_tokens=4,
                            cached_tokens=1, ttft_ms=1.5, decode_tokens_per_s=3.0, choices=each)
    wired = result.to_wire()
    assert list(wired) == ["finish_reason", "completion_tokens", "token_ids", "text",
                           "final_saved", "final_save_error", "prompt_tokens", "cached_tokens",
                           "ttft_ms", "decode_tokens_per_s", "choices"]
    assert wired["completion_tokens"] == 4 and wired["token_ids"] == [0, 9]
    assert wired["choices"][1] == {"index": 1, "finish_reason": "stop", "completion_tokens": 2,
                                   "token_ids": [1, 9], "text": "t1", "final_saved": False,
                                   "final_save_error": None}
    back = GenerateResult.from_wire(msgpack.unpackb(msgpack.packb(wired)))
    assert back == result and back.first.completion_tokens == 2
    one = GenerateResult.from_wire({"finish_reason": "length", "prompt_tokens": 1,
                                    "completion_tokens": 2, "token_ids": [3, 4], "text": "ab"})
    assert one.each == (one.first,) and one.finish_reason == "length"
    assert (one.cached_tokens, one.ttft_ms) == (0, None)


# -- one definition each
BOUNDS = ("PENALTY_MAX", "BIAS_MAX", "MAX_LOGIT_BIAS", "MAX_STOP_STRINGS", "MAX_STOP_CHARS",
          "MAX_CHOICES", "MAX_LOGPROBS", "MAX_TOOLS", "SEED_MIN", "SEED_END", "MAX_PINS",
          "PIN_TTL_MAX_S")


def test_each_bound_is_defined_once():
    """No module but the wire's bounds assigns one of their names."""
    defined: dict[str, list[str]] = {name: [] for name in BOUNDS}
    for package in ("gnosis_daemon", "host", "station", "supervisor"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) else []
                for target in targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for name in names:
                        if isinstance(name, ast.Name) and name.id in defined:
                            defined[name.id].append(str(path.relative_to(ROOT)))
    assert defined == {name: ["gnosis_daemon/wire/bounds.py"] for name in BOUNDS}
    assert wire.MAX_LOGIT_BIAS == 300 and wire.MAX_CHOICES == 16
