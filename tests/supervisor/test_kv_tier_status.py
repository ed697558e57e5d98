"""The KV tiers as an operator sees them, and the disk tier through the whole daemon.

``gnosis-daemon status`` renders the station's ``kv_tier`` report: the tiers' fill, and
loudly what needs an operator (quarantined files, a disk tier that could not be opened, an
earlier version's tier left unread). Through a real supervisor: liquid sessions saved over
the OpenAI API survive a SIGKILL of the station, and come back as hits from disk with the
same answers; a corrupt file found at start is published in the status file, ``status``
and the host's ``/health``, and the daemon serves on its first start.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
from openai import OpenAI
from transformers import AutoTokenizer

from gnosis_daemon.tokens import common_prefix_len
from supervisor.status import render
from tests.supervisor.conftest import MODEL_NAME, both_running, cli, start_daemon, stop_daemon
from tests.support.kv_tier import (flip_token_digit, model_layout, quarantined, tier_dir,
                                   write_session_files)

BS = 16  # the daemon's default block size


def tier_report(**fields) -> dict:
    """A station's ``kv_tier`` (``kv_tier_start.tier_report``) with a healthy disk tier."""
    report = {"path": "/s/kv-tier", "enabled": True, "error": None, "start_sessions": 40,
              "start_bytes": 1 << 20, "start_quarantined": 0, "start_incomplete": 0,
              "pool_sessions": 3, "pool_session_budget": 256, "pool_pinned_blocks": 9,
              "pool_blocks": 1024, "disk_sessions": 40, "disk_only_sessions": 37,
              "disk_bytes": 3 << 19,
              "disk_budget_bytes": 8 << 30, "disk_blocks": 120, "quarantined": 0,
              "quarantine_reasons": {}, "offloaded": 0, "lost": 0,
              "write_behind_lag_ms_p99": 12.4, "write_behind_queued": 0}
    report.update(fields)
    return report


def no_disk(**fields) -> dict:
    """The report of a station without a disk tier: the start's fields and the pool's."""
    report = {"path": "/s/kv-tier", "enabled": True, "error": None, "pool_sessions": 2,
              "pool_session_budget": 256, "pool_pinned_blocks": 6, "pool_blocks": 1024}
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


HEALTHY = ("kv tiers: pool 3 sessions (9 of 1024 blocks pinned); disk 40 sessions, "
           "1.5 MiB of 8.0 GiB at /s/kv-tier, write-behind lag p99 12 ms")


def test_status_text_without_a_report_or_a_disk_tier():
    assert tier_lines(None) == []
    assert tier_lines(no_disk(enabled=False)) == [
        "kv tiers: pool 2 sessions (6 of 1024 blocks pinned); disk off (kv_persistence = false)"]


def test_status_text_of_a_healthy_tier():
    assert tier_lines(tier_report()) == [HEALTHY]
    # No write yet: no lag to show; sizes under a KiB in bytes.
    fresh = tier_report(write_behind_lag_ms_p99=None, disk_bytes=512, disk_sessions=0,
                        disk_only_sessions=0)
    assert tier_lines(fresh) == [
        "kv tiers: pool 3 sessions (9 of 1024 blocks pinned); disk 0 sessions, "
        "512 B of 8.0 GiB at /s/kv-tier, write-behind lag p99 -"]


def test_status_text_shows_quarantined_files_loudly():
    reasons = {"truncated": 1, "checksum": 2, "fingerprint": 1, "block_size": 1}
    bad = tier_report(quarantined=5, quarantine_reasons=reasons, start_quarantined=2)
    assert tier_lines(bad) == [
        HEALTHY,
        "  QUARANTINED 5 file(s) (block_size 1, checksum 2, fingerprint 1, truncated 1): kept "
        "intact in /s/kv-tier/quarantine; inspect, then delete them"]
    assert tier_lines(tier_report(lost=2)) == [
        HEALTHY, "  2 session(s) evicted before the write-behind reached disk"]


