"""API keys end to end: the official openai client against a real station and two real
hosts on it, one with a keys file (keys name tenants) and one without keys.

- with keys, a missing or wrong key is a 401 with OpenAI's body (the client raises
  ``AuthenticationError``); ``/health`` stays open;
- the key is the tenant boundary: a prompt one key made hot is a miss for another key, and a
  hit for a key the keys file puts in the same tenant;
- without keys the daemon serves one local user: every caller is one tenant, whatever
  bearer value it sends.
"""

from __future__ import annotations

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from tests.host.conftest import spawn, station_call
from tests.support.procs import free_port, http_json, stop_process, wait_for
from tests.support.tiny_models import build_tiny_model

KEYS_FILE = """\
# Two keys of one team share a tenant; sk-beta is a tenant of its own.
sk-alpha   team
sk-gamma   team
sk-beta
"""
SYSTEM = "You are the archivist of a lighthouse; answer in one short line. " * 2


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-keys")
    model = build_tiny_model(root / "tiny-llama", "llama")
    runtime_dir = root / "run"
    (root / "keys").write_text(KEYS_FILE)
    station = spawn("station", runtime_dir, root / "station.log", "--model", str(model))
    port, open_port = free_port(), free_port()
    keyed = spawn("host", runtime_dir, root / "host.log", "--port", str(port),
                  env={"GNOSIS_API_KEYS_FILE": str(root / "keys")})
    keyless = spawn("host", runtime_dir, root / "host-open.log", "--port", str(open_port))
    urls = {"keyed": f"http://127.0.0.1:{port}", "open": f"http://127.0.0.1:{open_port}"}
    try:
        for url, proc in ((urls["keyed"], keyed), (urls["open"], keyless)):
            wait_for(lambda: (h := http_json(url + "/health"))[0] == 200
                     and h[1]["station_pid"] == station.pid and h[1]["liquid_memory"], 90,
                     f"{url} /health 200 with liquid memory on", proc)
        yield urls
    finally:
        for proc in (keyed, keyless, station):
            stop_process(proc)


def client(url: str, key: str, **kwargs) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60, **kwargs)


def chat(url: str, key: str, topic: str) -> tuple[str, int]:
    """(liquid outcome header, cached_tokens) of one greedy chat completion."""
    openai = client(url, key)
    raw = openai.chat.completions.with_raw_response.create(
        model=openai.models.list().data[0].id, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": f"{topic}: {SYSTEM}"},
                  {"role": "user", "content": f"What happened to the {topic}?"}])
    usage = raw.parse().usage
    return raw.headers["X-Thoth-Liquid-Memory"], usage.prompt_tokens_details.cached_tokens


MISSING = "You didn't provide an API key. You need to provide your API key in an Authorization " \
          "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."


def test_a_missing_or_wrong_key_is_401_for_the_openai_client(hosts):
    url = hosts["keyed"]
    for call in (lambda c: c.models.list(),
                 lambda c: c.chat.completions.create(
                     model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1),
                 lambda c: c.completions.create(model="m", prompt="hi", max_tokens=1),
                 lambda c: c.embeddings.create(model="m", input="hi")):
        with pytest.raises(AuthenticationError) as wrong:
            call(client(url, "sk-alph"))
        assert wrong.value.status_code == 401
        assert wrong.value.body == {"message": "Incorrect API key provided.",
                                    "type": "invalid_request_error", "param": None,
                                    "code": "invalid_api_key"}
        # A client that sends no bearer key at all.
        with pytest.raises(AuthenticationError) as missing:
            call(client(url, "unused", default_headers={"Authorization": "Basic Zm9vOmJhcg=="}))
        assert missing.value.body == {"message": MISSING, "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert (r.status_code, r.headers["WWW-Authenticate"], r.json()["error"]["message"]) == \
        (401, "Bearer", MISSING)


def test_health_is_open_by_default(hosts):
    status, health = http_json(hosts["keyed"] + "/health")
    assert (status, health["status"]) == (200, "ok")


def test_the_key_is_the_tenant_boundary(hosts):
    url = hosts["keyed"]
    assert chat(url, "sk-alpha", "harbour") == ("miss", 0)
    outcome, cached = chat(url, "sk-alpha", "harbour")
    assert outcome == "hit" and cached > 0
    # Another tenant sending the same prompt learns nothing of it: a miss, nothing cached.
    assert chat(url, "sk-beta", "harbour") == ("miss", 0)
    # A key the keys file puts in the same tenant shares its cache.
    outcome, cached = chat(url, "sk-gamma", "harbour")
    assert outcome == "hit" and cached > 0


def test_without_keys_all_callers_share_one_tenant(hosts):
    url = hosts["open"]
    assert chat(url, "someone", "lantern") == ("miss", 0)
    outcome, cached = chat(url, "someone-else", "lantern")
    assert outcome == "hit" and cached > 0
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": f"lantern: {SYSTEM}"},
                     {"role": "user", "content": "What happened to the lantern?"}]})
    assert r.headers["X-Thoth-Liquid-Memory"] == "hit"


def test_a_flooding_tenant_does_not_evict_another_tenants_named_session(tmp_path):
    """Two tenants on a station whose session budget is 8 (share 0.5: 4 each before a
    tenant's own sessions go first). beta floods 12 distinct prompts (each pins two
    sessions); team's named conversation still hits, and the station counts the flood's
    expiries as over-share ones."""
    model = build_tiny_model(tmp_path / "tiny-llama", "llama")
    runtime_dir = tmp_path / "run"
    (tmp_path / "keys").write_text(KEYS_FILE)
    station = spawn("station", runtime_dir, tmp_path / "station.log", "--model", str(model),
                    env={"GNOSIS_KV_SESSION_BUDGET": "8"})
    port = free_port()
    host = spawn("host", runtime_dir, tmp_path / "host.log", "--port", str(port),
                 env={"GNOSIS_API_KEYS_FILE": str(tmp_path / "keys")})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: (h := http_json(url + "/health"))[0] == 200 and h[1]["liquid_memory"],
                 90, "/health 200 with liquid memory on", host)

        def named(key: str, text: str) -> httpx.Response:
            r = httpx.post(url + "/v1/chat/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"max_tokens": 2, "temperature": 0, "session_id": "conv-1",
                                 "messages": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": text}]})
            assert r.status_code == 200, r.text
            return r

        assert named("sk-alpha", "first turn").headers["X-Thoth-Liquid-Memory"] == "miss"
        sock = runtime_dir / "station.sock"

        def sessions_of(tenant: str) -> set[str]:
            listed = station_call(sock, "kv_session.list")["sessions"]
            return {s["session_id"] for s in listed if s["tenant"] == tenant}

        team = sessions_of("team")
        assert team
        for i in range(12):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           headers={"Authorization": "Bearer sk-beta"},
                           json={"prompt": f"flood {i}: " + "the tide rolls in " * 8,
                                 "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
        again = named("sk-gamma", "first turn")  # same tenant (team), same conversation
        assert again.headers["X-Thoth-Liquid-Memory"] == "hit"
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # Every session team held before the flood is still there; beta paid for its own.
        assert team <= sessions_of("team")
        stats = station_call(sock, "stats")
        assert stats["kv_sessions"] == 8
        assert stats["kv_sessions_expired_over_share"] == 12 * 2 - (8 - len(team))
    finally:
        for proc in (host, station):
            stop_process(proc)
