"""The liquid path end to end: a full station, a liquid host and a THOTH_LIQUID_MEMORY=0 host.

A prompt's first request is a ``miss`` that saves its KV; the same prompt again, and the
next turn of the chat, are ``hit``s that skip the saved prefix; greedy output is identical
on hit, miss and the native path (and equals ``model.generate``); a restarted host keeps
hitting (the station matches sessions, the host keeps no index); sessions never cross tenants.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from transformers import AutoTokenizer

from gnosis_daemon.client import open_station_client
from host.capabilities import negotiate
from tests.host.liquid_support import (
    metric,
    post,
    stream_chat,
    wait_health,
)
from tests.support.tiny_models import reference_generate

MAX_TOKENS = 10
SYSTEM = "You are a careful assistant who answers briefly."


@pytest.fixture(scope="module")
def full(liquid_stack):
    return liquid_stack.use_station(None, liquid_memory=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def block_size(full):
    async def hello():
        async with open_station_client(full.socket) as conn:
            return conn.hello

    return trio.run(hello)["kv_pool"]["block_size"]


def messages(topic: str) -> list[dict]:
    """A chat whose tokens differ from every other test's within the first KV block (the
    topic leads the system prompt; every test's topic starts with its own letter), so one
    test's saved sessions never turn another's expected miss into a hit."""
    return [{"role": "system", "content": f"{topic.capitalize()}: {SYSTEM}"},
            {"role": "user", "content": f"Tell me one fact about {topic}, please."}]


def chat(url: str, msgs: list[dict], api_key: str | None = None, **extra):
    resp = post(url, "/v1/chat/completions",
                {"messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}, api_key)
    assert resp.status_code == 200, resp.text
    return resp, resp.json()


def reference_text(tiny_llama, tokenizer, msgs) -> str:
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    return tokenizer.decode(reference_generate(tiny_llama, ids, MAX_TOKENS),
                            skip_special_tokens=True)


def outcome(resp, body) -> tuple:
    g = body["_gnosis"]
    assert resp.headers["X-Thoth-Liquid-Memory"] == g["liquid_memory"]
    assert resp.headers["X-Thoth-Liquid-KV-Saved"] == ("true" if g["liquid_kv_saved"] else "false")
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == g["cached_tokens"]
    return g["liquid_memory"], g["liquid_kv_saved"], g["liquid_miss_reason"], g["path"]


def test_health_says_liquid_memory_is_on(full):
    health = wait_health(full.url, full.host, full.station.pid, liquid_memory=True)
    assert (health["liquid_memory_env"], health["station_kv_session"],
            health["liquid_memory_reason"]) == (True, True, None)
    assert health["station_capabilities_learned"]["kv_session"] == "flag"


def test_miss_then_hit_with_identical_greedy_output(full, tiny_llama, tokenizer, block_size):
    msgs = messages("glaciers")
    ref = reference_text(tiny_llama, tokenizer, msgs)
    hits, misses = metric(full.url, "hit"), metric(full.url, "miss")
    resp, first = chat(full.url, msgs)
    assert outcome(resp, first) == ("miss", True, "no saved prefix", "liquid")
    resp, again = chat(full.url, msgs)
    assert outcome(resp, again)[:3] == ("hit", True, None)
    g = again["_gnosis"]
    assert g["cached_tokens"] >= g["prompt_tokens"] - block_size
    assert g["prompt_tokens"] == first["_gnosis"]["prompt_tokens"]
    _, native = chat(full.url_off, msgs)
    assert native["_gnosis"]["liquid_memory"] == "disabled"
    texts = {b["choices"][0]["message"]["content"] for b in (first, again, native)}
    assert texts == {ref}
    assert (metric(full.url, "hit"), metric(full.url, "miss")) == (hits + 1, misses + 1)


def test_the_next_turn_of_a_chat_is_a_hit(full, tiny_llama, tokenizer, block_size):
    msgs = messages("volcanoes")
    _, first = chat(full.url, msgs)
    answer = first["choices"][0]["message"]["content"]
    turn = msgs + [{"role": "assistant", "content": answer},
                   {"role": "user", "content": "And one more, shorter?"}]
    resp, second = chat(full.url, turn)
    assert outcome(resp, second)[:3] == ("hit", True, None)
    assert second["_gnosis"]["cached_tokens"] >= first["_gnosis"]["prompt_tokens"] - block_size
    assert second["choices"][0]["message"]["content"] == reference_text(tiny_llama, tokenizer,
                                                                        turn)


def test_streaming_headers_carry_the_outcome_and_the_last_chunk_the_block(full, tiny_llama,
                                                                            tokenizer):
    msgs = messages("rivers")
    ref = reference_text(tiny_llama, tokenizer, msgs)
    for expected in ("miss", "hit"):
        head, events = stream_chat(full.url, {"messages": msgs, "max_tokens": MAX_TOKENS,
                                              "temperature": 0})
        assert (head["X-Thoth-Liquid-Memory"], head["X-Thoth-Liquid-KV-Saved"]) == \
            (expected, "true")
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == ref
        assert events[-2]["_gnosis"]["liquid_memory"] == expected
        assert events[-2]["_gnosis"]["path"] == "liquid"
        assert all("_gnosis" not in e for e in events[:-2])


def test_sessions_never_cross_tenants_and_named_sessions_hit(full):
    msgs = messages("deserts")
    resp, body = chat(full.url, msgs, api_key="tenant-a")
    assert outcome(resp, body)[0] == "miss"
    resp, body = chat(full.url, msgs, api_key="tenant-b")
    assert outcome(resp, body)[:3] == ("miss", True, "no saved prefix")
    resp, body = chat(full.url, msgs, api_key="tenant-a")
    assert outcome(resp, body)[0] == "hit"
    named = messages("forests")
    resp, body = chat(full.url, named, api_key="tenant-a", session_id="chat-7")
    assert outcome(resp, body)[0] == "miss"
    turn = named + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Why?"}]
    resp, body = chat(full.url, turn, api_key="tenant-a", session_id="chat-7")
    assert outcome(resp, body)[0] == "hit"


def test_text_completions_use_the_liquid_path_too(full):
    body = {"prompt": "Once upon a time, in a land of many rivers and tall mountains,",
            "max_tokens": MAX_TOKENS, "temperature": 0}
    first = post(full.url, "/v1/completions", body)
    second = post(full.url, "/v1/completions", body)
    native = post(full.url_off, "/v1/completions", body)
    assert first.json()["_gnosis"]["liquid_memory"] == "miss"
    assert second.json()["_gnosis"]["liquid_memory"] == "hit"
    assert first.json()["_gnosis"]["prompt_tokens"] == native.json()["_gnosis"]["prompt_tokens"]
    assert len({r.json()["choices"][0]["text"] for r in (first, second, native)}) == 1


def test_embeddings(full):
    resp = post(full.url, "/v1/embeddings", {"input": ["a red fox", "a blue whale"]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    vectors = np.array([d["embedding"] for d in body["data"]])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    tokens = post(full.url, "/v1/embeddings", {"input": [[5, 6, 7]], "encoding_format": "base64"})
    assert tokens.status_code == 200 and isinstance(tokens.json()["data"][0]["embedding"], str)
    assert tokens.json()["usage"]["prompt_tokens"] == 3
    bad = post(full.url, "/v1/embeddings", {"input": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


async def test_probing_a_full_station_finds_kv_session_and_leaves_no_session(full):
    async with open_station_client(full.socket) as conn:
        probed = await negotiate(conn, {"capabilities": {}})
        assert probed.kv_session and probed.learned["kv_session"] == "probe"
        listed = await conn.request("kv_session.list", {})
        assert not [s for s in listed["sessions"] if s["session_id"].startswith("probe-")]


def test_a_restarted_host_still_hits(full):
    """Runs last: it replaces the liquid host."""
    msgs = messages("comets")
    _, first = chat(full.url, msgs)
    assert first["_gnosis"]["liquid_memory"] == "miss"
    full.restart_host()
    health = wait_health(full.url, full.host, full.station.pid, liquid_memory=True)
    assert health["liquid_sessions"] > 0
    resp, again = chat(full.url, msgs)
    assert outcome(resp, again)[:3] == ("hit", True, None)
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_native_path_prefix_cache_is_per_tenant(full):
    """THOTH_LIQUID_MEMORY=0: no sessions, but the automatic prefix cache is still salted with
    the tenant, so one API key's prompt never warms another's."""
    body = {"messages": [{"role": "user", "content": "native tenants " + "lorem ipsum " * 12}],
            "max_tokens": 2, "temperature": 0}
    first = post(full.url_off, "/v1/chat/completions", body, api_key="key-a").json()
    other = post(full.url_off, "/v1/chat/completions", body, api_key="key-b").json()
    again = post(full.url_off, "/v1/chat/completions", body, api_key="key-a").json()
    assert first["_gnosis"]["path"] == other["_gnosis"]["path"] == "native"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
