"""``n`` choices with liquid memory on, with the official openai client: the
choices fork from one prefill, only the first choice saves the request's sessions (as many as
a one-choice request saves), and the next turn of the chat hits them."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.host.conftest import station_call
from tests.host.liquid_support import DEFAULT_KEY


@pytest.fixture(scope="module")
def full(liquid_stack):
    return liquid_stack.use_station(None, liquid_memory=True)


@pytest.fixture(scope="module")
def client(full):
    c = OpenAI(base_url=full.url + "/v1", api_key=DEFAULT_KEY, max_retries=0, timeout=60)
    c.mid = c.models.list().data[0].id
    return c


def chat(client, msgs, **extra):
    raw = client.chat.completions.with_raw_response.create(model=client.mid, messages=msgs,
                                                           max_tokens=6, **extra)
    resp = raw.parse()
    g = resp.model_extra["_gnosis"]
    assert raw.headers["X-Thoth-Liquid-Memory"] == g["liquid_memory"]
    return resp, g


def msgs(topic: str) -> list[dict]:
    # the topic leads the system prompt: no other test's sessions share its first block
    return [{"role": "system", "content": f"{topic.capitalize()}: answer with a short list."},
            {"role": "user", "content": f"Name some things about {topic}, please."}]


def sessions(full) -> int:
    return station_call(full.socket, "stats")["kv_sessions"]


def test_n4_seeded_saves_once_and_the_next_turn_hits(full, client):
    # what one request with one choice saves, on a prompt of its own
    before = sessions(full)
    _, g = chat(client, msgs("quartz"), temperature=0)
    assert g["liquid_memory"] == "miss" and g["liquid_kv_saved"]
    one_choice = sessions(full) - before
    assert one_choice >= 1

    conv = msgs("umbrellas")
    before = station_call(full.socket, "stats")
    resp, g = chat(client, conv, n=4, seed=4321, temperature=1.0)
    after = station_call(full.socket, "stats")
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in resp.choices}) == 4
    assert (g["liquid_memory"], g["liquid_kv_saved"]) == ("miss", True)
    prompt_len, bs = resp.usage.prompt_tokens, after["block_size"]
    assert resp.usage.completion_tokens == 24
    # one prefill (past what the prefix cache holds of the chat template's first tokens, sent
    # before in this tenant: reused inside a block); the prompt's blocks allocated once, each
    # choice its own last blocks
    assert 0 < g["cached_tokens"] < bs
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt_len - g["cached_tokens"]
    own = -(-(prompt_len + 5) // bs) - prompt_len // bs
    assert after["blocks_allocated"] - before["blocks_allocated"] == prompt_len // bs + 4 * own
    # only the first choice saved: as many sessions as a one-choice request saves
    assert after["kv_sessions"] - before["kv_sessions"] == one_choice

    turn = conv + [{"role": "assistant", "content": resp.choices[0].message.content},
                   {"role": "user", "content": "And one more?"}]
    again, g = chat(client, turn, temperature=0)
    assert g["liquid_memory"] == "hit" and g["cached_tokens"] >= prompt_len - bs
    assert again.usage.prompt_tokens_details.cached_tokens == g["cached_tokens"] > 0
    # the same seeded request again: the same four choices (now from the saved prompt)
    same, g = chat(client, conv, n=4, seed=4321, temperature=1.0)
    assert g["liquid_memory"] == "hit"
    assert [c.message.content for c in same.choices] == [c.message.content for c in resp.choices]


def test_named_session_with_n2_saves_once_and_hits(full, client):
    conv = msgs("xylophones")
    before = sessions(full)
    resp, g = chat(client, conv, n=2, seed=5, temperature=1.0, extra_body={"session_id": "n2"})
    saved = sessions(full) - before
    assert [c.index for c in resp.choices] == [0, 1]
    assert (g["liquid_memory"], g["liquid_kv_saved"]) == ("miss", True)
    turn = conv + [{"role": "assistant", "content": resp.choices[0].message.content},
                   {"role": "user", "content": "Why?"}]
    _, g = chat(client, turn, temperature=0, extra_body={"session_id": "n2"})
    assert g["liquid_memory"] == "hit" and g["cached_tokens"] >= resp.usage.prompt_tokens - 16
    # a named session is one id, saved once for the two choices and replaced by the next turn
    assert saved == 1 and sessions(full) - before == 1
