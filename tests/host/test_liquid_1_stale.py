"""A stale station (kv_session, decode_next and embed disabled) under one long-lived host.

The failure this project exists to prevent: a host that assumes station ops it does not
have. Here the host must learn by probing that kv_session is missing, say so in /health and
in every response, serve on the native path at full function, and then, when the station is
replaced by one that has kv_session (same runtime dir, SAME host process), turn liquid
memory on by itself. The stack (tests/host/conftest.py ``liquid_stack``) is shared with
test_liquid_2_paths, which goes on with the replaced station. A second host with
THOTH_LIQUID_MEMORY=0 stays off, and says why.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from gnosis_daemon.client import open_station_client
from host.capabilities import negotiate
from tests.host.conftest import STALE_DISABLE
from tests.host.liquid_support import (
    metric,
    post,
    stream_chat,
    wait_health,
)
from tests.support.tiny_models import reference_generate

MAX_TOKENS = 12
MESSAGES = [{"role": "system", "content": "You answer in one short line, always politely."},
            {"role": "user", "content": "Which colour is the sky on a clear day?"}]
KV_REASON = "station lacks the kv_session capability (unknown_op on probe)"
ENV_REASON = "disabled by THOTH_LIQUID_MEMORY=0"


@pytest.fixture(scope="module")
def stale(liquid_stack):
    """The shared stack with a stale station (this module runs before test_liquid_2_paths)."""
    return liquid_stack.use_station(STALE_DISABLE)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                               tokenize=True)["input_ids"]
    ref_ids = reference_generate(tiny_llama, prompt_ids, MAX_TOKENS)
    return tokenizer.decode(ref_ids, skip_special_tokens=True), len(prompt_ids), len(ref_ids)


def chat_body(**extra):
    return {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def test_health_says_liquid_memory_is_off_and_why(stale):
    health = wait_health(stale.url, stale.host, stale.station.pid)
    assert (health["liquid_memory"], health["liquid_memory_env"],
            health["station_kv_session"], health["liquid_memory_reason"]) == \
        (False, True, False, KV_REASON)
    caps, learned = health["station_capabilities"], health["station_capabilities_learned"]
    # The stale station omits the disabled flags: the host probed each and got unknown_op.
    assert {k: caps[k] for k in ("kv_session", "decode_next", "embed")} == \
        {"kv_session": False, "decode_next": False, "embed": False}
    assert {k: learned[k] for k in ("kv_session", "decode_next", "embed", "generate")} == \
        {"kv_session": "probe", "decode_next": "probe", "embed": "probe", "generate": "flag"}
    assert caps["generate"] is True


def test_requests_take_the_native_path_and_say_why(stale, reference):
    ref_text, prompt_tokens, completion_tokens = reference
    before = metric(stale.url, "disabled")
    resp = post(stale.url, "/v1/chat/completions", chat_body(user="someone"), api_key="k1")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["message"]["content"] == ref_text
    assert (resp.headers["X-Thoth-Liquid-Memory"], resp.headers["X-Thoth-Liquid-KV-Saved"]) == \
        ("disabled", "false")
    gnosis = body["_gnosis"]
    assert {k: gnosis[k] for k in ("liquid_memory", "liquid_kv_saved", "liquid_miss_reason",
                                   "path", "prompt_tokens", "completion_tokens")} == {
        "liquid_memory": "disabled", "liquid_kv_saved": False, "liquid_miss_reason": KV_REASON,
        "path": "native", "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == gnosis["cached_tokens"]

    head, events = stream_chat(stale.url, chat_body(stream_options={"include_usage": True}))
    assert (head["X-Thoth-Liquid-Memory"], head["X-Thoth-Liquid-KV-Saved"]) == \
        ("disabled", "false")
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if e["choices"])
    assert text == ref_text
    last = events[-2]
    assert last["_gnosis"]["liquid_memory"] == "disabled"
    assert last["_gnosis"]["liquid_miss_reason"] == KV_REASON
    assert all("_gnosis" not in e for e in events[:-2])
    assert metric(stale.url, "disabled") == before + 2


def test_embeddings_without_the_embed_capability_is_a_clear_501(stale):
    resp = post(stale.url, "/v1/embeddings", {"input": "hello"})
    assert resp.status_code == 501
    assert resp.json() == {"error": {
        "message": "The model station does not support embeddings (capability embed).",
        "type": "invalid_request_error", "param": None, "code": "embeddings_not_supported"}}
    # The host keeps serving.
    assert post(stale.url, "/v1/chat/completions", chat_body()).status_code == 200


def test_env_off_host_is_disabled_whatever_the_station(stale, reference):
    health = wait_health(stale.url_off, stale.host_off, stale.station.pid)
    assert (health["liquid_memory"], health["liquid_memory_env"]) == (False, False)
    assert health["liquid_memory_reason"] == f"{ENV_REASON}; {KV_REASON}"
    resp = post(stale.url_off, "/v1/chat/completions", chat_body())
    body = resp.json()
    assert body["choices"][0]["message"]["content"] == reference[0]
    assert (body["_gnosis"]["liquid_memory"], body["_gnosis"]["path"]) == ("disabled", "native")
    assert body["_gnosis"]["liquid_miss_reason"].startswith(ENV_REASON)
    assert resp.headers["X-Thoth-Liquid-Memory"] == "disabled"


async def test_negotiation_trusts_flags_and_probes_absent_ones(stale):
    async with open_station_client(stale.socket) as conn:
        # Every flag absent: each op is probed on the real station.
        probed = await negotiate(conn, {"capabilities": {}})
        assert {k: probed.flags[k] for k in ("generate", "kv_session", "decode_next", "embed")} \
            == {"generate": True, "kv_session": False, "decode_next": False, "embed": False}
        assert set(probed.learned.values()) == {"probe"}
        # Explicit flags are trusted as given, true or false, with no probe.
        trusted = await negotiate(conn, {"capabilities": {"kv_session": True, "generate": False,
                                                          "decode_next": False, "forward": False,
                                                          "embed": False}})
        assert trusted.flags == {"kv_session": True, "generate": False, "decode_next": False,
                                 "forward": False, "embed": False}
        assert set(trusted.learned.values()) == {"flag"}
        assert trusted.kv_session and not trusted.decode_path


def test_a_station_that_gains_kv_session_turns_liquid_memory_on_without_a_host_restart(stale):
    """Runs last: it replaces the stale station with a full one (test_liquid_2_paths
    goes on with that one)."""
    host_pid = stale.host.pid
    stale.replace_station(None)
    # The same host reconnects and negotiates again.
    health = wait_health(stale.url, stale.host, stale.station.pid)
    assert stale.host.poll() is None and stale.host.pid == host_pid
    assert health["station_restarts"] >= 1
    assert health["station_capabilities_learned"]["generate"] == "flag"
    off = wait_health(stale.url_off, stale.host_off, stale.station.pid)
    health = wait_health(stale.url, stale.host, stale.station.pid, liquid_memory=True)
    assert (health["station_kv_session"], health["liquid_memory_reason"]) == (True, None)
    assert health["station_capabilities_learned"]["kv_session"] == "flag"
    assert (off["liquid_memory"], off["liquid_memory_reason"]) == (False, ENV_REASON)
    resp = post(stale.url, "/v1/chat/completions", chat_body())
    assert resp.json()["_gnosis"]["path"] == "liquid"
