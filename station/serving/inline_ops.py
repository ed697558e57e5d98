"""The ops answered on the trio thread from the server's own state: hello, health, stats,
cancel (``RunsOn.INLINE`` in ``station.serving.op_registry``).

Each handler is ``handler(server, conn, args)``: it reads figures the engine keeps as a
thread-safe snapshot, or the connection's own requests, and never waits. What it may read of
the server is ``InlineContext``; ``StationServer`` is one.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Protocol

import gnosis_daemon
from gnosis_daemon.protocol import PROTOCOL_VERSION, ErrorCode
from station.tier.start import tier_report
from station.serving.chat import tool_format
from station.serving.connection import Connection
from station.serving.liveness import serving_report
from station.serving.ops import OpContext, bad

if TYPE_CHECKING:
    from station.engine.loop import PagedEngine
    from station.sampling.grammar_compile import GrammarCompiles


class InlineContext(OpContext, Protocol):
    """What an inline op may read of the server: a parser's context, the engine, and the
    server's own figures (set by the server; the tier's and the start check's by its start)."""

    engine: PagedEngine
    started: float  # time.monotonic() when the server was made
    shutting_down: bool
    kv_tier: dict[str, Any] | None
    start_check: dict[str, Any] | None
    grammar_compiles: GrammarCompiles
    text_jobs: dict[object, float]  # the tokenizer jobs running now, with when each began
    text_threads: int

    @property
    def num_connections(self) -> int: ...


def hello(server: InlineContext, conn: Connection, args: None) -> dict[str, Any]:
    loaded, stats = server.loaded, server.engine.stats()
    return {
        "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "version": gnosis_daemon.__version__,
        "model": {"id": loaded.served_id, "path": loaded.path,
                  "fingerprint": loaded.fingerprint, "model_type": loaded.model_type,
                  "max_model_len": loaded.max_model_len, "vocab_size": loaded.vocab_size,
                  "eos_token_ids": list(loaded.eos_token_ids),
                  "max_token_chars": loaded.max_token_chars,
                  **tool_format(loaded, server.settings.tool_parser),
                  "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
                  # each layer's attention kind, the decode plan (station.plan) and the start
                  # check that proved the engine
                  "attention": loaded.attention.summary() if loaded.attention is not None else None,
                  "decode_plan": server.engine.runner.plan.as_dict(),
                  "start_check": server.start_check},
        "capabilities": dict(server.capabilities),
        "kv_pool": {"block_size": int(server.engine.block_size),
                    "dtype": str(server.engine.kv_cache.shape.dtype).removeprefix("torch."),
                    "blocks_total": int(stats.get("blocks_total", 0)),
                    "blocks_free": int(stats.get("blocks_free", 0))},
        "kv_tier": tier_report(server.kv_tier or {}, stats),
    }


def health(server: InlineContext, conn: Connection, args: None) -> dict[str, Any]:
    stats = server.engine.stats()
    return {"status": "shutting_down" if server.shutting_down else "ok", "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - server.started, 3),
            "running": int(stats.get("running", 0)), "waiting": int(stats.get("waiting", 0)),
            "kv_tier": tier_report(server.kv_tier or {}, stats),
            # the engine loop's heartbeat and the tokenizer workers' jobs: stuck or not
            "serving": serving_report(server.engine, server.text_jobs, server.text_threads,
                                      server.settings)}


def stats(server: InlineContext, conn: Connection, args: None) -> dict[str, Any]:
    stats = server.engine.stats()
    return {**stats, "connections": server.num_connections,
            "kv_tier": tier_report(server.kv_tier or {}, stats),
            "grammar_compiles": server.grammar_compiles.figures()}


def parse_cancel(ctx: OpContext, args: dict[str, Any]) -> int | str:
    target = args.get("target")
    if not isinstance(target, (int, str)) or isinstance(target, bool):
        raise bad("argument 'target' must be the id of a request on this connection")
    return target


def cancel(server: InlineContext, conn: Connection, target: int | str) -> dict[str, Any]:
    """Stop a request of this connection wherever it is: tokenizing, in an engine call, or
    generating (the engine ends it ``cancelled`` at its next step boundary)."""
    prep = conn.preparing.get(target)
    if prep is not None:
        return {"cancelled": prep.cancel(ErrorCode.CANCELLED, "request cancelled")}
    call = conn.calls.get(target)
    if call is not None:
        return {"cancelled": call.cancel()}
    gen = conn.generates.get(target)
    if gen is None or gen.done:
        return {"cancelled": False}
    server.engine.abort(gen.engine_id)
    return {"cancelled": True}
