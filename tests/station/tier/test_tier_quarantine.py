"""Quarantine keeps damaged files intact: with every file of a tier damaged (half of them
cut short, half with a byte flipped), the station serves on, and every damaged file ends
in ``quarantine/`` byte for byte as the damage left it, whether the start found it (a
manifest), the budget's sweep of unnamed blocks did (the blocks of a quarantined
manifest) or a read-back and the deletion of its session did; none is deleted. Past
``kv_quarantine_bytes`` the oldest quarantined files go, counted, and the report says how
many files quarantine keeps and why, across restarts too (real engine, real I/O process, real files)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from station.core.requests import Prefill
from station.tier.start import tier_report
from host.scrape_metrics import tier_families
from supervisor.status import _kv_tier_lines
from tests.station.tier.test_disk_tier import TierEngine, tier_model
from tests.station.engine.test_paged_engine import prompt_of, reference
from tests.support.kv_tier import flip_byte, quarantined, tier_dir, truncate

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tier_model(tmp_path_factory)


def tier_files(root: Path, pattern: str = "*") -> list[Path]:
    return sorted(p for p in (root / "blocks").rglob(pattern) if p.is_file()) + sorted(
        p for p in (root / "sessions").glob(pattern) if p.is_file())


def metrics(stats: dict) -> dict[str, float]:
    """The ``gnosis_kv_tier_*{tier="disk"}`` samples ``/metrics`` would serve for ``stats``."""
    return {sample.name: sample.value for family in tier_families(stats)
            for sample in family.samples if sample.labels == {"tier": "disk"}}


def damage(files: list[Path]) -> dict[str, bytes]:
    """Cut every other file to half its bytes, flip a byte of the rest; -> name: bytes."""
    return {p.name: truncate(p) if i % 2 else flip_byte(p) for i, p in enumerate(files)}


def test_every_file_damaged_is_kept_in_quarantine_byte_for_byte(tiny, tmp_path):
    path, loaded = tiny
    state = tmp_path / "state"
    root = tier_dir(state, loaded.fingerprint)
    prompts = [prompt_of(4100 + i, 23) for i in range(6)]
    with TierEngine(loaded, state, 64) as t:
        t.save_each(prompts, "alice.q", 3)
    damaged = damage(tier_files(root))
    assert len(damaged) == 6 * 5 + 6

    with TierEngine(loaded, state, 64) as t:
        assert t.report["start_sessions"] == 0 and t.report["start_quarantined"] == 6
        for prompt in prompts:  # misses, served right
            miss = t.generate(prompt, 3, match_session=True)
            assert miss.one(Prefill).session_loaded is False
            assert miss.tokens == reference(path, prompt, 3)
        # A new save runs the budget's sweep: the 30 blocks no sound manifest names.
        t.save_each([prompt_of(4200, 9)], "alice.new", 2)
        report = tier_report(t.report, t.engine.stats())
        assert report["quarantined"] == len(damaged) and report["quarantine_deleted"] == 0
        assert report["quarantine_kept"] == len(damaged)
        assert sum(report["quarantine_kept_reasons"].values()) == len(damaged)
        assert set(report["quarantine_kept_reasons"]) <= {"truncated", "checksum"}
        assert report["quarantine_kept_bytes"] == sum(map(len, damaged.values()))
        served = metrics(t.engine.stats())
        assert served["gnosis_kv_tier_quarantine_kept"] == len(damaged)
        assert served["gnosis_kv_tier_quarantine_kept_bytes"] == report["quarantine_kept_bytes"]
        assert served["gnosis_kv_tier_quarantine_deleted_total"] == 0
        lines = _kv_tier_lines(report)
        assert any(f"QUARANTINED {len(damaged)} file(s)" in line for line in lines), lines
        assert any(f"quarantine keeps {len(damaged)} file(s)" in line for line in lines), lines
    assert quarantined(root) == damaged
    assert len(tier_files(root, "*.kvb")) == 2  # the new session's, sound: nothing else left

    # A restart finds them kept (reason: earlier) and under a smaller budget trims the oldest.
    keep = sum(map(len, damaged.values())) // 2
    moved_at = {p.name.rsplit(".", 1)[0]: p.stat().st_ctime_ns for p in (root / "quarantine").iterdir()}
    why = {name.rsplit(".", 1)[0]: reason  # quarantine.json: each kept file's reason
           for name, reason in json.loads((root / "quarantine.json").read_text()).items()}
    assert sorted(why) == sorted(damaged)
    with TierEngine(loaded, state, 64, kv_quarantine_bytes=keep) as t:
        report = tier_report(t.report, t.engine.stats())
        deleted = report["quarantine_deleted"]
        assert deleted > 0 and report["quarantine_kept"] == len(damaged) - deleted
        assert report["quarantine_kept_bytes"] <= keep
        kept_now = sorted(p.name.rsplit(".", 1)[0] for p in (root / "quarantine").iterdir())
        assert report["quarantine_kept_reasons"] == dict(Counter(why[n] for n in kept_now))
        assert metrics(t.engine.stats())["gnosis_kv_tier_quarantine_deleted_total"] == deleted
    left = quarantined(root)
    assert len(left) == len(damaged) - deleted
    assert all(damaged[name] == data for name, data in left.items())
    gone = set(moved_at) - set(left)  # the oldest went: none kept was quarantined before them
    assert len(gone) == deleted and max(moved_at[n] for n in gone) <= min(moved_at[n] for n in left)


def test_damaged_blocks_of_a_sound_manifest_are_kept_when_its_read_back_fails(tiny, tmp_path):
    """The read-back quarantines the first bad block it meets; the session is then
    deleted, and each of its other blocks, never read, is checked before it may go."""
    path, loaded = tiny
    state = tmp_path / "state"
    root = tier_dir(state, loaded.fingerprint)
    prompts = [prompt_of(4300 + i, 23) for i in range(3)]
    with TierEngine(loaded, state, 64) as t:
        t.save_each(prompts, "alice.r", 3)
    damaged = damage(tier_files(root, "*.kvb"))
    assert len(damaged) == 3 * 5
    with TierEngine(loaded, state, 64) as t:
        assert t.report["start_sessions"] == 3
        for prompt in prompts:
            miss = t.generate(prompt, 3, match_session=True)
            assert miss.tokens == reference(path, prompt, 3)
        t.save_each([prompt_of(4400, 9)], "alice.new", 2)  # the write after the deletes
        stats = t.engine.stats()
        assert stats["read_back_failures"] == 3 and stats["disk_quarantine_deleted"] == 0
        assert stats["disk_quarantine_kept"] == len(damaged)
    assert quarantined(root) == damaged