def test_status_text_says_what_quarantine_keeps_a_full_disk_a_lost_directory_and_layouts():
    kept = tier_report(quarantine_kept=7, quarantine_kept_reasons={"checksum": 4, "earlier": 3},
                       quarantine_kept_bytes=3 * 1024 ** 2, quarantine_budget_bytes=1024 ** 3,
                       quarantine_deleted=2)
    assert tier_lines(kept) == [
        HEALTHY, "  quarantine keeps 7 file(s) (checksum 4, earlier 3), 3.0 MiB of 1.0 GiB; "
        "2 deleted past its budget"]
    full = tier_report(disk_full=3, disk_full_evicted=5, write_error="ENOSPC: No space left on device")
    assert tier_lines(full) == [
        HEALTHY, "  DISK FULL 3 time(s): 5 session(s) evicted to make room; free space or lower "
        "kv_disk_bytes", "  last disk error: ENOSPC: No space left on device"]
    gone = tier_report(root_lost=1, root_lost_sessions=40, other_layouts=["bs8-float32-2x2x8x2x3"])
    assert tier_lines(gone) == [
        HEALTHY, "  TIER DIRECTORY DELETED 1 time(s) while serving: recreated, 40 session(s) lost",
        "  set aside, untouched (another kv_block_size or KV layout): bs8-float32-2x2x8x2x3"]
    quiet = tier_report(quarantine_kept=0, quarantine_deleted=0, disk_full=0, root_lost=0,
                        write_error=None, other_layouts=[])
    assert tier_lines(quiet) == [HEALTHY]


def test_status_text_shows_a_disk_tier_that_could_not_be_opened():
    error = "FileExistsError: [Errno 17] File exists: '/s/kv-tier'"
    assert tier_lines(no_disk(error=error)) == [
        "kv tiers: pool 2 sessions (6 of 1024 blocks pinned); DISK TIER UNAVAILABLE at "
        "/s/kv-tier: FileExistsError: [Errno 17] File exists: '/s/kv-tier'"]


def test_status_text_shows_an_earlier_versions_tier():
    assert tier_lines(tier_report(legacy="/s/kv-sessions")) == [
        HEALTHY, "  an earlier version's tier is kept, not read: /s/kv-sessions"]
    # With the disk tier off too: the old tier is still there for the operator to see.
    assert tier_lines(no_disk(enabled=False, legacy="/s/kv-sessions")) == [
        "kv tiers: pool 2 sessions (6 of 1024 blocks pinned); disk off (kv_persistence = false)",
        "  an earlier version's tier is kept, not read: /s/kv-sessions"]


# -- through the daemon
def openai_client(daemon) -> OpenAI:
    return OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client: OpenAI, content: str) -> tuple[str, dict, int, int]:
    """-> (the answer, its ``_gnosis`` block, its prompt tokens, its answer's tokens)."""
    resp = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": content}])
    usage = resp.usage
    return resp.choices[0].message.content, resp.model_extra["_gnosis"], usage.prompt_tokens, usage.completion_tokens


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def host_health(daemon) -> dict:
    response = httpx.get(f"{daemon.base_url}/health", timeout=10)
    return response.json() if response.status_code == 200 else {}


