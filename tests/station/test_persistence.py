"""The KV-session disk tier: sessions written on a clean stop come back after a restart,
and a generation that loads one equals model.generate token for token."""

from __future__ import annotations

import trio

from gnosis_daemon.client import open_station_client
from tests.station.conftest import start_station
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


def test_a_tier_from_another_model_is_ignored(tmp_path, tiny_dir):
    runtime = tmp_path / "run"
    station = start_station(tiny_dir, runtime, GNOSIS_KV_BLOCK_SIZE="4")
    try:
        trio.run(lambda: _generate(station.socket, save_session="conv-1"))
    finally:
        assert station.stop() == 0
    other = build_tiny_model(tmp_path / "qwen2", "qwen2")
    station = start_station(other, runtime, GNOSIS_KV_BLOCK_SIZE="4")
    try:
        assert trio.run(_list, station.socket)["sessions"] == []
        assert "kv_tier_ignored" in station.log()
    finally:
        station.stop()
