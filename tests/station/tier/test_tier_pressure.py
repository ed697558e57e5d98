"""The disk tier under pressure (``station.tier.store.pressure``), on the tiny model with the real
engine, the real I/O process and real files:

* the tenant share holds on disk: one tenant's flood of 600 new sessions evicts its own,
  and another tenant's durable sessions all hit again after a restart;
* a full filesystem (a real one: a tmpfs of 256 KiB mounted in the I/O process's own mount
  namespace) counts as budget pressure: the least recently used sessions are evicted and
  the writes go on, counted and reported;
* a tier directory deleted while the station serves is recreated, its loss reported, and
  the sessions the pool still holds are written again.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from station.core.requests import Prefill
from station.tier.io.process import KVIOProcess
from station.tier.store.layouts import LAYOUT_FILE
from station.tier.start import tier_report
from supervisor.status import _kv_tier_lines
from tests.station.tier.test_tier_quarantine import metrics
from tests.station.tier.test_disk_tier import TierEngine, tier_model
from tests.station.tier.test_disk_tier_io import wait_for
from tests.station.engine.test_paged_engine import prompt_of, reference
from tests.support.kv_tier import tier_dir

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tier_model(tmp_path_factory)




def settled(t: TierEngine) -> None:
    """Every save handed to the writer and answered (written or failed)."""
    wait_for(lambda: not t.engine.kv.to_write and t.engine.stats()["write_behind_queued"] == 0
             and not t.engine.tier._inflight, "the write-behind to settle")


def test_the_tenant_share_holds_on_disk_against_a_flood(tiny, tmp_path):
    path, loaded = tiny
    state = tmp_path / "state"
    root = tier_dir(state, loaded.fingerprint)
    bobs = [prompt_of(5100 + i, 23) for i in range(5)]
    with TierEngine(loaded, state, 64) as t:
        first = [t.generate(p, 3, tenant="bob", save_session=f"bob.s.{i}").tokens
                 for i, p in enumerate(bobs)]
    bob_bytes = sum(p.stat().st_size for p in root.rglob("*.kv[bs]"))
    # bob holds a third of the budget, under his share (0.5); alice's 600 sessions of one
    # block each take about eight times the budget.
    budget = 3 * bob_bytes
    with TierEngine(loaded, state, 64, kv_disk_bytes=budget, kv_session_budget=64) as t:
        assert t.report["start_sessions"] == len(bobs)
        for i in range(600):
            t.generate(prompt_of(6000 + i, 5), 1, save_session=f"alice.f.{i}")
        settled(t)
        stats = t.engine.stats()
        assert stats["write_behind_errors"] == 0 and stats["write_behind_done"] == 600
        assert stats["disk_evicted_sessions"] > 400 and stats["disk_bytes"] <= budget
        assert stats["disk_evicted_over_share"] == stats["disk_evicted_sessions"]
        assert tier_report(t.report, stats)["evicted_over_share"] == stats["disk_evicted_sessions"]
        assert metrics(stats)["gnosis_kv_tier_evicted_over_share_total"] == stats["disk_evicted_sessions"]
    with TierEngine(loaded, state, 64, kv_disk_bytes=budget) as t:  # bob's, all still there
        for i, prompt in enumerate(bobs):
            again = t.generate(prompt, 3, tenant="bob", match_session=True)
            pre = again.one(Prefill)
            assert (pre.session_loaded, pre.session_id, pre.session_tier) == (True, f"bob.s.{i}", "disk")
            assert again.tokens == first[i] == reference(path, prompt, 3)


def mount_tmpfs_launcher(mount_point: Path, size: str) -> list[str]:
    """A command that starts the I/O process in a mount namespace of its own, with a tmpfs
    of ``size`` on ``mount_point`` (unprivileged: a user namespace maps the caller to
    root there). The test skips where user namespaces are not allowed."""
    mount_point.mkdir(parents=True, exist_ok=True)
    script = f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$0" && exec "$@"'
    launcher = ["unshare", "-rm", "sh", "-c", script, str(mount_point)]
    if shutil.which("unshare") is None or subprocess.run(
            [*launcher, "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged mount namespace here (unshare -rm) for a small filesystem")
    return launcher


def test_a_full_filesystem_evicts_the_least_recently_used_and_writes_on(tiny, tmp_path, capfd):
    """A real ENOSPC: the tier's directory is a 256 KiB tmpfs (about 64 files of a page)
    that only the I/O process sees, far below ``kv_disk_bytes``. Its log says so in a
    warning a time, without a traceback."""
    path, loaded = tiny
    state = tmp_path / "state"
    launcher = mount_tmpfs_launcher(tier_dir(state, loaded.fingerprint), "256k")
    prompts = [prompt_of(7100 + i, 23) for i in range(30)]  # 5 blocks + a manifest each
    io = KVIOProcess("info", "json", 19, launcher=launcher)
    # A pool of 24 blocks (two sessions pinned): a session it evicted is soon read from disk.
    with TierEngine(loaded, state, 24, io=io, kv_disk_bytes=1 << 30, kv_session_budget=2) as t:
        for i, prompt in enumerate(prompts):
            t.generate(prompt, 2, save_session=f"alice.d.{i}")
            settled(t)
        stats = t.engine.stats()
        report = tier_report(t.report, stats)
        assert stats["write_behind_errors"] == 0 and stats["write_behind_done"] == 30
        assert report["disk_full"] > 0 and report["disk_full_evicted"] >= 15
        assert "ENOSPC" in report["write_error"] and report["error"] is None
        assert report["disk_sessions"] == 30 - report["disk_full_evicted"]
        assert any("DISK FULL" in line for line in _kv_tier_lines(report))
        served = metrics(stats)
        assert served["gnosis_kv_tier_disk_full_total"] == report["disk_full"]
        assert served["gnosis_kv_tier_disk_full_evicted_total"] == report["disk_full_evicted"]
        last = prompts[-1]  # the newest is on disk (and in the pool: a pool hit)
        for prompt in prompts[-6:-4]:  # evicted from the pool, still on disk
            again = t.generate(prompt, 2, match_session=True)
            assert again.one(Prefill).session_tier == "disk"
            assert again.tokens == reference(path, prompt, 2)
        old = t.generate(prompts[0], 2, match_session=True)  # the disk made room with it
        assert old.one(Prefill).session_loaded is False
        assert t.generate(last, 2, match_session=True).one(Prefill).session_loaded is True
    err = capfd.readouterr().err
    assert err.count('"event": "kv_store_disk_full"') == report["disk_full"]
    assert "Traceback" not in err and "kv_tier_write_failed" not in err


def test_a_tier_directory_deleted_while_serving_is_recreated_and_reported(tiny, tmp_path):
    path, loaded = tiny
    state = tmp_path / "state"
    root = tier_dir(state, loaded.fingerprint)
    prompts = [prompt_of(8100 + i, 23) for i in range(4)]
    with TierEngine(loaded, state, 64, kv_session_budget=2) as t:
        first = t.save_each(prompts, "alice.l", 3)
        assert t.engine.stats()["kv_disk_sessions"] == 2  # two on disk only, two in the pool
        root.rename(tmp_path / "gone")  # at once, as a whole (rmtree's steps would race the check)
        shutil.rmtree(tmp_path / "gone")
        wait_for(lambda: t.engine.stats()["disk_lost"] == 1, "the loss to be noticed")
        t.expected_writes += 2  # the pool's two, written again
        t.settle()
        report = tier_report(t.report, t.engine.stats())
        assert (report["root_lost"], report["root_lost_sessions"]) == (1, 4)
        assert (report["disk_sessions"], report["disk_only_sessions"]) == (2, 0)
        assert "recreated" in report["write_error"]
        assert any("TIER DIRECTORY DELETED 1 time(s)" in line for line in _kv_tier_lines(report))
        assert metrics(t.engine.stats())["gnosis_kv_tier_root_lost_sessions_total"] == 4
        assert (root / LAYOUT_FILE).is_file() and len(list((root / "sessions").glob("*.kvs"))) == 2
        gone = t.generate(prompts[0], 3, match_session=True)  # disk-only, deleted with it
        assert gone.one(Prefill).session_loaded is False
        assert gone.tokens == reference(path, prompts[0], 3)
        assert t.engine.stats()["read_back_failures"] == 0
    with TierEngine(loaded, state, 64) as t:  # the pool's two survive the restart
        assert t.report["start_sessions"] == 2
        for i in (2, 3):
            again = t.generate(prompts[i], 3, match_session=True)
            pre = again.one(Prefill)
            assert (pre.session_loaded, pre.session_id, pre.session_tier) == (True, f"alice.l.{i}", "disk")
            assert again.tokens == first[i]
