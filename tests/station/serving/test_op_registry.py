"""The op registry: one entry is all the server needs to serve an op, and the op flags
``hello`` advertises come from the same table, so no flag is advertised without its op."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
import trio

from gnosis_daemon import protocol
from gnosis_daemon.client import StationError, open_station_client
from gnosis_daemon.settings import Settings
from station.serving import ops
from station.model.loader import load_model
from station.serving.op_registry import STATION_OPS, OpRegistry, OpSpec, RunsOn
from station.engine.loop import PagedEngine
from station.serving.server import StationServer

pytestmark = pytest.mark.usefixtures("few_threads")

# What hello advertises today: the op flags, the paged engine's feature flags, then the
# features of ops (kv_session_match: generate's match_session over kv_session's sessions;
# kv_session_pins: generate's TTL pins; structured_output: generate's grammar). These
# engines run without a disk tier, so kv_persistence and kv_disk_tier are absent.
STATION_FLAGS = {"generate", "kv_session", "forward", "decode_next", "embed",
                 "paged_kv", "prefix_cache", "continuous_batching", "kv_session_match",
                 "kv_session_pins", "structured_output"}


def _parse_text(ctx: ops.OpContext, args: dict[str, Any]) -> str:
    return ops.arg(args, "text", str)


def _echo(server: StationServer, conn: Any, text: str) -> dict[str, Any]:
    return {"text": text, "model": server.loaded.served_id}


def _upper(loaded: Any, text: str) -> dict[str, Any]:
    return {"text": text.upper()}


# Two ops under one new flag: one answered inline, one on a worker thread.
ECHO = OpSpec("echo", "echo", _parse_text, _echo, RunsOn.INLINE)
UPPER = OpSpec("echo.upper", "echo", _parse_text, _upper, RunsOn.WORKER)


def with_echo() -> OpRegistry:
    registry = STATION_OPS.copy()
    registry.register(ECHO)
    registry.register(UPPER)
    return registry


@pytest.fixture(scope="module")
def loaded(tiny_dir, tmp_path_factory):
    return load_model(Settings(model=str(tiny_dir),
                               runtime_dir=str(tmp_path_factory.mktemp("unused-rt"))))


@asynccontextmanager
async def serving(loaded, runtime_dir, registry: OpRegistry,
                  **settings: Any) -> AsyncIterator[StationServer]:
    """A real ``StationServer`` on a real socket, its engine on a thread of this process."""
    station_settings = Settings(model=loaded.path, runtime_dir=str(runtime_dir), **settings)
    engine = PagedEngine(loaded, station_settings, num_blocks=16)
    engine.start()
    try:
        server = StationServer(station_settings, loaded, engine, registry)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            yield server
            nursery.cancel_scope.cancel()
    finally:
        engine.shutdown()


def test_the_station_ops_are_the_protocol_ops():
    """The host knows ops from gnosis_daemon.protocol (it imports no station code)."""
    assert {s.name: s.capability for s in STATION_OPS if s.capability is not None} == \
        protocol.OP_CAPABILITY
    assert {s.name for s in STATION_OPS if s.capability is None} == protocol.BASE_OPS


def test_flags_come_from_ops_then_engine_features():
    registry = OpRegistry([OpSpec("a", "x", _parse_text, _echo, RunsOn.INLINE),
                           OpSpec("b", "x", _parse_text, _echo, RunsOn.INLINE),
                           OpSpec("c", None, _parse_text, _echo, RunsOn.INLINE),
                           OpSpec("d", "y", _parse_text, _echo, RunsOn.INLINE)])
    assert registry.op_flags() == ["x", "y"]
    assert registry.advertised({"paged_kv": True, "off": False}, frozenset({"y"})) == \
        {"x": True, "paged_kv": True}
    with pytest.raises(ValueError, match=r"engine feature flags \['x'\] name capabilities of ops"):
        registry.advertised({"x": True}, frozenset())
    with pytest.raises(ValueError, match="op 'a' is already registered"):
        registry.register(OpSpec("a", None, _parse_text, _echo, RunsOn.INLINE))
    with pytest.raises(ValueError, match="only an engine op can stream"):
        OpSpec("s", None, _parse_text, _echo, RunsOn.WORKER, streaming=True)


def test_a_feature_flag_is_advertised_only_with_every_op_flag_it_needs():
    full = STATION_OPS.advertised({}, frozenset())
    assert full["kv_session_match"] is True
    # The stale-station drill: without kv_session, generate cannot match sessions.
    assert "kv_session_match" not in STATION_OPS.advertised({}, frozenset({"kv_session"}))
    assert "kv_session_match" not in STATION_OPS.advertised({}, frozenset({"generate"}))
    assert "kv_session_match" not in STATION_OPS.advertised({}, frozenset({"kv_session_match"}))
    without_generate = OpRegistry(s for s in STATION_OPS if s.name != "generate")
    assert "kv_session_match" not in without_generate.advertised({}, frozenset())
    assert full["kv_session_pins"] is True
    assert "kv_session_pins" not in STATION_OPS.advertised({}, frozenset({"kv_session"}))
    with pytest.raises(ValueError, match="kv_session_match"):
        STATION_OPS.advertised({"kv_session_match": True}, frozenset())


async def test_one_registry_entry_adds_an_op_and_its_flag(loaded, tmp_path):
    async with serving(loaded, tmp_path / "rt", with_echo()) as server:
        async with open_station_client(server.settings.station_socket) as conn:
            assert set(conn.hello["capabilities"]) == STATION_FLAGS | {"echo"}
            assert await conn.request("echo", {"text": "héllo"}) == \
                {"text": "héllo", "model": loaded.served_id}
            assert await conn.request("echo.upper", {"text": "héllo"}) == {"text": "HÉLLO"}
            with pytest.raises(StationError) as err:
                await conn.request("echo", {"text": 3})
            assert (err.value.code, err.value.message) == \
                ("bad_request", "argument 'text' must be str, got int")
            assert (await conn.request("tokenize", {"text": "hi"}))["tokens"]
    assert STATION_OPS.get("echo") is None  # registered on a copy only


async def test_a_disabled_flag_takes_its_ops_away(loaded, tmp_path):
    async with serving(loaded, tmp_path / "rt", with_echo(),
                       disable_capabilities="echo") as server:
        async with open_station_client(server.settings.station_socket) as conn:
            assert set(conn.hello["capabilities"]) == STATION_FLAGS
            for op in ("echo", "echo.upper"):
                with pytest.raises(StationError) as err:
                    await conn.request(op, {"text": "x"})
                assert (err.value.code, err.value.message) == \
                    ("unknown_op", f"op {op!r} is not available on this station")
            with pytest.raises(StationError) as err:
                await conn.request("no_such_op")
            assert (err.value.code, err.value.message) == ("unknown_op", "unknown op 'no_such_op'")
