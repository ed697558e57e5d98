"""Pure liquid-memory policy: effective state and reasons, outcomes from the prefill event,
the ids sessions are saved under, request fields."""

from __future__ import annotations

import pytest

from host import embeddings, liquid, openai_api
from host.capabilities import Negotiated
from host.errors import ApiError
from gnosis_daemon.tokens import common_prefix_len as common_prefix
from gnosis_daemon.api_keys import tenant_key
from gnosis_daemon.wire import PrefillEvent
from host.session_names import save_ids

KV = "station lacks the kv_session capability"


def negotiated(flags: dict[str, bool], how: str = "flag") -> Negotiated:
    return Negotiated(flags, {name: how for name in flags})


@pytest.mark.parametrize("env, neg, effective, reason", [
    (True, negotiated({"generate": True, "kv_session": True}), True, None),
    (True, negotiated({"decode_next": True, "kv_session": True}), True, None),
    (False, negotiated({"generate": True, "kv_session": True}), False,
     "disabled by THOTH_LIQUID_MEMORY=0"),
    (True, None, False, "station not connected"),
    (False, None, False, "disabled by THOTH_LIQUID_MEMORY=0; station not connected"),
    (True, negotiated({"generate": True, "kv_session": False}), False,
     f"{KV} (flag false in hello)"),
    (True, negotiated({"generate": True, "kv_session": False}, "probe"), False,
     f"{KV} (unknown_op on probe)"),
    (True, negotiated({"generate": False, "decode_next": False, "kv_session": True}), False,
     "station lacks a decode path (generate or decode_next)"),
    (False, negotiated({"kv_session": False}), False,
     f"disabled by THOTH_LIQUID_MEMORY=0; {KV} (flag false in hello); "
     "station lacks a decode path (generate or decode_next)"),
])
def test_effective_only_when_env_and_kv_session_and_decode_path(env, neg, effective, reason):
    state = liquid.liquid_state(env, neg)
    assert (state.effective, state.reason, state.env) == (effective, reason, env)
    assert state.health_fields() == {
        "liquid_memory": effective, "liquid_memory_env": env,
        "station_kv_session": bool(neg and neg.kv_session), "liquid_memory_reason": reason}


@pytest.mark.parametrize("event, match, expected", [
    ({"session_loaded": True, "session_tokens": 32, "saved": True}, True,
     ("hit", True, None)),
    ({"session_loaded": True, "session_tokens": 32, "saved": False, "save_error": "x"}, True,
     ("hit", False, None)),
    ({"session_loaded": False, "session_tokens": 0, "saved": True}, True,
     ("miss", True, "no saved prefix")),
    # A station that saves but cannot match: the miss names the missing capability.
    ({"session_loaded": False, "session_tokens": 0, "saved": True}, False,
     ("miss", True, "station lacks kv_session_match: saved sessions are not loaded")),
    ({"session_loaded": False, "session_tokens": 0, "session_error": "not_found",
      "saved": True}, True, ("miss", True, "not_found")),
    ({"session_loaded": True, "session_tokens": 0, "saved": True}, True,
     ("miss", True, "no saved prefix")),
    ({"saved": False, "save_error": "capacity: no free blocks"}, True,
     ("capture_failed", False, "capacity: no free blocks")),
    # A station that ignored the save arguments: never a silent miss.
    ({"prompt_tokens": 9, "cached_tokens": 0}, True,
     ("capture_failed", False, "the station did not confirm the save")),
    (None, True, ("capture_failed", False, "the station did not confirm the save")),
])
def test_outcome_from_the_prefill_event(event, match, expected):
    prefill = None if event is None else PrefillEvent.from_wire(event)
    outcome = liquid.from_prefill(prefill, save_asked=True, match_asked=match)
    assert (outcome.liquid_memory, outcome.liquid_kv_saved, outcome.miss_reason) == expected
    assert outcome.path == "liquid"


