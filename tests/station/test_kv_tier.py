"""The KV disk tier against bad and foreign files, through the station's real boot path
(``server._TorchThread``: load the tiny model, build the engine, restore, run the engine
loop) and its real clean-stop write (``persist.save_sessions``).

Every bad tier must leave a station that boots and serves, with the tier moved aside
byte for byte, counted and explained; a foreign tier must never be overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.runtime import persist
from station.core.requests import Prefill, GenerationRequest, SamplingParams
from station.runtime.persist import save_sessions
from station.main import _TorchThread
from tests.station.test_paged_engine import Collector, prompt_of, reference

BS = 4
PROMPT_A = prompt_of(501, 30)  # alice: 28 tokens pinned (7 blocks), 32 with the answer
PROMPT_B = prompt_of(502, 21)  # bob: 20 tokens pinned (5 blocks)

pytestmark = pytest.mark.usefixtures("few_threads")


class Station:
    """The station's torch side, booted in this process exactly as ``serve`` boots it."""

    def __init__(self, model: Path, state: Path, **overrides) -> None:
        overrides = {"kv_block_size": BS, "kv_cache_bytes": 256 * 1024, **overrides}
        settings = Settings(model=str(model), runtime_dir=str(state.parent / "rt"),
                            state_dir=str(state), **overrides)
        self.tier = state / "kv-sessions"
        self.torch = _TorchThread(settings, self.tier)
        self.loaded, self.engine = self.torch.boot()
        self.report = self.torch.tier_report.as_dict()
        self.n = 0

    def generate(self, prompt, n: int = 3, **session) -> Collector:
        self.n += 1
        collector = Collector()
        self.engine.add_request(GenerationRequest(
            f"r{self.n}", list(prompt), SamplingParams(max_tokens=n, temperature=0.0), **session),
            collector)
        return collector.wait()

    def sessions(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(s.session_id, s.tenant, s.token_ids) for s in self.engine.kv.sessions.sessions()]

    def stop(self, save: bool = True) -> None:
        """A clean stop, as ``serve`` does it: end the loop, then write the tier."""
        self.engine.shutdown()
        self.torch.thread.join()
        if save:
            save_sessions(self.engine, self.tier)


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or ``path`` itself) with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def aside(state: Path, kind: str) -> list[Path]:
    return sorted(state.glob(f"kv-sessions.{kind}-*"))


@pytest.fixture(scope="module")
def model(tiny_dir):
    return tiny_dir


@pytest.fixture(scope="module")
def good_tier(model, tmp_path_factory):
    """A tier written by a clean stop: alice's prompt and final sessions, bob's prompt."""
    state = tmp_path_factory.mktemp("good") / "state"
    station = Station(model, state)
    try:
        station.generate(PROMPT_A, 6, tenant="alice", save_session="a",
                         save_final_session="a-final")
        station.generate(PROMPT_B, 1, tenant="bob", save_session="b")
        sessions = station.sessions()
    finally:
        station.stop()
    assert [s[0] for s in sessions] == ["a", "a-final", "b"]
    return station.tier, sessions


@pytest.fixture
def state(tmp_path, good_tier):
    """A state dir holding a copy of the good tier."""
    state = tmp_path / "state"
    shutil.copytree(good_tier[0], state / "kv-sessions")
    return state


def edit_manifest(tier: Path, change) -> None:
    manifest = json.loads((tier / "manifest.json").read_text())
    change(manifest)
    (tier / "manifest.json").write_text(json.dumps(manifest))


def replace_kv(tier: Path, obj) -> None:
    """Put ``obj`` in kv.pt and record its digest, so the checks past the digest run."""
    torch.save(obj, tier / "kv.pt")
    digest = hashlib.sha256((tier / "kv.pt").read_bytes()).hexdigest()
    edit_manifest(tier, lambda m: m.update(kv_sha256=digest))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def stored_kv(tier: Path) -> torch.Tensor:
    return torch.load(tier / "kv.pt", weights_only=True)


def drop_digest(tier: Path) -> None:
    """A tier as the first format-1 writer left it: no num_blocks, no digest."""
    edit_manifest(tier, lambda m: (m.pop("kv_sha256"), m.pop("num_blocks")))


