"""The KV disk tier through real station processes (``gnosis-daemon station``): sessions
saved by one station are hits from disk in the next, whether it stopped cleanly or was
SIGKILLed, with greedy output token for token as before, and a deleted one does not come
back; the files are private (0600, directories 0700); bad files (a flipped byte, a cut
file, another model's or another block size's manifest copied into this model's tier)
never stop the station: each is quarantined intact, counted and reported, and its session
is a miss served correctly."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import trio

from gnosis_daemon.client import open_station_client
from tests.station.conftest import start_station
from tests.support.kv_tier import (flip_byte, foreign_manifest, model_layout, quarantined,
                                   session_files, tier_dir, truncate)
from tests.support.tiny_models import reference_generate

BS = 4
ENV = {"GNOSIS_KV_BLOCK_SIZE": str(BS)}
TENANT = "t1"
PROMPT = list(range(40, 90))  # 50 tokens: 12 full blocks of 4 saved, all 12 usable
GONE = [7, 8, 9] * 5  # 15 tokens, 3 blocks: no block in common with PROMPT


def prompt_of(i: int) -> list[int]:
    """13 tokens: 3 full blocks saved (12 tokens), all 3 usable (the 13th's logits are
    needed). Distinct first tokens: no two prompts share a block."""
    return [100 + i] + [(7 * i + 3 * k) % 250 + 1 for k in range(12)]


async def _generate(sock: Path, tokens: list[int], max_tokens: int, **args) -> tuple[dict, dict]:
    async with open_station_client(sock) as conn:
        async with conn.open_stream("generate", {"tokens": tokens, "max_tokens": max_tokens,
                                                 "temperature": 0, "tenant": TENANT,
                                                 **args}) as stream:
            prefill = [e async for e in stream if e.get("type") == "prefill"][0]
        return prefill, stream.result


def generate(station, tokens: list[int], max_tokens: int = 4, **args) -> tuple[dict, dict]:
    return trio.run(lambda: _generate(station.socket, tokens, max_tokens, **args))


def request(station, op: str, args: dict | None = None) -> dict:
    async def call():
        async with open_station_client(station.socket) as conn:
            return await conn.request(op, args)
    return trio.run(call)


def wait_written(station, sessions: int, timeout: float = 60.0) -> dict:
    """Poll ``stats`` until the write-behind made ``sessions`` sessions durable: the store
    holds that many manifests (each written after its blocks). ``disk_writes`` would not
    do: it counts the store's file writes, blocks too, and ``write_behind_queued`` drops as
    the writer takes a job, before it is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = request(station, "stats")
        if stats["disk_sessions"] >= sessions and stats["write_behind_queued"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the write-behind did not write {sessions} sessions: {stats}")


def manifests(root: Path) -> list[Path]:
    return sorted((root / "sessions").iterdir())


def test_sessions_survive_a_clean_restart_and_a_deleted_one_stays_gone(tmp_path, tiny_dir):
    runtime = tmp_path / "run"
    station = start_station(tiny_dir, runtime, **ENV)
    try:
        root = tier_dir(runtime / "state", station.hello["model"]["fingerprint"])
        assert station.hello["capabilities"]["kv_persistence"] is True
        tier = station.hello["kv_tier"]
        assert (tier["path"], tier["enabled"], tier["error"]) == (str(root), True, None)
        assert (tier["start_sessions"], tier["start_quarantined"], tier["quarantined"]) == (0, 0, 0)
        prefill, first = generate(station, PROMPT, 8, save_session="conv-1")
        assert (prefill["saved"], prefill["session_loaded"]) == (True, False)
        assert generate(station, GONE, save_session="gone")[0]["saved"] is True
        wait_written(station, 2)  # "gone" is on disk before it is deleted
        # Both on disk, both still in the pool: none is only on disk.
        tier = request(station, "stats")["kv_tier"]
        assert (tier["pool_sessions"], tier["disk_sessions"], tier["disk_only_sessions"]) == (
            2, 2, 0)
        assert request(station, "kv_session.delete", {"session_id": "gone"}) == {"deleted": True}
    finally:
        assert station.stop() == 0  # a clean stop flushes the write-behind, the delete too
    [manifest] = manifests(root)
    assert manifest.name == session_files(root, "conv-1").manifest.name
    assert len(list((root / "blocks").rglob("*.kvb"))) == 12  # "gone"'s 3 blocks went with it
    # Private from birth: the files hold the tenant's tokens and KV.
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in (p for p in root.rglob("*") if p.is_file()):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f

    station = start_station(tiny_dir, runtime, **ENV)
    try:
        tier = station.hello["kv_tier"]
        assert (tier["start_sessions"], tier["start_quarantined"], tier["start_incomplete"],
                tier["disk_sessions"], tier["disk_only_sessions"], tier["error"]) == (
            1, 0, 0, 1, 1, None)
        listed = request(station, "kv_session.list", {"include_tokens": True})["sessions"]
        assert [(s["session_id"], s["tenant"], s["tokens"], s["tier"]) for s in listed] == [
            ("conv-1", TENANT, PROMPT[:48], "disk")]
        prefill, again = generate(station, PROMPT, 8, match_session=True)
        assert (prefill["session_loaded"], prefill["session_id"], prefill["session_tier"],
                prefill["session_tokens"], prefill["cached_tokens"]) == (
            True, "conv-1", "disk", 48, 48)
        assert again["token_ids"] == first["token_ids"] == reference_generate(tiny_dir, PROMPT, 8)
        # The deleted session did not come back: not matched, not loadable by name.
        prefill, _ = generate(station, GONE, match_session=True)
        assert (prefill["session_loaded"], prefill["session_error"], prefill["cached_tokens"]) == (
            False, None, 0)
        prefill, _ = generate(station, GONE, load_session="gone")
        assert (prefill["session_loaded"], prefill["session_error"]) == (False, "not_found")
    finally:
        assert station.stop() == 0


def test_sessions_survive_sigkill(tmp_path, tiny_dir):
    runtime = tmp_path / "run"
    prompts = [prompt_of(i) for i in range(20)]
    station = start_station(tiny_dir, runtime, **ENV)
    try:
        root = tier_dir(runtime / "state", station.hello["model"]["fingerprint"])
        before = []
        for i, prompt in enumerate(prompts):
            prefill, result = generate(station, prompt, save_session=f"s{i}")
            assert prefill["saved"] is True
            before.append(result["token_ids"])
        wait_written(station, len(prompts))
        station.proc.kill()  # SIGKILL: no clean stop, no flush
        assert station.proc.wait(timeout=20) == -9
    finally:
        station.stop()
    assert len(manifests(root)) == 20

    station = start_station(tiny_dir, runtime, **ENV)
    try:
        tier = station.hello["kv_tier"]
        assert (tier["start_sessions"], tier["start_quarantined"], tier["start_incomplete"],
                tier["error"]) == (20, 0, 0, None)
        for i, prompt in enumerate(prompts):
            prefill, result = generate(station, prompt, match_session=True)
            assert (prefill["session_loaded"], prefill["session_id"], prefill["session_tier"],
                    prefill["session_tokens"]) == (True, f"s{i}", "disk", 12), (i, prefill)
            assert result["token_ids"] == before[i], i
        assert before[7] == reference_generate(tiny_dir, prompts[7], 4)
        stats = request(station, "stats")
        assert (stats["kv_disk_loads"], stats["disk_quarantined_total"]) == (20, 0)
    finally:
        assert station.stop() == 0


def test_bad_files_are_quarantined_and_the_station_serves(tmp_path, tiny_dir):
    runtime = tmp_path / "run"
    prompts = {name: prompt_of(i) for i, name in enumerate("ABCD")}
    station = start_station(tiny_dir, runtime, **ENV)
    try:
        before = {}
        for name, prompt in prompts.items():
            prefill, result = generate(station, prompt, save_session=name)
            assert prefill["saved"] is True
            before[name] = result["token_ids"]
        fingerprint = station.hello["model"]["fingerprint"]
    finally:
        assert station.stop() == 0
    root = tier_dir(runtime / "state", fingerprint)
    ours = model_layout(tiny_dir, BS, fingerprint)
    bad = {}
    path = session_files(root, "A").blocks[1]
    bad[path.name] = flip_byte(path)  # a KV byte: only the checksum can tell
    path = session_files(root, "B").blocks[2]
    bad[path.name] = truncate(path)
    for layout, sid in ((ours.but(fingerprint="another-model"), "other-model"),
                        (ours.but(block_size=8), "other-block-size")):
        path = foreign_manifest(tmp_path / sid, root, layout, sid, list(range(1, 17)), TENANT)
        bad[path.name] = path.read_bytes()

    station = start_station(tiny_dir, runtime, **ENV)
    try:
        pid = station.hello["pid"]
        assert pid == station.proc.pid
        tier = station.hello["kv_tier"]
        # The manifests are read at start, block files only when a request needs them.
        assert (tier["start_sessions"], tier["start_quarantined"], tier["quarantined"],
                tier["quarantine_reasons"], tier["error"]) == (
            4, 2, 2, {"fingerprint": 1, "block_size": 1}, None)
        for name in ("A", "B"):
            prefill, result = generate(station, prompts[name], match_session=True)
            assert (prefill["session_loaded"], prefill["session_error"],
                    prefill["cached_tokens"]) == (False, "quarantined", 0), (name, prefill)
            assert result["token_ids"] == before[name], name
        assert before["A"] == reference_generate(tiny_dir, prompts["A"], 4)
        for name in ("C", "D"):
            prefill, result = generate(station, prompts[name], match_session=True)
            assert (prefill["session_loaded"], prefill["session_id"], prefill["session_tier"],
                    prefill["session_tokens"]) == (True, name, "disk", 12), (name, prefill)
            assert result["token_ids"] == before[name], name
        stats = request(station, "stats")
        assert (stats["kv_tier"]["quarantined"], stats["kv_tier"]["quarantine_reasons"]) == (
            4, {"fingerprint": 1, "block_size": 1, "checksum": 1, "truncated": 1})
        assert (stats["kv_disk_loads"], stats["kv_disk_quarantined_loads"]) == (2, 2)
        assert request(station, "health")["pid"] == pid and station.proc.poll() is None
        assert quarantined(root) == bad  # every bad file kept, byte for byte
        logged = [json.loads(line) for line in station.log().splitlines()
                  if '"kv_store_quarantined"' in line]
        assert sorted((e["reason"], e["level"]) for e in logged) == [
            ("block_size", "warning"), ("checksum", "warning"), ("fingerprint", "warning"),
            ("truncated", "warning")]
    finally:
        assert station.stop() == 0
    assert quarantined(root) == bad
    # A and B lost a block: their manifests went too, so no later start offers them again.
    assert {p.name for p in manifests(root)} == {session_files(root, n).manifest.name
                                                 for n in ("C", "D")}