def test_disabled_outcome_and_telemetry_names():
    outcome = liquid.disabled("why")
    assert liquid.gnosis_block(outcome, prompt_tokens=4, completion_tokens=2, cached_tokens=0,
                               ttft_ms=1.23456, tokens_per_second=None) == {
        "liquid_memory": "disabled", "liquid_kv_saved": False, "liquid_miss_reason": "why",
        "path": "native", "tier": None, "cached_tokens": 0, "prompt_tokens": 4, "completion_tokens": 2,
        "ttft_ms": 1.235, "tokens_per_second": None}
    assert liquid.headers(outcome) == {"X-Thoth-Liquid-Memory": "disabled",
                                       "X-Thoth-Liquid-KV-Saved": "false"}
    hit = liquid.LiquidOutcome("hit", True, None, "liquid")
    assert liquid.headers(hit) == {"X-Thoth-Liquid-Memory": "hit",
                                   "X-Thoth-Liquid-KV-Saved": "true"}


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix(list(range(100)), list(range(57)) + [-1]) == 57
    assert common_prefix([5], [6]) == 0


# Which session a prompt loads is the station's choice (generate's match_session): the
# longest prefix, tenant isolation and "at least one whole block" are tested there
# (tests/station/core/test_kv_manager.py, "matching"), on the registry that owns the sessions.

def test_save_ids_digest_the_prompt_and_the_tenant():
    prompt = (("messages", [{"role": "user", "content": "hi"}]),)
    ids = save_ids("a", prompt, None)
    assert ids.tenant == "a"
    assert ids.save_session.startswith("a.p.") and ids.save_final_session.startswith("a.c.")
    # The same prompt saves under the same prompt id; finals are unique per request.
    again = save_ids("a", prompt, None)
    assert again.save_session == ids.save_session
    assert again.save_final_session != ids.save_final_session
    assert save_ids("b", prompt, None).save_session != ids.save_session
    other = (("messages", [{"role": "user", "content": "ho"}]),)
    assert save_ids("a", other, None).save_session != ids.save_session


def test_tenant_keys():
    assert tenant_key("key-1") != tenant_key("key-2")
    assert tenant_key("key-1") == tenant_key("key-1") and len(tenant_key("key-1")) == 16
    assert tenant_key(None) == tenant_key("") == "anon"


def test_named_session_saves_prompt_and_final_under_one_id_per_tenant():
    ids = save_ids("a", (("tokens", [1, 2]),), "chat-42")
    assert ids.save_session == ids.save_final_session and ".n." in ids.save_session
    assert "chat-42" not in ids.save_session  # ids carry digests, not the caller's text
    assert save_ids("a", (("tokens", [3]),), "chat-42").save_session == ids.save_session
    assert save_ids("b", (("tokens", [1, 2]),), "chat-42").save_session != ids.save_session


def chat(**fields):
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("fields, name", [
    ({}, None),
    ({"user": "u"}, "u"),
    ({"prompt_cache_key": "k", "user": "u"}, "k"),
    ({"session_id": "s", "prompt_cache_key": "k", "user": "u"}, "s"),
    ({"session_id": "", "user": "u"}, "u"),
])
def test_session_name_fields(fields, name):
    req = openai_api.parse_chat(chat(**fields))
    assert req.session_name == name
    assert not {"session_id", "prompt_cache_key", "user"} & set(req.station_args)
    assert openai_api.parse_completion({"prompt": "x", **fields}).session_name == name


@pytest.mark.parametrize("field", ["session_id", "prompt_cache_key", "user"])
def test_session_name_must_be_a_string(field):
    with pytest.raises(ApiError) as info:
        openai_api.parse_chat(chat(**{field: 5}))
    assert info.value.body()["error"] == {
        "message": f"Invalid type for '{field}': expected a string, but got an integer instead.",
        "type": "invalid_request_error", "param": field, "code": "invalid_type"}


@pytest.mark.parametrize("value, args", [
    ("hello", {"texts": ["hello"]}),
    (["a", "b"], {"texts": ["a", "b"]}),
    ([1, 2, 3], {"tokens": [[1, 2, 3]]}),
    ([[1, 2], [3]], {"tokens": [[1, 2], [3]]}),
])
def test_embedding_inputs(value, args):
    req = embeddings.parse({"input": value, "model": "m"})
    assert (req.station_args, req.count, req.encoding_format) == (args, len(next(iter(args.values()))), "float")