WHOLE_TIER_BAD = {
    "truncated kv.pt": (lambda t: truncate(t / "kv.pt"),
                        "kv.pt does not match the manifest's sha256"),
    "truncated kv.pt, tier without digest": (lambda t: (drop_digest(t), truncate(t / "kv.pt")),
                                             "kv.pt cannot be loaded"),
    "kv.pt holds a dict": (lambda t: replace_kv(t, {"kv": stored_kv(t)}),
                           "kv.pt holds a dict, not a tensor"),
    "kv.pt of the wrong shape": (lambda t: replace_kv(t, stored_kv(t)[:, :, :3]),
                                 "kv.pt has shape [2, 2, 3, 4, 2, 16], the manifest needs "
                                 "[2, 2, 13, 4, 2, 16]"),
    "kv.pt of the wrong dtype": (lambda t: replace_kv(t, stored_kv(t).half()),
                                 "kv.pt holds torch.float16"),
    "missing kv.pt": (lambda t: (t / "kv.pt").unlink(), "kv.pt is missing"),
    "garbage manifest": (lambda t: (t / "manifest.json").write_bytes(b"\x00\xff{not json"),
                         "manifest.json is not JSON"),
    "manifest of the wrong types": (lambda t: edit_manifest(t, lambda m: m.update(block_size="4")),
                                    "manifest.json: 'block_size' is missing or not a int"),
    "sessions not a list": (lambda t: edit_manifest(t, lambda m: m.update(sessions={})),
                            "manifest.json: 'sessions' is missing or not a list"),
    "tier is a file": (lambda t: (shutil.rmtree(t), t.write_bytes(b"junk")),
                       "the tier is not a directory"),
}


@pytest.mark.parametrize("case", list(WHOLE_TIER_BAD))
def test_a_bad_tier_is_moved_aside_intact_and_the_station_serves(model, state, case):
    corrupt, reason = WHOLE_TIER_BAD[case]
    tier = state / "kv-sessions"
    corrupt(tier)
    before = tree(tier)
    station = Station(model, state)
    try:
        report = station.report
        [moved] = aside(state, "rejected")
        assert report["rejected"] == 1 and report["rejections"] == [
            {"path": str(moved), "reason": report["rejections"][0]["reason"]}]
        assert reason in report["rejections"][0]["reason"]
        assert (report["restored_sessions"], report["rejected_on_disk"]) == (0, 1)
        assert not tier.exists() and tree(moved) == before  # moved, byte for byte
        assert station.sessions() == []
        served = station.generate(PROMPT_A, 4)
        assert served.tokens == reference(model, PROMPT_A, 4)
    finally:
        station.stop()
    assert tree(moved) == before  # the clean stop wrote a new tier and left it alone


def _bad_block_index(tier: Path) -> None:
    edit_manifest(tier, lambda m: m["sessions"][2].update(blocks=[999, *m["sessions"][2]["blocks"][1:]]))


def _mixed_entries(tier: Path) -> None:
    def change(m):
        m["sessions"][1]["token_ids"][3] = 100_000  # outside the vocabulary
        m["sessions"][2]["token_ids"].pop()  # 19 tokens for 5 blocks
        m["sessions"].append({"session_id": 7, "tenant": "x", "token_ids": [], "blocks": []})
    edit_manifest(tier, change)


@pytest.mark.parametrize("corrupt, restored, reasons", [
    (_bad_block_index, ["a", "a-final"],
     ["1 of 3 session entries refused", "session entry 2: block index 999 outside [0, 13)"]),
    (_mixed_entries, ["a"],
     ["3 of 4 session entries refused",
      "session entry 1: 'token_ids' is not a list of token ids in [0, 259)",
      "session entry 2: 19 tokens for 5 blocks of 4",
      "session entry 3: 'session_id' is not a non-empty string"]),
], ids=["bad block index", "good and bad entries"])
def test_good_entries_are_restored_and_the_tier_still_moved_aside(model, state, good_tier,
                                                                  corrupt, restored, reasons):
    tier = state / "kv-sessions"
    corrupt(tier)
    before = tree(tier)
    station = Station(model, state)
    try:
        report = station.report
        [moved] = aside(state, "rejected")
        assert tree(moved) == before and not tier.exists()
        assert (report["restored_sessions"], report["bad_sessions"], report["rejected"]) == (
            len(restored), len(reasons) - 1, 1)
        assert all(r in report["rejections"][0]["reason"] for r in reasons)
        assert station.sessions() == [s for s in good_tier[1] if s[0] in restored]
        follow = PROMPT_A + [1, 2, 3]
        hit = station.generate(follow, 4, tenant="alice", load_session="a")
        assert hit.one(Prefill).session_tokens == 28
        assert hit.tokens == reference(model, follow, 4)
    finally:
        station.stop()
    # The good sessions are written again by the clean stop; the rejected tier stays.
    written = json.loads((tier / "manifest.json").read_text())["sessions"]
    assert sorted(s["session_id"] for s in written) == restored
    assert tree(moved) == before


def test_a_good_tier_is_restored_and_reported(model, state, good_tier):
    station = Station(model, state)
    try:
        assert station.report == {
            "path": str(state / "kv-sessions"), "enabled": True, "restored_sessions": 3,
            "restored_blocks": 13, "skipped_sessions": 0, "bad_sessions": 0, "rejected": 0,
            "rejections": [], "foreign": None, "rejected_on_disk": 0, "foreign_on_disk": 0}
        assert station.sessions() == good_tier[1]
    finally:
        station.stop(save=False)
    assert aside(state, "rejected") == []


