"""Layout changes never delete: a station restarted with another ``kv_block_size`` over a
model's disk tier sets that tier aside, by name (``station.tier.store.layouts``), and writes its own
beside it; configured back, it finds every earlier session again, with the same greedy
output, and not one byte of the other layout's files changed on the way (real engine,
real I/O process, real files; sha256 of every file before and after)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from station.core.requests import Prefill
from station.tier.store.layouts import LAYOUT_FILE, LAYOUTS_DIR
from station.tier.start import tier_report
from supervisor.status import _kv_tier_lines
from tests.station.tier.test_disk_tier import TierEngine, tier_model
from tests.station.engine.test_paged_engine import prompt_of, reference
from tests.support.kv_tier import tier_dir

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tier_model(tmp_path_factory)


def digests(root: Path, skip: str | None = None) -> dict[str, str]:
    """sha256 of every file under ``root`` (but ``skip``, a top-level name), by path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] != skip}


def save_all(t: TierEngine, prompts, name: str) -> list[list[int]]:
    return t.save_each(prompts, name, 4, match_session=True)


def hits(t: TierEngine, path, prompts, name: str, first) -> None:
    """Every prompt again: a disk hit on its session, with its first run's greedy tokens."""
    for i, prompt in enumerate(prompts):
        again = t.generate(prompt, 4, match_session=True)
        pre = again.one(Prefill)
        assert (pre.session_loaded, pre.session_id, pre.session_tier, pre.session_tokens) == (
            True, f"{name}.{i}", "disk", len(prompt) // t.bs * t.bs), (i, pre)
        assert again.tokens == first[i] == reference(path, prompt, 4), i


def test_a_block_size_change_and_back_finds_every_session_and_touches_no_file(tiny, tmp_path):
    path, loaded = tiny
    state = tmp_path / "state"
    model_dir = tier_dir(state, loaded.fingerprint)
    four = [prompt_of(3100 + i, 23) for i in range(5)]  # 5 blocks of 4 each
    eight = [prompt_of(3200 + i, 27) for i in range(3)]  # 3 blocks of 8 each
    with TierEngine(loaded, state, 64, block_size=4) as t:
        first4 = save_all(t, four, "alice.b4")
        tag4 = t.report["layout"]
        assert t.report["path"] == str(model_dir) and t.report["other_layouts"] == []
    before4 = digests(model_dir, skip=LAYOUTS_DIR)
    assert len([p for p in before4 if p.endswith(".kvs")]) == len(four)

    with TierEngine(loaded, state, 64, block_size=8) as t:
        tag8 = t.report["layout"]
        assert tag8 != tag4 and tag8.startswith("bs8-") and tag4.startswith("bs4-")
        assert t.report["path"] == str(model_dir / LAYOUTS_DIR / tag8)
        assert t.report["other_layouts"] == [tag4]
        lines = _kv_tier_lines(tier_report(t.report, t.engine.stats()))
        assert f"  set aside, untouched (another kv_block_size or KV layout): {tag4}" in lines
        assert t.report["start_sessions"] == 0 and t.report["start_quarantined"] == 0
        first8 = save_all(t, eight, "alice.b8")
        stats = t.engine.stats()
        assert stats["disk_quarantined_total"] == 0 and stats["disk_evicted_blocks"] == 0
    assert digests(model_dir, skip=LAYOUTS_DIR) == before4  # not one file added, changed or gone
    before8 = digests(model_dir / LAYOUTS_DIR / tag8)
    assert len([p for p in before8 if p.endswith(".kvs")]) == len(eight)

    with TierEngine(loaded, state, 64, block_size=4) as t:  # configured back
        assert t.report["path"] == str(model_dir) and t.report["other_layouts"] == [tag8]
        assert t.report["start_sessions"] == len(four) and t.report["start_quarantined"] == 0
        hits(t, path, four, "alice.b4", first4)
    assert digests(model_dir / LAYOUTS_DIR / tag8) == before8

    with TierEngine(loaded, state, 64, block_size=8) as t:  # and the other way again
        assert t.report["start_sessions"] == len(eight)
        hits(t, path, eight, "alice.b8", first8)


def test_a_tier_written_before_layout_markers_keeps_its_layout(tiny, tmp_path):
    """A tier from before ``layout.json`` is claimed by the layout its files were written
    in, not by whichever block size starts first over it."""
    path, loaded = tiny
    state = tmp_path / "state"
    model_dir = tier_dir(state, loaded.fingerprint)
    prompts = [prompt_of(3300 + i, 23) for i in range(3)]
    with TierEngine(loaded, state, 64, block_size=4) as t:
        first = save_all(t, prompts, "alice.old")
    (model_dir / LAYOUT_FILE).unlink()  # as an earlier version left it
    before = digests(model_dir)
    with TierEngine(loaded, state, 64, block_size=8) as t:
        [other] = t.report["other_layouts"]
        assert other.startswith("bs4-float32-") and t.report["layout"].startswith("bs8-")
        assert t.report["start_sessions"] == 0
        t.save_each([prompt_of(3400, 17)], "alice.new", 2)
    after = digests(model_dir, skip=LAYOUTS_DIR)
    assert after.pop(LAYOUT_FILE) and after == before  # the marker is new; nothing else changed
    with TierEngine(loaded, state, 64, block_size=4) as t:
        assert t.report["start_sessions"] == len(prompts)
        hits(t, path, prompts, "alice.old", first)