@pytest.mark.parametrize("body, param, code", [
    ({}, "input", "missing_required_parameter"),
    ({"input": 5}, "input", "invalid_type"),
    ({"input": []}, "input", "invalid_type"),
    ({"input": ["a", 1]}, "input", "invalid_type"),
    ({"input": [[1], []]}, "input", "invalid_type"),
    ({"input": [-1]}, "input", "invalid_type"),
    ({"input": ["a", ""]}, "input", "invalid_value"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"input": "a", "dimensions": 8}, "dimensions", "unsupported_value"),
])
def test_embedding_bad_inputs(body, param, code):
    with pytest.raises(ApiError) as info:
        embeddings.parse(body)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_embedding_response_shape_and_base64():
    import base64

    import numpy as np

    from gnosis_daemon.protocol import pack_array

    matrix = np.array([[0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    result = {"embeddings": pack_array(matrix), "dim": 2, "num_tokens": [3, 4]}
    req = embeddings.parse({"input": ["a", "b"]})
    assert embeddings.response(req, "m", result) == {
        "object": "list", "model": "m",
        "data": [{"object": "embedding", "index": 0, "embedding": [float(np.float32(0.6)),
                                                                     float(np.float32(0.8))]},
                 {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}],
        "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    b64 = embeddings.response(embeddings.parse({"input": ["a", "b"],
                                                "encoding_format": "base64"}), "m", result)
    raw = base64.b64decode(b64["data"][1]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == [1.0, 0.0]
    with pytest.raises(ApiError) as info:
        embeddings.response(embeddings.parse({"input": "a"}), "m", result)  # 2 rows for 1 input
    assert info.value.status == 500


@pytest.mark.parametrize("flags, match", [
    ({"generate": True, "kv_session": True, "kv_session_match": True}, True),
    ({"generate": True, "kv_session": True}, False),  # saves; a miss says why it cannot load
])
def test_the_liquid_call_is_the_native_call_plus_session_arguments(flags, match):
    from host.liquid_memory import LiquidMemory

    memory = LiquidMemory(True)
    memory.negotiated = negotiated(flags)
    native = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    prepared = memory.prepare(native, tenant="t1", name=None)
    ids = save_ids("t1", (("messages", native["messages"]),), None)
    assert prepared.args.pop("save_final_session").startswith("t1.c.")
    expected = {**native, "tenant": "t1", "save_session": ids.save_session}
    if match:
        expected["match_session"] = True
    assert prepared.args == expected and prepared.match is match and prepared.liquid
    memory.env_enabled = False
    off = memory.prepare(native, tenant="t1", name=None)
    assert off.args == {**native, "tenant": "t1"} and not off.liquid
    assert off.fixed.liquid_memory == "disabled"


def test_the_generate_frame_is_written_by_the_wire_definition():
    """What the host sends is ``GenerateArgs``' own form of its args: the same fields the
    station reads (defaults left out), and a breach is the station's ``bad_request``."""
    from gnosis_daemon.client import StationError
    from host.liquid_memory import Prepared

    args = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.0,
            "top_p": 1.0, "stop": ["\n\n", ""], "logit_bias": {"5": 1.5}, "n": 2, "logprobs": 3,
            "tenant": "t", "save_session": "s1", "save_final_session": "s2", "match_session": True}
    assert Prepared(args, None).frame() == {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stop": ["\n\n"],
        "temperature": 0.0, "logit_bias": {5: 1.5}, "n": 2, "logprobs": 3, "tenant": "t",
        "save_session": "s1", "save_final_session": "s2", "match_session": True}
    with pytest.raises(StationError) as caught:
        Prepared({"prompt": "hi", "presence_penalty": 3.0}, None).frame()
    assert (caught.value.code, caught.value.message) == (
        "bad_request", "argument 'presence_penalty' must be in [-2, 2]")
