"""``GET /v1/sessions``, ``DELETE /v1/sessions/{id}`` and ``DELETE /v1/sessions`` on a real
station and host: a caller sees and forgets only its own tenant's sessions, a forgotten
session's files leave the disk tier and the same prompt again is a miss; and
``prompt_cache_retention: "24h"`` makes a pin listed with its expiry a day ahead."""

from __future__ import annotations

import time

import pytest

from station.tier.format import session_name
from tests.host import responses_support as rs
from tests.support.metrics import scrape, value
from tests.support.kv_tier import model_layout, tier_dir
from tests.support.procs import wait_for

KEY_C = "resp-tenant-c"  # a tenant only the forget test uses: no other session shares its blocks
PROMPT = [{"role": "user", "content": "Forget me: the launch code is seven four one one nine."}]
DAY_S = 86400


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama):
    keys = {"GNOSIS_API_KEYS": f"{rs.KEY_A},{rs.KEY_B},{KEY_C}"}
    s = rs.start(tmp_path_factory.mktemp("sessions"), tiny_llama, host_env=keys)
    yield s
    rs.stop(s)


def pins_created(stack) -> float:
    samples = scrape(stack.http("GET", "/metrics").text)
    return value(samples, "gnosis_cache_pins_total", ttl="24h", outcome="created")


def chat(stack, key: str, messages=PROMPT, **kw):
    return stack.client(key).chat.completions.create(model="tiny", messages=messages,
                                                     max_tokens=4, temperature=0, **kw)


def listed(stack, key: str) -> list[dict]:
    response = stack.http("GET", "/v1/sessions", key)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    return body["data"]


def manifests(stack, session_ids) -> list[str]:
    root = tier_dir(stack.runtime_dir / "state", model_layout(stack.model_dir, 16).fingerprint)
    return [sid for sid in session_ids if (root / "sessions" / session_name(sid)).exists()]


def test_a_caller_lists_only_its_own_sessions(stack):
    chat(stack, rs.KEY_A, [{"role": "user", "content": "A's question about rivers."}])
    chat(stack, rs.KEY_B, [{"role": "user", "content": "B's question about mountains."}])
    tenant_a, tenant_b = stack.tenant_of(rs.KEY_A), stack.tenant_of(rs.KEY_B)
    mine = listed(stack, rs.KEY_A)
    assert {s["id"] for s in mine} == {s["session_id"] for s in stack.sessions(tenant_a)}
    assert mine and all(s["id"].startswith(tenant_a + ".") for s in mine)
    assert not any(s["id"].startswith(tenant_b) for s in mine)
    entry = mine[0]
    assert set(entry) == {"id", "object", "tokens", "tier", "age_s", "expires_at", "pinned",
                          "durable", "bytes"}
    assert entry["tokens"] > 0 and entry["tier"] == "pool" and entry["pinned"] is False
    assert entry["expires_at"] is None and entry["age_s"] >= 0 and entry["bytes"] > 0


def test_another_tenants_session_is_404_and_stays(stack):
    chat(stack, rs.KEY_B, [{"role": "user", "content": "B keeps this one."}])
    theirs = listed(stack, rs.KEY_B)[0]["id"]
    response = stack.http("DELETE", f"/v1/sessions/{theirs}", rs.KEY_A)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert theirs in {s["id"] for s in listed(stack, rs.KEY_B)}
    assert stack.http("DELETE", "/v1/sessions/no-such-session", rs.KEY_A).status_code == 404


def test_a_forgotten_session_leaves_the_disk_and_the_same_prompt_again_is_a_miss(stack):
    first = chat(stack, KEY_C)
    assert first.model_extra["_gnosis"]["liquid_memory"] == "miss"
    ids = [s["id"] for s in listed(stack, KEY_C)]
    assert len(ids) == 2  # the prompt's session and prompt + answer's
    for sid in ids:
        stack.wait_durable(sid)
    assert manifests(stack, ids) == ids
    for sid in ids:
        response = stack.http("DELETE", f"/v1/sessions/{sid}", KEY_C)
        assert response.status_code == 200, response.text
        assert response.json() == {"id": sid, "object": "session", "deleted": True}
    assert listed(stack, KEY_C) == []
    wait_for(lambda: not manifests(stack, ids), 10, "the manifests removed from the disk tier")
    again = chat(stack, KEY_C)
    gnosis = again.model_extra["_gnosis"]
    assert (gnosis["liquid_memory"], gnosis["cached_tokens"]) == ("miss", 0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == first.choices[0].message.content


def test_delete_all_forgets_every_session_of_the_caller_only(stack):
    for i in range(2):
        chat(stack, rs.KEY_A, [{"role": "user", "content": f"A's note number {i}."}])
    others = {s["id"] for s in listed(stack, rs.KEY_B)}
    count = len(listed(stack, rs.KEY_A))
    assert count >= 4
    response = stack.http("DELETE", "/v1/sessions", rs.KEY_A)
    assert response.status_code == 200, response.text
    assert response.json() == {"object": "list", "deleted": count}
    assert listed(stack, rs.KEY_A) == []
    assert {s["id"] for s in listed(stack, rs.KEY_B)} == others


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_retention_24h_makes_a_pin_that_expires_a_day_ahead(stack, route):
    content = f"Keep this prompt for a day, through the {route} route, please."
    created = pins_created(stack)
    before = time.time()
    if route == "chat":
        chat(stack, rs.KEY_B, [{"role": "user", "content": content}],
             prompt_cache_retention="24h")
    else:
        stack.client(rs.KEY_B).responses.create(model="tiny", input=content, store=False,
                                                max_output_tokens=4,
                                                prompt_cache_retention="24h")
    pins = [s for s in listed(stack, rs.KEY_B) if s["pinned"]]
    assert len(pins) == 1, pins
    pin = pins[0]
    assert pin["id"].startswith(stack.tenant_of(rs.KEY_B) + ".t.")
    assert before + DAY_S - 5 <= pin["expires_at"] <= time.time() + DAY_S + 5
    assert pins_created(stack) == created + 1
    # The station's pins by TTL class: this one, its bytes those the listing gives.
    samples = scrape(stack.http("GET", "/metrics").text)
    assert value(samples, "gnosis_kv_pins", ttl="24h") == 1
    assert value(samples, "gnosis_kv_pinned_bytes", ttl="24h") == pin["bytes"] > 0
    stack.http("DELETE", f"/v1/sessions/{pin['id']}", rs.KEY_B)
    samples = scrape(stack.http("GET", "/metrics").text)
    assert value(samples, "gnosis_kv_pins", ttl="24h") == 0
    assert value(samples, "gnosis_kv_pins_expired_total", ttl="24h") == 0  # deleted, not expired
