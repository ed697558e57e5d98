"""The disk tier behind the KV pool, on the tiny model: sessions that outgrow the pool come
back from disk as hits with ``model.generate``'s exact greedy output; a restart finds
them again without loading them; a bad file is quarantined and the request is a miss;
another model's station on the same state dir keeps to its own directory, and never
reads, evicts or deletes a file of this model's tier."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gnosis_daemon.settings import Settings
from station.core.requests import Finished, GenerationRequest, Prefill, SamplingParams, Sessions
from station.engine.loop import PagedEngine
from station.tier.start import open_tier, tier_report
from station.model.loader import load_model
from tests.support.kv_tier import tier_dir, tree
from tests.support.tiny_models import build_tiny_model
from tests.station.engine.test_paged_engine import Collector, prompt_of, reference

BS = 4
pytestmark = pytest.mark.usefixtures("few_threads")


def generate(engine: PagedEngine, request_id: str, prompt, n: int, tenant: str = "alice",
             **kwargs) -> Collector:
    """One greedy request of ``tenant``, to its end (``kwargs``: the session arguments)."""
    collector = Collector()
    engine.add_request(GenerationRequest(
        request_id, list(prompt), SamplingParams(max_tokens=n, temperature=0.0),
        Sessions(tenant=tenant, **kwargs)), collector)
    return collector.wait()


class TierEngine:
    """A ``PagedEngine`` with the disk tier, opened as the station opens it."""

    def __init__(self, loaded, state, num_blocks: int, block_size: int = BS, io=None,
                 **overrides) -> None:
        self.bs = block_size
        self.settings = Settings(model=loaded.path, runtime_dir=str(state.parent / "rt"),
                                 state_dir=str(state), kv_block_size=block_size, **overrides)
        self.engine = PagedEngine(loaded, self.settings, num_blocks=num_blocks)
        self.report = open_tier(self.engine, self.settings, io)
        self.n = 0

    def __enter__(self) -> TierEngine:
        self.engine.start()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.shutdown()  # flushes the write-behind, stops the tier's I/O process

    def generate(self, prompt, n: int, **kwargs) -> Collector:
        self.n += 1
        return generate(self.engine, f"r{self.n}", prompt, n, **kwargs)

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until every saved session is on disk (the write-behind is idle): its
        ``expected_writes``-th session write answered. (``stats()``'s ``disk_writes`` counts
        the store's file writes, blocks too, and ``write_behind_queued`` drops as the writer
        takes a job, before it is written: neither tells that a session is on disk.)"""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if stats["write_behind_queued"] == 0 and not self.engine.kv.to_write and \
                    self.engine.tier.figures.writes >= self.expected_writes:
                return
            time.sleep(0.02)
        raise AssertionError(f"write-behind did not settle: {self.engine.stats()}")

    expected_writes = 0

    def save_each(self, prompts, name: str, n: int, **kwargs) -> list[list[int]]:
        """Each prompt saved as session ``{name}.{i}``, on disk before the next; -> outputs."""
        outputs = []
        for i, prompt in enumerate(prompts):
            outputs.append(self.generate(prompt, n, save_session=f"{name}.{i}", **kwargs).tokens)
            self.expected_writes += 1
            self.settle()
        return outputs

    def hit_each(self, path, prompts, name: str, n: int, first) -> list[str]:
        """Each prompt again: a hit on session ``{name}.{i}`` (its full blocks), with the
        first output, which is ``model.generate``'s; -> the tier each hit came from."""
        tiers = []
        for i, prompt in enumerate(prompts):
            again = self.generate(prompt, n, match_session=True)
            pre = again.one(Prefill)
            assert (pre.session_loaded, pre.session_id, pre.session_tokens) == (
                True, f"{name}.{i}", len(prompt) // self.bs * self.bs), (i, pre)
            assert again.tokens == first[i] == reference(path, prompt, n), i
            tiers.append(pre.session_tier)
        return tiers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tier_model(tmp_path_factory)


def tier_model(tmp_path_factory):
    """The tiny llama and its ``load_model`` (for a module's ``tiny`` fixture)."""
    path = build_tiny_model(tmp_path_factory.mktemp("tier") / "llama", "llama")
    return path, load_model(Settings(model=str(path),
                                     runtime_dir=str(tmp_path_factory.mktemp("rt"))))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another tiny model (qwen2): the same KV shape as ``tiny``'s, another fingerprint."""
    path = build_tiny_model(tmp_path_factory.mktemp("tier-other") / "qwen2", "qwen2")
    return path, load_model(Settings(model=str(path),
                                     runtime_dir=str(tmp_path_factory.mktemp("rt"))))


def test_sessions_ten_times_the_pool_come_back_from_disk(tiny, tmp_path):
    path, loaded = tiny
    num_blocks = 24  # 96 tokens of KV
    prompts = [prompt_of(700 + i, 23) for i in range(48)]  # 5 full blocks saved each: 240 blocks
    with TierEngine(loaded, tmp_path / "state", num_blocks) as t:
        first = t.save_each(prompts, "alice.p", 4, match_session=True)
        stats = t.engine.stats()
        assert stats["kv_sessions_offloaded"] > 0 and stats["kv_sessions_lost"] == 0
        assert stats["kv_disk_sessions"] + stats["kv_sessions"] == len(prompts)
        tiers = t.hit_each(path, prompts, "alice.p", 4, first)
        assert tiers.count("disk") >= 40  # the pool holds at most 4 of these sessions
        assert t.engine.stats()["kv_disk_loads"] == tiers.count("disk")


def test_a_restart_finds_the_sessions_without_loading_them(tiny, tmp_path):
    path, loaded = tiny
    prompts = [prompt_of(800 + i, 23) for i in range(6)]
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        for i, prompt in enumerate(prompts):
            t.generate(prompt, 3, save_session=f"alice.p.{i}")
    # A clean stop flushed the write-behind; the new engine reads only the manifests.
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        assert t.report["start_sessions"] == len(prompts) and t.report["error"] is None
        assert t.engine.kv.pool.num_held_blocks == 0 and len(t.engine.kv.disk) == len(prompts)
        hit = t.generate(prompts[3] + prompt_of(9, 5), 6, match_session=True)
        pre = hit.one(Prefill)
        assert (pre.session_loaded, pre.session_id, pre.session_tier) == (True, "alice.p.3", "disk")
        assert hit.tokens == reference(path, prompts[3] + prompt_of(9, 5), 6)
        assert hit.one(Finished).cached_tokens == 20


def test_a_corrupt_block_file_is_quarantined_and_the_request_is_a_miss(tiny, tmp_path):
    path, loaded = tiny
    prompt = prompt_of(900, 23)
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        t.generate(prompt, 3, save_session="alice.p.x")
    root = tier_dir(tmp_path / "state", loaded.fingerprint)
    blocks = sorted((root / "blocks").rglob("*.kvb"))
    assert len(blocks) == 5
    data = bytearray(blocks[2].read_bytes())
    data[len(data) // 2] ^= 0x40
    blocks[2].write_bytes(bytes(data))
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        miss = t.generate(prompt, 6, match_session=True)
        pre = miss.one(Prefill)
        assert (pre.session_loaded, pre.session_error, pre.cached_tokens) == (False, "quarantined", 0)
        assert miss.tokens == reference(path, prompt, 6)
        stats = t.engine.stats()
        assert stats["kv_disk_quarantined_loads"] == 1 and stats["disk_quarantined"] == {"checksum": 1}
        quarantined = list((root / "quarantine").iterdir())
        assert len(quarantined) == 1 and quarantined[0].read_bytes() == bytes(data)


def test_another_models_station_never_touches_this_models_tier(tiny, other, tmp_path):
    path, loaded = tiny
    _, b_loaded = other
    state = tmp_path / "state"
    ours, theirs = tier_dir(state, loaded.fingerprint), tier_dir(state, b_loaded.fingerprint)
    assert ours != theirs and ours.parent == theirs.parent == state / "kv-tier"
    prompts = [prompt_of(1000 + i, 23) for i in range(6)]  # 5 full blocks saved each
    with TierEngine(loaded, state, 64) as t:
        first = [t.generate(prompt, 4, save_session=f"alice.p.{i}").tokens
                 for i, prompt in enumerate(prompts)]
        t.expected_writes = len(prompts)
        t.settle()
        # All six on disk, all six still in the pool: none is on disk only.
        report = tier_report(t.report, t.engine.stats())
        assert (report["path"], report["pool_sessions"], report["disk_sessions"],
                report["disk_only_sessions"]) == (str(ours), 6, 6, 0)
    before = tree(ours)
    assert sorted(name.rsplit(".", 1)[-1] for name in before if name.endswith((".kvb", ".kvs"))) \
        == ["kvb"] * 30 + ["kvs"] * 6

    # Model B, same state dir, the same session ids and prompts, a disk budget of about
    # two sessions: every save runs eviction, and it evicts (B's own sessions).
    with TierEngine(b_loaded, state, 64, kv_disk_bytes=30_000) as t:
        assert (t.report["path"], t.report["start_sessions"], t.report["start_quarantined"],
                t.report["error"]) == (str(theirs), 0, 0, None)
        for i, prompt in enumerate(prompts):
            assert t.generate(prompt, 4, save_session=f"alice.p.{i}").one(Prefill).saved
            t.expected_writes = i + 1
            t.settle()
        stats = t.engine.stats()
        assert stats["disk_evicted_sessions"] > 0 and stats["disk_evicted_blocks"] > 0
        assert stats["disk_quarantined_total"] == 0 and stats["disk_reads"] == 0
    assert sorted(p.name for p in (state / "kv-tier").iterdir()) == sorted([ours.name, theirs.name])
    assert list((theirs / "sessions").glob("*.kvs"))  # B's tier is in its own directory
    assert tree(ours) == before  # not one file of A's read into quarantine, evicted, rewritten

    # Model A again: every session is there, on disk only, and a hit with the same output.
    with TierEngine(loaded, state, 64) as t:
        assert (t.report["path"], t.report["start_sessions"], t.report["start_quarantined"],
                t.report["start_incomplete"], t.report["error"]) == (str(ours), 6, 0, 0, None)
        report = tier_report(t.report, t.engine.stats())
        assert (report["pool_sessions"], report["disk_sessions"],
                report["disk_only_sessions"]) == (0, 6, 6)
        for i, prompt in enumerate(prompts):
            again = t.generate(prompt, 4, match_session=True)
            pre = again.one(Prefill)
            assert (pre.session_loaded, pre.session_id, pre.session_tier, pre.session_tokens) == (
                True, f"alice.p.{i}", "disk", 20), (i, pre)
            assert again.tokens == first[i], i
        assert first[0] == reference(path, prompts[0], 4)
        stats = t.engine.stats()
        assert (stats["kv_disk_loads"], stats["disk_quarantined_total"]) == (6, 0)


def test_an_evicted_session_whose_blocks_are_still_cached_is_a_pool_hit(tiny, tmp_path):
    """A durable session expired to the disk tier leaves its freed blocks in the prefix
    cache: asked again (matched, or by name), it is loaded from those, a hit from the pool
    with nothing read back, not a miss that happens to find the same KV cached."""
    path, loaded = tiny
    prompts = [prompt_of(950 + i, 23) for i in range(2)]
    with TierEngine(loaded, tmp_path / "state", 64, kv_session_budget=1) as t:
        first = t.save_each(prompts, "alice.p", 4)  # the second save expires the first to disk
        stats = t.engine.stats()
        assert (stats["kv_sessions"], stats["kv_disk_sessions"], stats["kv_sessions_offloaded"]) == (1, 1, 1)
        matched = t.generate(prompts[0], 4, match_session=True)
        named = t.generate(prompts[0] + prompt_of(9, 3), 4, load_session="alice.p.0")
        # The session's 20 tokens, then the first run's block 5 (3 prompt tokens, 1 answer
        # token): all 3, with the logits it kept after them (matched), or all 3 it shares
        # (named, a longer prompt).
        for got, prompt, cached in ((matched, prompts[0], 23), (named, prompts[0] + prompt_of(9, 3), 23)):
            pre = got.one(Prefill)
            assert (pre.session_loaded, pre.session_id, pre.session_tokens, pre.session_tier,
                    pre.session_error) == (True, "alice.p.0", 20, "pool", None), pre
            assert got.one(Finished).cached_tokens == cached
            assert got.tokens == reference(path, prompt, 4)
        assert matched.tokens == first[0]
        assert t.engine.stats()["kv_disk_loads"] == 0
        # the disk's LRU heard: the touch goes to the I/O process and is counted when it
        # answers, which on a busy machine may be after the request has ended
        deadline = time.monotonic() + 20
        while t.engine.tier.figures.touches < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.engine.tier.figures.touches >= 1


def test_a_shared_tier_serves_a_conversation_another_replica_saved(tiny, tmp_path):
    """Two replicas (two engines, each with its own state dir) on one shared tier: a session
    replica a saves is found by replica b's rescan and read back from the shared files, a
    disk hit with ``model.generate``'s output; a manifest removed behind b's back (another
    replica's eviction) leaves b's index at the next look."""
    from station.tier.format import session_name

    path, loaded = tiny
    shared = tmp_path / "shared"
    prompts = [prompt_of(1100 + i, 23) for i in range(2)]
    opts = dict(kv_shared_dir=str(shared), kv_shared_scan_s=0.05)
    with TierEngine(loaded, tmp_path / "a", 64, **opts) as a, \
            TierEngine(loaded, tmp_path / "b", 64, **opts) as b:
        assert a.report["shared"] and a.report["path"] == b.report["path"]
        assert a.report["path"].startswith(str(shared))
        first = a.save_each(prompts, "alice.p", 4)

        def learned(ids) -> bool:
            return all(b.engine.kv.disk.get(i) is not None for i in ids)

        deadline = time.monotonic() + 30
        while not learned(["alice.p.0", "alice.p.1"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert learned(["alice.p.0", "alice.p.1"]), b.engine.stats()
        hit = b.generate(prompts[0], 4, match_session=True)
        pre = hit.one(Prefill)
        assert (pre.session_loaded, pre.session_id, pre.session_tier) == (True, "alice.p.0", "disk")
        assert hit.tokens == first[0] == reference(path, prompts[0], 4)
        manifest = Path(a.report["path"]) / "sessions" / session_name("alice.p.1")
        manifest.unlink()
        deadline = time.monotonic() + 30
        while b.engine.kv.disk.get("alice.p.1") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = b.engine.stats()
        assert b.engine.kv.disk.get("alice.p.1") is None
        assert (stats["shared_sessions_added"], stats["shared_sessions_removed"]) == (2, 1)
        assert b.engine.kv.disk.get("alice.p.0") is None  # loaded: resident in b's pool now


def test_a_scaled_down_replica_leaves_every_session_on_the_shared_tier(tiny, tmp_path):
    """Scale-down is a clean stop: the replica's write-behind is flushed before it exits, so
    every session it saved, the last ones included (saved just before the stop, none of
    them waited for), is on the shared tier for the replica its conversations move to."""
    path, loaded = tiny
    shared = tmp_path / "shared"
    prompts = [prompt_of(1200 + i, 23) for i in range(6)]
    opts = dict(kv_shared_dir=str(shared))
    with TierEngine(loaded, tmp_path / "a", 64, **opts) as a:
        first = [a.generate(p, 3, save_session=f"alice.p.{i}").tokens for i, p in enumerate(prompts)]
    with TierEngine(loaded, tmp_path / "b", 64, **opts) as b:
        assert b.report["start_sessions"] == len(prompts)
        for i, prompt in enumerate(prompts):
            hit = b.generate(prompt, 3, match_session=True)
            pre = hit.one(Prefill)
            assert (pre.session_loaded, pre.session_id, pre.session_tier) == (True, f"alice.p.{i}", "disk")
            assert hit.tokens == first[i] == reference(path, prompt, 3)


def test_a_later_turn_another_replica_saved_replaces_the_stale_pool_copy(tiny, tmp_path):
    """Replica b holds turn 1 of a conversation in its pool; the conversation moves to
    replica a, which saves turn 2 under the same id on the shared tier. b's rescan drops its
    stale copy for the disk one, and turn 3 on b reads turn 2's KV back (the deeper match),
    with ``model.generate``'s output."""
    path, loaded = tiny
    shared = tmp_path / "shared"
    turn1 = prompt_of(1300, 15)
    turn2 = turn1 + prompt_of(1301, 12)
    turn3 = turn2 + prompt_of(1302, 9)
    opts = dict(kv_shared_dir=str(shared), kv_shared_scan_s=0.05)
    with TierEngine(loaded, tmp_path / "a", 64, **opts) as a, \
            TierEngine(loaded, tmp_path / "b", 64, **opts) as b:
        b.save_each([turn1], "alice.n.conv", 2)  # b: alice.n.conv.0 = turn 1, in its pool
        old = b.engine.kv.sessions.get("alice.n.conv.0")
        assert old is not None and old.num_tokens >= len(turn1) // BS * BS
        a.save_each([turn2], "alice.n.conv", 2)  # a: the same id, turn 2
        deadline = time.monotonic() + 30
        while b.engine.kv.sessions.get("alice.n.conv.0") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.engine.kv.sessions.get("alice.n.conv.0") is None  # the stale copy is gone
        assert b.engine.kv.disk.get("alice.n.conv.0").num_tokens >= len(turn2) // BS * BS
        hit = b.generate(turn3, 4, match_session=True)
        pre = hit.one(Prefill)
        assert (pre.session_loaded, pre.session_id, pre.session_tier) == (True, "alice.n.conv.0", "disk")
        assert pre.session_tokens == len(turn2) // BS * BS
        assert hit.tokens == reference(path, turn3, 4)
