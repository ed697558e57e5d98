"""Pure liquid-memory policy: effective state and reasons, outcomes from the prefill event,
session planning (longest prefix, tenant isolation, LRU budget), request fields."""

from __future__ import annotations

import pytest

from host import embeddings, liquid, openai_api
from host.capabilities import Negotiated
from host.errors import ApiError
from gnosis_daemon.tokens import common_prefix_len as common_prefix
from gnosis_daemon.api_keys import tenant_key
from host.session_index import SessionIndex

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


@pytest.mark.parametrize("event, loaded, expected", [
    ({"session_loaded": True, "session_tokens": 32, "saved": True}, True,
     ("hit", True, None)),
    ({"session_loaded": True, "session_tokens": 32, "saved": False, "save_error": "x"}, True,
     ("hit", False, None)),
    ({"session_loaded": False, "session_tokens": 0, "saved": True}, False,
     ("miss", True, "no saved prefix")),
    ({"session_loaded": False, "session_tokens": 0, "session_error": "not_found",
      "saved": True}, True, ("miss", True, "not_found")),
    ({"session_loaded": True, "session_tokens": 0, "saved": True}, True,
     ("miss", True, "no reusable prefix")),
    ({"saved": False, "save_error": "capacity: no free blocks"}, False,
     ("capture_failed", False, "capacity: no free blocks")),
    # A station that ignored the save arguments: never a silent miss.
    ({"prompt_tokens": 9, "cached_tokens": 0}, False,
     ("capture_failed", False, "the station did not confirm the save")),
    (None, False, ("capture_failed", False, "the station did not confirm the save")),
])
def test_outcome_from_the_prefill_event(event, loaded, expected):
    outcome = liquid.from_prefill(event, loaded_asked=loaded, save_asked=True)
    assert (outcome.liquid_memory, outcome.liquid_kv_saved, outcome.miss_reason) == expected
    assert outcome.path == "liquid"


def test_disabled_outcome_and_telemetry_names():
    outcome = liquid.disabled("why")
    assert liquid.gnosis_block(outcome, prompt_tokens=4, completion_tokens=2, cached_tokens=0,
                               ttft_ms=1.23456, tokens_per_second=None) == {
        "liquid_memory": "disabled", "liquid_kv_saved": False, "liquid_miss_reason": "why",
        "path": "native", "cached_tokens": 0, "prompt_tokens": 4, "completion_tokens": 2,
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


def test_plan_picks_the_tenants_longest_prefix():
    index = SessionIndex(budget=8)
    index.put("a.short", "a", [1, 2, 3, 4])
    index.put("a.long", "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    index.put("a.other", "a", [9, 9, 9, 9, 9, 9])
    index.put("b.longest", "b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    plan = index.plan("a", [1, 2, 3, 4, 5, 6, 7, 0], None)
    assert (plan.load_session, plan.load_tokens, plan.tenant) == ("a.long", 7, "a")
    assert plan.save_session.startswith("a.p.") and plan.save_final_session.startswith("a.c.")
    # The same prompt saves under the same prompt id; finals are unique per request.
    again = index.plan("a", [1, 2, 3, 4, 5, 6, 7, 0], None)
    assert again.save_session == plan.save_session
    assert again.save_final_session != plan.save_final_session


def test_plan_never_crosses_tenants():
    index = SessionIndex(budget=8)
    index.put("b.s", "b", [1, 2, 3, 4, 5])
    plan = index.plan("a", [1, 2, 3, 4, 5], None)
    assert (plan.load_session, plan.load_tokens) == (None, 0)
    assert tenant_key("key-1") != tenant_key("key-2")
    assert tenant_key("key-1") == tenant_key("key-1") and len(tenant_key("key-1")) == 16
    assert tenant_key(None) == tenant_key("") == "anon"


def test_plan_skips_a_prefix_shorter_than_a_block():
    index = SessionIndex(budget=8)
    index.put("a.s", "a", [1, 2, 3, 4, 5])
    assert index.plan("a", [1, 2, 3, 4, 9], None, min_tokens=16).load_session is None
    assert index.plan("a", [1, 2, 3, 4, 9], None, min_tokens=4).load_session == "a.s"


def test_named_session_saves_prompt_and_final_under_one_id_per_tenant():
    index = SessionIndex(budget=8)
    plan = index.plan("a", [1, 2], "chat-42")
    assert plan.save_session == plan.save_final_session and ".n." in plan.save_session
    assert "chat-42" not in plan.save_session  # ids carry digests, not the caller's text
    assert index.plan("a", [3], "chat-42").save_session == plan.save_session
    assert index.plan("b", [1, 2], "chat-42").save_session != plan.save_session


def test_lru_budget_expires_the_least_recently_used():
    index = SessionIndex(budget=2)
    index.put("a.1", "a", [1, 1])
    index.put("a.2", "a", [2, 2])
    assert index.longest_prefix("a", [1, 1, 5]) == ("a.1", 2)  # a.1 is now most recent
    index.put("a.3", "a", [3, 3])
    assert len(index) == 2 and "a.2" not in index and "a.1" in index and "a.3" in index
    index.drop("a.1")
    assert "a.1" not in index and len(index) == 1


def test_replace_all_loads_the_station_list_in_lru_order():
    index = SessionIndex(budget=2)
    index.put("stale", "a", [7])
    index.replace_all([
        {"session_id": "new", "tenant": "a", "num_tokens": 2, "last_used": 30.0, "tokens": [1, 2]},
        {"session_id": "old", "tenant": "a", "num_tokens": 2, "last_used": 10.0, "tokens": [1, 3]},
        {"session_id": "mid", "tenant": "b", "num_tokens": 2, "last_used": 20.0, "tokens": [1, 4]},
        {"session_id": "empty", "tenant": "a", "num_tokens": 0, "last_used": 40.0, "tokens": []},
        {"session_id": "no-tokens", "tenant": "a", "num_tokens": 3, "last_used": 50.0},
        {"session_id": 7, "tokens": [1]}, "garbage", {"session_id": "x", "tokens": ["a"]},
    ])
    assert "stale" not in index and "old" not in index  # budget 2 keeps the newest two
    assert index.tokens("new") == (1, 2) and index.tokens("mid") == (1, 4)
    assert "empty" not in index


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
