"""The disk tier at the station's start, through its real boot in this process
(``station.main._TorchThread``: load the model, build the engine, open the tier, run the
engine loop), and the ``kv_tier`` report hello, health and stats build from it
(``station.tier.start.tier_report``).

A tier that cannot be opened (its path is a file; another station holds it) leaves a
station that serves from the pool alone and says why; ``kv_persistence = false`` opens
nothing and leaves a tier on disk untouched; an earlier version's tier is kept, unread;
a session file in the model's own layout (``tests.support.kv_tier``) is found at start;
the files are private under any umask; a later format's manifest is quarantined intact,
under a free name when its first choice is taken.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.core.requests import Finished, Prefill
from station.main import _TorchThread
from station.tier.store import quarantine as kv_store_quarantine
from station.tier import start as kv_tier_start
from station.tier.store.store import KVStore
from station.tier.start import tier_report
from supervisor.status import _kv_tier_lines
from tests.station.tier.test_disk_tier import generate
from tests.station.engine.test_paged_engine import Collector, prompt_of, reference
from tests.support.kv_tier import model_layout, tier_dir, tree, write_session_files

BS = 4
PROMPT = prompt_of(1201, 14)  # 3 full blocks saved
pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def layout(tiny_dir):
    """The tiny model's tier layout (its fingerprint names its tier's directory)."""
    return model_layout(tiny_dir, BS)


class Station:
    """The station's torch side, booted in this process exactly as ``serve`` boots it."""

    def __init__(self, model, state, **overrides) -> None:
        settings = Settings(model=str(model), runtime_dir=str(state.parent / "rt"),
                            state_dir=str(state), kv_block_size=BS, kv_cache_bytes=256 * 1024,
                            **overrides)
        self.torch = _TorchThread(settings)
        self.loaded, self.engine = self.torch.boot()
        self.n = 0

    @property
    def report(self) -> dict:
        """hello's ``kv_tier``, as the server builds it."""
        return tier_report(self.torch.tier_report, self.engine.stats())

    def generate(self, prompt, n: int = 3, **kwargs) -> Collector:
        self.n += 1
        return generate(self.engine, f"r{self.n}", prompt, n, **kwargs)

    def stop(self) -> None:
        self.engine.shutdown()
        self.torch.thread.join()


def serves_from_the_pool(station: Station, model) -> None:
    """A save and a hit work without a disk tier, and the output is model.generate's."""
    first = station.generate(PROMPT, 4, save_session="alice.s")
    assert first.one(Prefill).saved is True
    assert first.tokens == reference(model, PROMPT, 4)
    again = station.generate(PROMPT, 4, match_session=True)
    pre = again.one(Prefill)
    assert (pre.session_loaded, pre.session_tier, pre.session_tokens) == (True, "pool", 12)
    assert again.tokens == first.tokens


def test_a_tier_path_that_is_not_a_directory_leaves_the_station_serving(tiny_dir, layout, tmp_path):
    state = tmp_path / "state"
    root = tier_dir(state, layout.fingerprint)
    root.parent.mkdir(parents=True)  # <state>/kv-tier: the model's directory is a file
    root.write_bytes(b"not a directory")
    station = Station(tiny_dir, state)
    try:
        assert station.torch.tier_report == {
            "path": str(root), "enabled": True, "shared": False,
            "error": f"FileExistsError: [Errno 17] File exists: '{root}'"}
        assert station.engine.tier is None
        assert station.engine.capabilities()["kv_persistence"] is False
        serves_from_the_pool(station, tiny_dir)
        report = station.report
        assert "disk_bytes" not in report and "quarantined" not in report
        assert _kv_tier_lines(report) == [
            f"kv tiers: pool 1 sessions (3 of {report['pool_blocks']} blocks pinned); "
            f"DISK TIER UNAVAILABLE at {root}: FileExistsError: [Errno 17] File exists: '{root}'"]
    finally:
        station.stop()
    assert root.read_bytes() == b"not a directory"


def test_a_tier_another_station_holds_is_not_shared(tiny_dir, layout, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_tier_start, "_BUSY_WAIT_S", 0.3)  # the wait for a stopping station
    state = tmp_path / "state"
    root = tier_dir(state, layout.fingerprint)
    holder = KVStore(root, layout.fingerprint, BS, layout.shape, getattr(torch, layout.dtype),
                     1 << 30)
    try:
        station = Station(tiny_dir, state)
        try:
            assert station.torch.tier_report == {
                "path": str(root), "enabled": True, "shared": False,
                "error": f"{root} is open in another store"}
            assert station.engine.tier is None
            serves_from_the_pool(station, tiny_dir)
        finally:
            station.stop()
    finally:
        holder.close()
    assert not list(root.rglob("*.kv[bs]"))  # the second station wrote nothing into it


