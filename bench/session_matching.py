"""Who should match prompts to KV sessions: the host's mirror, or the station at admission?

Measures the two costs the host's mirror (``host/session_index.py``) brings, on the
default model with a real station and a real host process:

1. per liquid request, the extra ``tokenize`` round trip (``host/liquid_memory.py
   _prompt_tokens``) against the TTFT of a prefix hit and of a miss through the HTTP API,
   for a short (~30-token) and a long (~1,600-token) chat prompt, interleaved in rounds;
2. per (re)connect, ``kv_session.list`` with ``include_tokens: true`` on a station holding
   ``--sessions`` sessions of ``--session-tokens`` tokens (they all pin the same blocks,
   so the pool holds one copy of the KV while the listing carries every session's ids, as
   it would with distinct prompts), timed over the socket against the same listing
   without tokens, plus the reply's msgpack size, the host-side unpack and
   ``SessionIndex.replace_all``/``plan`` on it, and the frame size against
   ``max_frame_bytes`` for larger budgets (computed).

    python -m bench.session_matching [--rounds 5] [--tokenize-repeats 30]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc
import uuid
from datetime import datetime, timezone
from pathlib import Path

import msgpack
import trio

from bench.common import cpu_model, free_port, make_prompt_ids, start_station, stop_station
from bench.liquid import long_system_prompt, start_host, stream_chat
from gnosis_daemon.client import open_station_client
from gnosis_daemon.settings import load_settings
from host.session_index import SessionIndex


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"median {statistics.median(xs) * 1000:.2f} ms (min {xs[0] * 1000:.2f}, "
            f"max {xs[-1] * 1000:.2f}, n={len(xs)})")


def _chat(kind: str, nonce: str) -> list[dict]:
    """A chat prompt that no earlier request shares a block with (the nonce comes first)."""
    if kind == "short":
        # A system message of our own: the template's default one would be shared.
        return [{"role": "system", "content": nonce},
                {"role": "user", "content": "What is the capital of France?"}]
    return [{"role": "system", "content": f"{nonce} " + long_system_prompt(1530)},
            {"role": "user", "content": "Summarise the words above in one sentence."}]


async def _tokenize_times(sock: Path, messages: list[dict], repeats: int) -> tuple[list[float], int]:
    times, n = [], 0
    async with open_station_client(sock) as conn:
        req = {"messages": messages, "add_generation_prompt": True}
        await conn.request("tokenize", req)  # the connection's first request is not timed
        for _ in range(repeats):
            start = time.perf_counter()
            result = await conn.request("tokenize", req, rid=uuid.uuid4().hex)
            times.append(time.perf_counter() - start)
            n = len(result["tokens"])
    return times, n


def part1(sock: Path, port: int, rounds: int, repeats: int) -> dict:
    """tokenize round trip vs hit/miss TTFT, per kind, interleaved: miss, tokenize, hit."""
    stream_chat(port, _chat("short", "warm-up"), 2)
    out = {}
    data = {k: {"tok": [], "tok_round": [], "miss": [], "hit": [], "n": 0, "cached": []}
            for k in ("short", "long")}
    for r in range(rounds):
        for kind in (("short", "long") if r % 2 == 0 else ("long", "short")):
            messages = _chat(kind, f"round-{r}-{uuid.uuid4().hex[:8]}")
            miss = stream_chat(port, messages, 2)
            times, n = trio.run(_tokenize_times, sock, messages, repeats)
            hit = stream_chat(port, messages, 2)
            d = data[kind]
            assert miss.gnosis.get("liquid_memory") == "miss", miss.gnosis
            assert hit.gnosis.get("liquid_memory") == "hit", hit.gnosis
            d["tok"] += times
            d["tok_round"].append(statistics.median(times))
            d["miss"].append(miss.gnosis["ttft_ms"] / 1000)
            d["hit"].append(hit.gnosis["ttft_ms"] / 1000)
            d["cached"].append(hit.gnosis.get("cached_tokens"))
            d["n"] = n
            print(f"round {r} {kind}: {n} tokens, tokenize {statistics.median(times) * 1000:.2f} ms, "
                  f"miss {miss.gnosis['ttft_ms']:.0f} ms, hit {hit.gnosis['ttft_ms']:.0f} ms "
                  f"(cached {hit.gnosis.get('cached_tokens')})", flush=True)
    for kind, d in data.items():
        tok, miss, hit = statistics.median(d["tok_round"]), statistics.median(d["miss"]), statistics.median(d["hit"])
        out[kind] = d | {"tok_med": tok, "miss_med": miss, "hit_med": hit}
        print(f"{kind} ({d['n']} tokens): tokenize round trip {_ms(d['tok'])}; "
              f"per-round medians {' '.join(f'{x * 1000:.2f}' for x in d['tok_round'])} ms; "
              f"miss TTFT {_ms(d['miss'])}; hit TTFT {_ms(d['hit'])}; "
              f"tokenize / hit {tok / hit:.3f}, tokenize / miss {tok / miss:.4f}, "
              f"hit / miss {hit / miss:.3f}", flush=True)
    return out


async def part2(sock: Path, sessions: int, session_tokens: int, rounds: int) -> dict:
    async with open_station_client(sock) as conn:
        listed = await conn.request("kv_session.list", {})
        for s in listed["sessions"]:  # part 1's sessions: start from an empty registry
            await conn.request("kv_session.delete", {"session_id": s["session_id"]})
        vocab = int(((conn.hello or {}).get("model") or {}).get("vocab_size") or 49152)
        tokens = make_prompt_ids(vocab, session_tokens + 1, seed=7)
        start = time.perf_counter()
        async with conn.open_stream("generate", {"tokens": tokens, "max_tokens": 1, "temperature": 0,
                                                 "ignore_eos": True, "tenant": "lb",
                                                 "save_session": "lb.0"}) as stream:
            async for _ in stream:
                pass
        print(f"prefill of {len(tokens)} tokens: {time.perf_counter() - start:.1f} s", flush=True)
        for i in range(1, sessions):
            await conn.request("kv_session.save", {"session_id": f"lb.{i}", "tenant": "lb",
                                                   "tokens": tokens[:session_tokens],
                                                   "prefix_len": session_tokens})
        listed = await conn.request("kv_session.list", {"include_tokens": True})
        got = listed["sessions"]
        assert len(got) == sessions and all(len(s["tokens"]) == session_tokens for s in got), \
            (len(got), {len(s["tokens"]) for s in got})
        with_t, without_t = [], []
        for r in range(rounds):
            for inc in ((True, False) if r % 2 == 0 else (False, True)):
                t0 = time.perf_counter()
                await conn.request("kv_session.list", {"include_tokens": inc})
                (with_t if inc else without_t).append(time.perf_counter() - t0)
        # What a host sees when the listing outgrows its frame limit: a client whose limit
        # is half this reply stands in for a listing twice max_frame_bytes.
        overflow = "no error"
        try:
            async with open_station_client(sock, max_frame_bytes=len(msgpack.packb(listed)) // 2) as small:
                with trio.fail_after(60):
                    await small.request("kv_session.list", {"include_tokens": True})
        except BaseException as exc:  # noqa: BLE001 - reported, whatever it is
            overflow = f"{type(exc).__name__}: {exc}"
        print(f"listing past the client's frame limit: {overflow}", flush=True)
    reply = {"sessions": got, "budget": listed.get("budget"), "pinned_blocks": listed.get("pinned_blocks")}
    packed = msgpack.packb(reply, use_bin_type=True)
    unpack_t, replace_t, plan_t = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        unpacked = msgpack.unpackb(packed, raw=False, strict_map_key=False)
        unpack_t.append(time.perf_counter() - t0)
        index = SessionIndex(sessions)
        t0 = time.perf_counter()
        index.replace_all(unpacked["sessions"])
        replace_t.append(time.perf_counter() - t0)
        prompt = tokens[:session_tokens] + [tokens[-1]] * 16  # every session shares its whole prefix
        t0 = time.perf_counter()
        plan = index.plan("lb", prompt, None, min_tokens=16)
        plan_t.append(time.perf_counter() - t0)
        assert plan.load_tokens == session_tokens
    del unpacked
    tracemalloc.start()
    unpacked = msgpack.unpackb(packed, raw=False, strict_map_key=False)
    index = SessionIndex(sessions)
    index.replace_all(unpacked["sessions"])
    del unpacked
    mirror_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"kv_session.list include_tokens=true over the socket: {_ms(with_t)}", flush=True)
    print(f"kv_session.list include_tokens=false over the socket: {_ms(without_t)}", flush=True)
    print(f"reply: {len(packed):,} bytes msgpack ({len(packed) / (sessions * session_tokens):.2f} "
          f"bytes/id); host unpack {_ms(unpack_t)}; SessionIndex.replace_all {_ms(replace_t)}; "
          f"plan over {sessions} x {session_tokens} (worst case: all share the prefix) {_ms(plan_t)}; "
          f"mirror held after unpack+replace_all: {mirror_bytes / 2**20:.1f} MiB", flush=True)
    return {"with": with_t, "without": without_t, "bytes": len(packed), "unpack": unpack_t,
            "replace": replace_t, "plan": plan_t, "mirror_bytes": mirror_bytes}


def frame_table(max_frame_bytes: int) -> None:
    """msgpack int sizes: 0-127 1 byte, 128-255 2, 256-65535 3, 65536-2^32-1 5."""
    print(f"\nframe size of kv_session.list include_tokens=true vs max_frame_bytes "
          f"{max_frame_bytes:,} (ids only; ~100 bytes/session of fields on top):")
    print("budget x tokens/session | ids | vocab < 65,536 (3 B/id) | vocab >= 65,536 (5 B/id)")
    for budget, tokens in ((256, 8192), (256, 16384), (256, 32768), (512, 8192), (1024, 8192),
                           (256, 131072)):
        ids = budget * tokens
        cols = []
        for per in (3, 5):
            size = ids * per + budget * 100
            cols.append(f"{size / 2**20:.1f} MiB {'OVERFLOWS' if size > max_frame_bytes else 'fits'}")
        print(f"{budget} x {tokens} | {ids:,} | {cols[0]} | {cols[1]}")
    print(f"largest listing that fits: {max_frame_bytes // 3:,} ids at 3 B/id "
          f"(256 x {max_frame_bytes // 3 // 256:,} tokens), {max_frame_bytes // 5:,} ids at 5 B/id "
          f"(256 x {max_frame_bytes // 5 // 256:,} tokens)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.session_matching", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokenize-repeats", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--session-tokens", type=int, default=8176,
                        help="a multiple of the block size, below the model's context")
    parser.add_argument("--skip-http", action="store_true", help="only part 2 and the table")
    args = parser.parse_args(argv)
    # SmolLM2's context is 8,192 tokens (the station caps max_model_len there): a prompt of
    # 8,177 tokens pins 511 full blocks = 8,176 tokens, the longest session it can hold.
    settings = load_settings(cli={"kv_session_budget": max(256, args.sessions)})
    print(f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, "
          f"{os.cpu_count()} CPUs, {cpu_model()}, python {platform.python_version()}; command: "
          f"python -m bench.session_matching {' '.join(argv if argv is not None else sys.argv[1:])}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="gnosis-matching-") as tmp:
        runtime_dir = Path(tmp) / "run"
        station = start_station(settings, runtime_dir, Path(tmp) / "station.log")
        host = None
        try:
            sock = runtime_dir / "station.sock"
            if not args.skip_http:
                port = free_port()
                host = start_host(settings, runtime_dir, port, Path(tmp) / "host.log", liquid=True)
                part1(sock, port, args.rounds, args.tokenize_repeats)
                host.terminate()
                host.wait(timeout=30)
                host = None
            trio.run(part2, sock, args.sessions, args.session_tokens, max(args.rounds, 7))
        finally:
            if host is not None:
                host.kill()
            stop_station(station)
    frame_table(settings.max_frame_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