def test_sessions_past_the_budget_are_skipped_not_rejected(model, state, good_tier):
    before = tree(state / "kv-sessions")
    station = Station(model, state, kv_session_budget=2)
    try:
        report = station.report
        assert (report["restored_sessions"], report["skipped_sessions"], report["rejected"]) == (
            2, 1, 0)
        assert station.sessions() == good_tier[1][1:]  # the two most recently used
        assert station.engine.stats()["kv_sessions_expired"] == 0
    finally:
        station.stop(save=False)
    assert tree(state / "kv-sessions") == before


def test_a_taken_rejected_name_gets_a_suffix(model, state, monkeypatch):
    monkeypatch.setattr(persist, "_utc_stamp", lambda: "20261130T121314Z")
    (state / "kv-sessions.rejected-20261130T121314Z").mkdir()  # empty: rename would replace it
    (state / "kv-sessions.rejected-20261130T121314Z-1").write_bytes(b"older")
    (state / "kv-sessions" / "manifest.json").write_bytes(b"[")
    station = Station(model, state)
    try:
        moved = state / "kv-sessions.rejected-20261130T121314Z-2"
        assert station.report["rejections"][0]["path"] == str(moved)
        assert tree(moved)["manifest.json"] == b"["
        assert station.report["rejected_on_disk"] == 3
        assert list((state / "kv-sessions.rejected-20261130T121314Z").iterdir()) == []
        assert (state / "kv-sessions.rejected-20261130T121314Z-1").read_bytes() == b"older"
    finally:
        station.stop(save=False)


def test_a_tier_of_another_layout_is_never_overwritten(model, state):
    tier = state / "kv-sessions"
    before = tree(tier)
    station = Station(model, state, kv_block_size=8)
    try:
        foreign = station.report["foreign"]
        assert foreign["path"] == str(tier)
        assert "block_size 4 (here 8)" in foreign["reason"]
        assert station.report["rejected"] == station.report["restored_sessions"] == 0
    finally:
        station.stop()  # no session to write: the foreign tier stays where it is
    assert tree(tier) == before and aside(state, "foreign") == []

    station = Station(model, state, kv_block_size=8)
    try:
        station.generate(PROMPT_B, 1, tenant="bob", save_session="b8")
    finally:
        station.stop()  # ours is written; the foreign tier is kept under a new name first
    [kept] = aside(state, "foreign")
    assert kept.name.startswith(f"kv-sessions.foreign-{station.loaded.fingerprint[:12]}-")
    assert tree(kept) == before
    manifest = json.loads((tier / "manifest.json").read_text())
    assert manifest["block_size"] == 8 and manifest["sessions"][0]["session_id"] == "b8"

    station = Station(model, state)  # block size 4 again: today's tier is the foreign one
    try:
        assert station.report["foreign_on_disk"] == 1
        assert "block_size 8 (here 4)" in station.report["foreign"]["reason"]
    finally:
        station.stop(save=False)


def test_a_tier_of_a_later_format_is_foreign(model, state):
    tier = state / "kv-sessions"
    edit_manifest(tier, lambda m: m.update(format=2, fingerprint="later-model"))
    before = tree(tier)
    station = Station(model, state)
    try:
        assert "tier format 2; this station reads format 1" in station.report["foreign"]["reason"]
        station.generate(PROMPT_B, 1, tenant="bob", save_session="b")
    finally:
        station.stop()
    [kept] = aside(state, "foreign")
    assert kept.name.startswith("kv-sessions.foreign-latermodel-") and tree(kept) == before


def test_our_tier_with_no_session_left_is_removed(model, state):
    station = Station(model, state)
    try:
        assert station.report["restored_sessions"] == 3
        station.engine.kv.sessions.clear()  # every session expired or was deleted
    finally:
        station.stop()
    assert not (state / "kv-sessions").exists() and list(state.iterdir()) == []


def test_tier_files_are_private_from_birth(model, tmp_path):
    state = tmp_path / "state"
    station = Station(model, state)
    try:
        station.generate(PROMPT_B, 1, tenant="bob", save_session="b")
    finally:
        station.engine.shutdown()
        station.torch.thread.join()
    old = os.umask(0)  # the most permissive umask: modes come from the create calls alone
    try:
        save_sessions(station.engine, station.tier)
    finally:
        os.umask(old)
    assert stat.S_IMODE(station.tier.stat().st_mode) == 0o700
    for name in ("kv.pt", "manifest.json"):
        assert stat.S_IMODE((station.tier / name).stat().st_mode) == 0o600, name