def test_kv_persistence_off_opens_nothing_and_leaves_a_tier_alone(tiny_dir, layout, tmp_path):
    state = tmp_path / "state"
    root = tier_dir(state, layout.fingerprint)
    write_session_files(root, layout, "alice.old", PROMPT, tenant="alice")
    before = tree(root)
    station = Station(tiny_dir, state, kv_persistence=False)
    try:
        assert station.torch.tier_report == {"path": str(root), "enabled": False, "shared": False,
                                                "error": None}
        assert station.engine.tier is None
        assert station.engine.capabilities()["kv_persistence"] is False
        assert not any(k.startswith("disk_") for k in station.engine.stats())
        # No disk: the old session is not offered; a new one lives in the pool only.
        miss = station.generate(PROMPT, 4, match_session=True)
        assert (miss.one(Prefill).session_loaded, miss.one(Finished).cached_tokens) == (False, 0)
        serves_from_the_pool(station, tiny_dir)
        report = station.report
        assert (report["enabled"], report["pool_sessions"]) == (False, 1)
        assert _kv_tier_lines(report) == [
            f"kv tiers: pool 1 sessions (3 of {report['pool_blocks']} blocks pinned); "
            f"disk off (kv_persistence = false)"]
    finally:
        station.stop()
    assert tree(root) == before


def test_an_earlier_tier_is_kept_unread_and_a_file_of_our_layout_is_found(tiny_dir, layout,
                                                                          tmp_path):
    state = tmp_path / "state"
    root = tier_dir(state, layout.fingerprint)
    legacy = state / "kv-sessions"
    legacy.mkdir(parents=True)
    (legacy / "manifest.json").write_text('{"format": 1, "sessions": []}')
    (legacy / "kv.pt").write_bytes(b"\x80\x02old tensors")
    legacy_files = tree(legacy)
    # The helper's file in the model's own layout is a session like the station's own.
    files = write_session_files(root, layout, "alice.old", PROMPT,
                                tenant="alice")
    assert len(files.blocks) == 3
    station = Station(tiny_dir, state)
    try:
        report = station.report
        assert (report["legacy"], report["start_sessions"], report["start_quarantined"],
                report["start_incomplete"], report["error"]) == (str(legacy), 1, 0, 0, None)
        assert _kv_tier_lines(report)[-1] == (
            f"  an earlier version's tier is kept, not read: {legacy}")
        hit = station.generate(PROMPT, 2, match_session=True)
        pre = hit.one(Prefill)
        assert (pre.session_loaded, pre.session_id, pre.session_tier, pre.session_tokens) == (
            True, "alice.old", "disk", 12)
        assert station.engine.stats()["disk_quarantined_total"] == 0
    finally:
        station.stop()
    assert tree(legacy) == legacy_files


def test_tier_files_are_private_under_any_umask(tiny_dir, layout, tmp_path):
    state = tmp_path / "state"
    root = tier_dir(state, layout.fingerprint)
    old = os.umask(0)  # the most permissive umask: modes come from the create calls alone
    try:
        station = Station(tiny_dir, state)
        try:
            assert station.generate(PROMPT, 2, save_session="alice.s").one(Prefill).saved is True
        finally:
            station.stop()  # flushes the write-behind
    finally:
        os.umask(old)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert sorted(p.name if p.suffix in ("", ".json", ".lock") else p.suffix for p in files) == [
        ".kvb", ".kvb", ".kvb", ".kvs", "layout.json", "layout.lock", "lock"]
    assert {p: stat.S_IMODE(p.stat().st_mode) for p in files} == {p: 0o600 for p in files}
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    assert {p: stat.S_IMODE(p.stat().st_mode) for p in dirs} == {p: 0o700 for p in dirs}


def test_a_later_formats_manifest_is_quarantined_under_a_free_name(tiny_dir, layout, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(kv_store_quarantine, "_utc_stamp", lambda: "20261130T121314Z")
    state = tmp_path / "state"
    root = tier_dir(state, layout.fingerprint)
    files = write_session_files(root, layout, "alice.v2", PROMPT,
                                tenant="alice")
    data = bytearray(files.manifest.read_bytes())
    data[8:10] = (2).to_bytes(2, "little")  # format version 2: a later station's file
    files.manifest.write_bytes(bytes(data))
    taken = root / "quarantine" / f"{files.manifest.name}.20261130T121314Z"
    taken.write_bytes(b"older")  # os.rename would replace it silently
    taken.with_name(taken.name + "-1").write_bytes(b"older still")
    # The store opens as the station's I/O process opens it (here, where the clock is fixed).
    with KVStore(root, layout.fingerprint, BS, layout.shape, getattr(torch, layout.dtype), 1 << 30) as store:
        assert (store.load_sessions(), store.stats()["quarantined"]) == ([], {"version": 1})
    assert sorted(p.name for p in (root / "quarantine").iterdir()) == [
        taken.name, taken.name + "-1", taken.name + "-2"]
    assert taken.with_name(taken.name + "-2").read_bytes() == bytes(data)
    assert taken.read_bytes() == b"older"
    assert taken.with_name(taken.name + "-1").read_bytes() == b"older still"
    # The station's own open quarantines such a file just the same, and the request misses.
    files = write_session_files(root, layout, "alice.v2", PROMPT, tenant="alice")
    files.manifest.write_bytes(bytes(data))
    station = Station(tiny_dir, state)
    try:
        report = station.report
        assert (report["start_sessions"], report["start_quarantined"],
                report["quarantine_reasons"]) == (0, 1, {"version": 1})
        moved = [p for p in (root / "quarantine").iterdir()
                 if p.name.startswith(files.manifest.name) and p.name not in
                 (taken.name, taken.name + "-1", taken.name + "-2")]
        assert [p.read_bytes() for p in moved] == [bytes(data)]
        miss = station.generate(PROMPT, 4, match_session=True)
        assert miss.one(Prefill).session_loaded is False
        assert miss.tokens == reference(tiny_dir, PROMPT, 4)
    finally:
        station.stop()
