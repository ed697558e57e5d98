"""A bad KV disk tier is published: the station's report reaches the status file,
``gnosis-daemon status`` and the host's ``/health``, and the daemon serves regardless."""

from __future__ import annotations

import json

import httpx

from supervisor.status import render
from tests.support.kv_tier import write_torn_tier
from tests.supervisor.conftest import MODEL_NAME, cli, start_daemon, stop_daemon


def tier_report(**fields) -> dict:
    report = {"path": "/s/kv-sessions", "enabled": True, "restored_sessions": 0,
              "restored_blocks": 0, "skipped_sessions": 0, "bad_sessions": 0, "rejected": 0,
              "rejections": [], "foreign": None, "rejected_on_disk": 0, "foreign_on_disk": 0}
    report.update(fields)
    return report


def document(kv_tier) -> dict:
    return {"version": 1, "updated_at": 1.0,
            "supervisor": {"pid": 1, "state": "running", "ready": True},
            "children": {"station": {"state": "running", "pid": 11, "restarts": 0,
                                     "uptime_s": 4.0, "last_exit": None, "capabilities": {},
                                     "kv_tier": kv_tier},
                         "host": {"state": "running", "pid": 12, "restarts": 0,
                                  "uptime_s": 3.0, "last_exit": None, "capabilities": {}}}}


def tier_lines(kv_tier) -> list[str]:
    return render(document(kv_tier)).splitlines()[4:]  # after the header and the table


def test_status_text_shows_rejected_and_foreign_tiers():
    assert tier_lines(None) == []
    assert tier_lines(tier_report(enabled=False)) == ["kv tier: off (kv_persistence = false)"]
    assert tier_lines(tier_report(restored_sessions=3, restored_blocks=13)) == [
        "kv tier /s/kv-sessions: restored 3 sessions (13 blocks)"]
    bad = tier_report(
        restored_sessions=1, restored_blocks=7, skipped_sessions=2, bad_sessions=2, rejected=1,
        rejections=[{"path": "/s/kv-sessions.rejected-20261130T121314Z",
                     "reason": "2 of 3 session entries refused: ..."}],
        rejected_on_disk=3, foreign_on_disk=1)
    assert tier_lines(bad) == [
        "kv tier /s/kv-sessions: restored 1 sessions (7 blocks), 2 not restored "
        "(session budget or KV pool)",
        "  REJECTED at start, kept at /s/kv-sessions.rejected-20261130T121314Z: "
        "2 of 3 session entries refused: ...",
        "  2 rejected tier(s) from earlier runs beside it (*.rejected-*): inspect, then "
        "delete them",
        "  1 foreign tier(s) kept beside it (*.foreign-*)"]
    foreign = tier_report(foreign={"path": "/s/kv-sessions",
                                   "reason": "written by another model or KV layout: block_size 4 (here 16)"})
    assert tier_lines(foreign)[1] == (
        "  FOREIGN tier kept in place (another model or layout; moved aside before this "
        "station writes its own): written by another model or KV layout: block_size 4 (here 16)")


def test_a_corrupt_tier_at_start_is_published_and_the_daemon_serves(tiny_model_dir, tmp_path):
    tier = tmp_path / "run" / "state" / "kv-sessions"
    write_torn_tier(tiny_model_dir, tier, block_size=16)  # the daemon's default block size
    before = {p.name: p.read_bytes() for p in tier.iterdir()}
    daemon = start_daemon(tiny_model_dir, tmp_path)
    try:
        [moved] = tier.parent.glob("kv-sessions.rejected-*")
        assert {p.name: p.read_bytes() for p in moved.iterdir()} == before
        status = daemon.wait(lambda s: s["children"]["station"]["health"].get("kv_tier"), 30,
                             "a station health check")
        station = status["children"]["station"]
        report = station["kv_tier"]
        assert report["rejected"] == 1 and report["rejections"][0]["path"] == str(moved)
        assert report["rejections"][0]["reason"].startswith("kv.pt cannot be loaded: ")
        assert station["health"]["kv_tier"] == report
        assert station["restarts"] == 0  # it booted the first time

        status = cli("status", "--json", runtime_dir=daemon.runtime_dir)
        assert json.loads(status.stdout)["children"]["station"]["kv_tier"] == report
        table = cli("status", runtime_dir=daemon.runtime_dir)
        assert table.returncode == 0
        assert f"  REJECTED at start, kept at {moved}: kv.pt cannot be loaded: " in table.stdout

        health = httpx.get(f"{daemon.base_url}/health", timeout=10).json()
        assert health["station_kv_tier"] == report
        answer = httpx.post(f"{daemon.base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
    finally:
        stop_daemon(daemon)
