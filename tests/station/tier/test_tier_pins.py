"""TTL pins and the disk tier, on the tiny model: a pin comes back after a restart within its
TTL (its manifest keeps the expiry) and is read back; one that expires leaves the disk,
whether the station is up or down then; the disk budget passes over a live pin; a deleted
session's files go, blocks another session names stay."""

from __future__ import annotations

import json
import time

import pytest

from gnosis_daemon.wire import Pin
from station.core.pins import PinPlan
from station.core.requests import GenerationRequest, Prefill, SamplingParams, Sessions
from station.engine.calls import EngineCalls
from station.tier.format import session_name
from tests.station.engine.test_paged_engine import Collector, prompt_of, reference
from tests.station.tier.test_disk_tier import TierEngine, tier_model
from tests.station.tier.test_disk_tier_io import wait_for
from tests.support.kv_tier import tier_dir

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tier_model(tmp_path_factory)


def pinned(t: TierEngine, prompt, name: str, ttl_s: float, n: int = 3, **sessions) -> Collector:
    """A greedy request of alice pinning its whole prompt as ``name``, its write on disk."""
    t.n += 1
    collector = Collector()
    plan = PinPlan(name, ttl_s, len(prompt))
    t.engine.add_request(GenerationRequest(
        f"r{t.n}", list(prompt), SamplingParams(max_tokens=n, temperature=0.0),
        Sessions(tenant="alice", pins=(Pin(session_id=name, ttl_s=ttl_s),), **sessions),
        pins=(plan,)), collector)
    collector.wait()
    t.expected_writes += 1
    t.settle()
    return collector


def manifest(root, name: str) -> dict:
    """The JSON header of a session's manifest (magic, version, header length, header)."""
    data = (root / "sessions" / session_name(name)).read_bytes()
    length = int.from_bytes(data[10:14], "little")
    return json.loads(data[14:14 + length])


def test_a_pin_survives_a_restart_within_its_ttl_and_is_read_back(tiny, tmp_path):
    path, loaded = tiny
    state, prompt, more = tmp_path / "state", prompt_of(1, 22), prompt_of(2, 5)
    root = tier_dir(state, loaded.fingerprint)
    with TierEngine(loaded, state, 64) as t:
        pinned(t, prompt, "alice.pin", 600.0)
        expires_at = t.engine.kv.pins.get("alice.pin").expires_at
        t.generate(prompt_of(3, 22), 3, save_session="alice.plain")
    header = manifest(root, "alice.pin")
    assert (header["expires_at"], header["ttl_s"]) == (expires_at, 600.0)
    assert "expires_at" not in manifest(root, "alice.plain")
    with TierEngine(loaded, state, 64) as t:
        kv = t.engine.kv
        assert t.report["start_sessions"] == 2 and kv.pins.ids() == ["alice.pin"]
        assert kv.pins.get("alice.pin").expires_at == expires_at
        done = {}
        t.engine.call(EngineCalls.kv_list, "c", lambda r, e: done.update(r=r), tenant="alice")
        wait_for(lambda: "r" in done, "the listing")
        assert sorted((s["session_id"], s["tier"], s["pinned"], s["ttl_s"], s["expires_at"])
                      for s in done["r"]["sessions"]) == [
            ("alice.pin", "disk", True, 600.0, expires_at),
            ("alice.plain", "disk", False, None, None)]
        again = pinned(t, prompt + more, "alice.pin", 600.0, n=4, match_session=True)
        pre = again.one(Prefill)
        assert (pre.session_loaded, pre.session_id, pre.session_tier) == (True, "alice.pin", "disk")
        [report] = pre.pins
        # Read back into the pool, its 5 blocks served the prompt: 20 tokens read from the pin.
        assert (report.read_tokens, report.num_tokens, report.pinned) == (20, 24, True)
        assert again.tokens == reference(path, prompt + more, 4)


