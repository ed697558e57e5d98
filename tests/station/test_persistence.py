"""The KV-session disk tier through real station processes: sessions written on a clean
stop come back after a restart, and a generation that loads one equals model.generate token
for token; another model's tier is kept, never overwritten; a torn tier is moved aside
intact, reported in hello and health, and the station serves on its first start."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from gnosis_daemon.client import open_station_client
from tests.station.conftest import start_station
from tests.support.kv_tier import write_torn_tier
from tests.support.tiny_models import build_tiny_model, reference_generate

PROMPT = list(range(40, 90))  # 50 tokens: 12 full blocks of 4


async def _generate(sock, **args) -> tuple[dict, dict]:
    async with open_station_client(sock) as conn:
        async with conn.open_stream("generate", {"tokens": PROMPT, "max_tokens": 8, "temperature": 0,
                                                 "tenant": "t1", **args}) as stream:
            prefill = [e async for e in stream if e.get("type") == "prefill"][0]
        return prefill, stream.result


async def _list(sock) -> dict:
    async with open_station_client(sock) as conn:
        return await conn.request("kv_session.list", {"include_tokens": True})


def test_sessions_survive_a_station_restart(tmp_path, tiny_dir):
    runtime = tmp_path / "run"
    env = {"GNOSIS_KV_BLOCK_SIZE": "4"}
    station = start_station(tiny_dir, runtime, **env)
    try:
        assert station.hello["capabilities"]["kv_persistence"] is True
        prefill, first = trio.run(lambda: _generate(station.socket, save_session="conv-1"))
        assert prefill["saved"] is True
        before = trio.run(_list, station.socket)
    finally:
        assert station.stop() == 0
    assert (runtime / "state" / "kv-sessions" / "manifest.json").exists()

    station = start_station(tiny_dir, runtime, **env)
    try:
        after = trio.run(_list, station.socket)
        assert [(s["session_id"], s["tenant"], s["tokens"]) for s in after["sessions"]] == \
            [(s["session_id"], s["tenant"], s["tokens"]) for s in before["sessions"]]
        assert after["pinned_blocks"] == before["pinned_blocks"] == 48 // 4
        prefill, again = trio.run(lambda: _generate(station.socket, load_session="conv-1"))
        assert prefill["session_loaded"] is True and prefill["session_tokens"] == 48
        assert again["token_ids"] == first["token_ids"] == reference_generate(tiny_dir, PROMPT, 8)
    finally:
        station.stop()


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


async def _health(sock) -> dict:
    async with open_station_client(sock) as conn:
        return await conn.request("health")


def test_a_tier_from_another_model_is_ignored_and_kept(tmp_path, tiny_dir):
    runtime = tmp_path / "run"
    station = start_station(tiny_dir, runtime, GNOSIS_KV_BLOCK_SIZE="4")
    try:
        trio.run(lambda: _generate(station.socket, save_session="conv-1"))
    finally:
        assert station.stop() == 0
    tier = runtime / "state" / "kv-sessions"
    llama_tier = _files(tier)
    other = build_tiny_model(tmp_path / "qwen2", "qwen2")
    station = start_station(other, runtime, GNOSIS_KV_BLOCK_SIZE="4")
    try:
        assert trio.run(_list, station.socket)["sessions"] == []
        assert "kv_tier_ignored" in station.log()
        foreign = station.hello["kv_tier"]["foreign"]
        assert foreign["path"] == str(tier)
        assert foreign["reason"].startswith("written by another model or KV layout: fingerprint ")
        assert station.hello["kv_tier"]["rejected"] == 0
        # qwen2's own session: its clean stop must write a tier, and keep llama's.
        trio.run(lambda: _generate(station.socket, save_session="conv-q"))
    finally:
        assert station.stop() == 0
    [kept] = tier.parent.glob("kv-sessions.foreign-*")
    fingerprint = json.loads(llama_tier["manifest.json"])["fingerprint"]
    assert kept.name.startswith(f"kv-sessions.foreign-{fingerprint[:12]}-")
    assert _files(kept) == llama_tier
    assert json.loads((tier / "manifest.json").read_text())["sessions"][0]["session_id"] == "conv-q"


def test_a_corrupt_tier_is_moved_aside_and_the_station_serves(tmp_path, tiny_dir):
    runtime = tmp_path / "run"
    tier = runtime / "state" / "kv-sessions"
    write_torn_tier(tiny_dir, tier, block_size=4)
    before = _files(tier)
    # start_station waits for hello within the normal start timeout: the first start serves.
    station = start_station(tiny_dir, runtime, GNOSIS_KV_BLOCK_SIZE="4")
    try:
        [moved] = tier.parent.glob("kv-sessions.rejected-*")
        assert not tier.exists() and _files(moved) == before
        report = station.hello["kv_tier"]
        assert report["rejected"] == 1 and report["restored_sessions"] == 0
        assert report["rejections"][0]["path"] == str(moved)
        assert report["rejections"][0]["reason"].startswith("kv.pt cannot be loaded: ")
        assert trio.run(_health, station.socket)["kv_tier"] == report
        prefill, result = trio.run(lambda: _generate(station.socket))
        assert result["token_ids"] == reference_generate(tiny_dir, PROMPT, 8)
        [line] = [json.loads(x) for x in station.log().splitlines() if "kv_tier_rejected" in x]
        assert (line["level"], line["moved_to"]) == ("warning", str(moved))
    finally:
        assert station.stop() == 0
    assert _files(moved) == before