def test_liquid_sessions_survive_a_station_sigkill(tiny_model_dir, tmp_path):
    # 19 chat-template tokens around 43 bytes of content: 62 tokens, 3 full blocks saved.
    prompts = [f"Q{i:02d}: what is written on page {i:02d} of the log?" for i in range(20)]
    assert {len(p) for p in prompts} == {43}
    fingerprint = model_layout(tiny_model_dir, BS).fingerprint
    daemon = start_daemon(tiny_model_dir, tmp_path)
    root = tier_dir(daemon.runtime_dir / "state", fingerprint)
    try:
        client = openai_client(daemon)
        # No saved prefix for any of them (sessions match whole blocks), but the prefix cache
        # serves what a prompt shares with an earlier one, token by token: the chat
        # template's opening and the "Qnn" digits in common.
        ids = [AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)["input_ids"]
            for p in prompts]
        shared = [max((common_prefix_len(ids[i], ids[j]) for j in range(i)), default=0)
                  for i in range(len(ids))]
        first, answered = [], []
        for prompt, cached in zip(prompts, shared):
            answer, gnosis, prompt_tokens, answer_tokens = chat(client, prompt)
            assert (gnosis["liquid_memory"], gnosis["liquid_kv_saved"], gnosis["tier"],
                    gnosis["cached_tokens"], prompt_tokens) == ("miss", True, None, cached, 62), gnosis
            first.append(answer)
            answered.append(answer_tokens)
        assert shared[0] == 0 and 0 < min(shared[1:]) < BS
        # Each completion saved its prompt's session and its prompt + answer's: 40
        # manifests, each on disk whole (written under a temp name, fsynced, renamed).
        wait_until(lambda: len(list((root / "sessions").glob("*.kvs"))) == 40, 30,
                   "the write-behind")
        station = daemon.child("station")
        assert (station["state"], station["restarts"]) == ("running", 0)
        os.kill(station["pid"], signal.SIGKILL)

        status = daemon.wait(lambda s: both_running(s) and s["children"]["station"]["pid"]
                             not in (None, station["pid"]), 90, "the station restarted")
        new = status["children"]["station"]
        assert new["restarts"] == 1 and new["last_exit"]["signal_name"] == "SIGKILL"
        tier = new["kv_tier"]
        assert (tier["path"], tier["start_sessions"], tier["start_quarantined"],
                tier["start_incomplete"], tier["error"]) == (str(root), 40, 0, 0, None)
        health = wait_until(lambda: (h := host_health(daemon)).get("station_pid") == new["pid"]
                            and h["liquid_memory"] is True and h, 60, "the host reconnected")
        assert health["station_kv_tier"]["start_sessions"] == 40

        for i, prompt in enumerate(prompts):
            answer, gnosis, prompt_tokens, _ = chat(client, prompt)
            # read back from disk: the prompt's 3 full blocks, and where the prompt + answer's
            # session (its last token's KV never computed) fills a 4th block, all of the prompt
            # but its last token (whose logits are needed) from that block too
            cached = prompt_tokens - 1 if prompt_tokens + answered[i] - 1 >= 4 * BS else 3 * BS
            assert (gnosis["liquid_memory"], gnosis["tier"], gnosis["cached_tokens"]) == (
                "hit", "disk", cached), (i, gnosis)
            assert answer == first[i], i
        assert daemon.child("station")["pid"] == new["pid"]  # no restart since
    finally:
        stop_daemon(daemon)


def test_a_corrupt_file_at_start_is_published_and_the_daemon_serves(tiny_model_dir, tmp_path):
    layout = model_layout(tiny_model_dir, BS)
    root = tier_dir(tmp_path / "run" / "state", layout.fingerprint)
    files = write_session_files(root, layout, "anon.p.x", list(range(1, 33)))
    bad = flip_token_digit(files.manifest)  # only the checksum can tell
    daemon = start_daemon(tiny_model_dir, tmp_path)
    try:
        status = daemon.wait(lambda s: s["children"]["station"]["health"].get("kv_tier"), 30,
                             "a station health check")
        station = status["children"]["station"]
        assert station["restarts"] == 0  # it booted the first time
        report = station["kv_tier"]
        assert report == station["health"]["kv_tier"]
        assert (report["path"], report["error"], report["start_sessions"],
                report["start_quarantined"], report["quarantined"],
                report["quarantine_reasons"]) == (str(root), None, 0, 1, 1, {"checksum": 1})
        assert quarantined(root) == {files.manifest.name: bad}  # kept, byte for byte

        published = json.loads(cli("status", "--json", runtime_dir=daemon.runtime_dir).stdout)
        tier = published["children"]["station"]["kv_tier"]
        assert (tier["quarantined"], tier["quarantine_reasons"]) == (1, {"checksum": 1})
        table = cli("status", runtime_dir=daemon.runtime_dir)
        assert table.returncode == 0
        assert (f"  QUARANTINED 1 file(s) (checksum 1): kept intact in {root}/quarantine; "
                f"inspect, then delete them") in table.stdout.splitlines()

        health = host_health(daemon)
        assert (health["station_kv_tier"]["quarantined"],
                health["station_kv_tier"]["quarantine_reasons"]) == (1, {"checksum": 1})
        answer, gnosis, _, _ = chat(openai_client(daemon), "hi")  # a 200, or the client raises
        assert gnosis["liquid_memory"] == "miss" and isinstance(answer, str)
        assert daemon.child("station")["restarts"] == 0
    finally:
        stop_daemon(daemon)