def test_an_expired_pin_leaves_the_disk_while_serving_and_across_a_restart(tiny, tmp_path):
    _, loaded = tiny
    state = tmp_path / "state"
    root = tier_dir(state, loaded.fingerprint)

    def manifests() -> set[str]:
        return {p.name for p in (root / "sessions").iterdir()}

    with TierEngine(loaded, state, 64) as t:
        pinned(t, prompt_of(4, 20), "alice.short", 1.0)
        assert manifests() == {session_name("alice.short")}
        # No request needed: the engine wakes at the expiry and deletes it, files too.
        wait_for(lambda: not manifests(), "the expired manifest to go")
        assert "alice.short" not in t.engine.kv.sessions and "alice.short" not in t.engine.kv.disk
        wait_for(lambda: not list((root / "blocks").rglob("*.kvb")), "its blocks to go")
        assert t.engine.stats()["kv_pins_expired"] == 1
        # This one runs out while the station is down (a clean stop keeps it till then).
        pinned(t, prompt_of(5, 20), "alice.down", 3.0)
        expires_at = t.engine.kv.pins.get("alice.down").expires_at
    assert manifests() == {session_name("alice.down")}
    time.sleep(max(0.0, expires_at - time.time()) + 0.1)
    with TierEngine(loaded, state, 64) as t:
        assert t.report["start_sessions"] == 0 and not t.engine.kv.pins.ids()
        assert not manifests() and not list((root / "blocks").rglob("*.kvb"))


def test_the_disk_budget_passes_over_a_live_pin_and_delete_removes_the_files(tiny, tmp_path):
    _, loaded = tiny
    prompts = {name: prompt_of(1300 + i, 23) for i, name in enumerate("ABCD")}
    with TierEngine(loaded, tmp_path / "probe", 64) as t:  # the bytes one session takes on disk
        t.generate(prompts["A"], 2, save_session="alice.A")
        t.expected_writes = 1
        t.settle()
        one = t.engine.stats()["disk_bytes"]
    state = tmp_path / "state"
    root = tier_dir(state, loaded.fingerprint)
    with TierEngine(loaded, state, 64, kv_disk_bytes=int(2.5 * one)) as t:
        pinned(t, prompts["A"], "alice.A", 600.0, n=2)  # the oldest: the LRU victim, but pinned
        for name in "BC":
            t.generate(prompts[name], 2, save_session=f"alice.{name}")
            t.expected_writes += 1
            t.settle()
        assert t.engine.stats()["disk_evicted_sessions"] == 1
        assert {p.name for p in (root / "sessions").iterdir()} == {
            session_name("alice.A"), session_name("alice.C")}  # B went, not the pin
        # A session sharing the pin's first 3 blocks (C goes for it): deleting the pin leaves
        # those files.
        t.generate(prompts["A"][:12] + prompts["D"], 2, save_session="alice.D")
        t.expected_writes += 1
        t.settle()
        assert t.engine.stats()["disk_evicted_sessions"] == 2
        pin_files = {h.hex() for h in t.engine.kv.sessions.get("alice.A").file_hashes}
        d_files = {h.hex() for h in t.engine.kv.sessions.get("alice.D").file_hashes}
        assert len(pin_files & d_files) == 3
        done = {}
        t.engine.call(EngineCalls.kv_delete, "c", lambda r, e: done.update(r=r, e=e),
                      session_id="alice.A", tenant="alice")
        wait_for(lambda: "r" in done, "the delete")
        assert done["r"] == {"deleted": True}
        wait_for(lambda: not (root / "sessions" / session_name("alice.A")).exists(),
                 "the pin's manifest to go")
        assert {p.name for p in (root / "sessions").iterdir()} == {session_name("alice.D")}
        # The blocks D shares with A stayed; A's own two went.
        wait_for(lambda: {p.stem for p in (root / "blocks").rglob("*.kvb")} == d_files,
                 "the pin's own blocks to go")
