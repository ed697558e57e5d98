"""What matching prompts to KV sessions costs now that the station does it, at admission.

The old design (the host's token mirror, ``host/session_index.py``, measured before
commit 93a0d82 and kept in docs/benchmarks.md, "Past measurements (engine notes)") cost a
linear scan per request, a ``tokenize`` round trip per liquid request and a
``kv_session.list include_tokens`` per (re)connect. This measures the new one:

1. per request, in-process and torch-free: ``KVCacheManager.find_computed_blocks`` with
   ``match_session`` for an 8,177-token prompt against ``--sessions`` sessions of
   ``--session-tokens`` tokens of one tenant, block size 16, in two layouts: ``shared``
   (the worst case for the hash index: every session pins the same blocks, one prefill
   pinned ``--sessions`` times, as the old bench's listing did) and ``distinct`` (every
   session its own tokens and blocks); each for a prompt that shares a session's whole
   prefix, half of it, and nothing. Its parts are timed apart on the same prompts:
   ``block_hashes_for`` (which the prefix cache needs anyway), ``get_computed_blocks``,
   ``SessionRegistry.deepest_match`` and the token comparison of the matched session;
2. per (re)connect: the host lists nothing (0 requests); hello + ``negotiate`` is timed;
3. through the API, a real station and a real liquid host on the default model: hit and
   miss TTFT of short (~32-token) and long (~1,600-token) chat prompts, interleaved.

    python -m bench.session_matching [--rounds 3] [--repeats 200] [--skip-api]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from bench.common import cpu_model, free_port, start_station, stop_station
from bench.liquid import Streamed, long_system_prompt, start_host, stream_chat
from gnosis_daemon.client import open_station_client
from gnosis_daemon.logs import configure_logging
from gnosis_daemon.settings import load_settings
from gnosis_daemon.tokens import common_prefix_len
from host.capabilities import PROBE, negotiate
from station.core.block_pool import block_hashes_for
from station.core.kv_manager import KVCacheManager
from station.core.kv_results import SessionOutcome
from station.core.requests import SamplingParams
from station.core.sequence import Sequence

BLOCK_SIZE = 16
TENANT = "bench"
# The old design's figures (docs/benchmarks.md, 2026-11-30, same machine class), for the summary.
OLD = {"scan_ms": 23.3, "tokenize_short_ms": 0.54, "tokenize_long_ms": 2.68,
       "connect": "kv_session.list include_tokens: 131 ms over the socket + 46 ms unpack + "
                  "68 ms SessionIndex.replace_all (~245 ms) and 79.5 MiB held, at 256 x 8,176"}


def _med(xs: list[float], scale: float = 1000.0, unit: str = "ms", digits: int = 3) -> str:
    xs = sorted(xs)
    return (f"{statistics.median(xs) * scale:.{digits}f} {unit} "
            f"({xs[0] * scale:.{digits}f}-{xs[-1] * scale:.{digits}f}, n={len(xs)})")


def _rss_mib() -> float | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


# -- 1. the station's matching, in-process
def _seq(kv: KVCacheManager, seq_id: str, tokens: list[int], match: bool = False) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=1),
                    extra_keys=kv.extra_keys(TENANT), tenant=TENANT, match_session=match)


def build(layout: str, sessions: int, session_tokens: int, rng: random.Random):
    """A manager holding ``sessions`` sessions of ``session_tokens`` tokens of TENANT, as a
    station's prefill + save_session leaves them: admit, compute, pin, free."""
    num_full = session_tokens // BLOCK_SIZE
    distinct = layout == "distinct"
    num_blocks = (sessions if distinct else 1) * num_full + num_full + 64
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, sessions, model_fingerprint="bench-fp",
                        tenant_salt="bench-salt")
    saved: list[list[int]] = []
    seq = None
    for i in range(sessions):
        if distinct or seq is None:
            tokens = [rng.randrange(100, 30000) for _ in range(session_tokens + 1)]
            seq = _seq(kv, f"prefill-{i}", tokens)
            computed = kv.find_computed_blocks(seq)
            assert kv.allocate_slots(seq, seq.num_tokens - computed.num_cached_tokens, computed)
            seq.num_computed_tokens = seq.num_tokens
            kv.cache_full_blocks(seq)
            saved.append(tokens[:session_tokens])
        assert kv.pin_sequence(f"s{i}", seq, session_tokens) == session_tokens
        if distinct or i == sessions - 1:
            kv.free(seq)
    assert len(kv.sessions) == sessions and kv.pool.num_held_blocks == kv.sessions.pinned_blocks
    return kv, saved


def prompts(saved: list[list[int]], session_tokens: int, rng: random.Random) -> dict[str, tuple]:
    """name -> (tokens, the session tokens it should load: 0 = none)."""
    def fresh(n: int) -> list[int]:
        return [rng.randrange(30000, 40000) for _ in range(n)]  # no saved session uses these
    target = saved[len(saved) // 2]
    half = (session_tokens // BLOCK_SIZE // 2) * BLOCK_SIZE
    return {"whole prefix": (target + fresh(1), session_tokens),
            "half prefix": (target[:half] + fresh(session_tokens + 1 - half), half),
            "no match": (fresh(session_tokens + 1), 0)}


def time_matching(kv: KVCacheManager, prompt: list[int], expect: int, repeats: int) -> dict:
    """Each repeat times, on a fresh sequence, the whole find_computed_blocks and then its
    parts one by one on the same prompt."""
    out: dict[str, list[float]] = {"find": [], "hash": [], "cache": [], "match": [], "compare": []}
    bs, ek = kv.block_size, kv.extra_keys(TENANT)
    max_blocks = (len(prompt) - 1) // bs
    for r in range(repeats):
        seq = _seq(kv, f"q{r}", prompt, match=True)
        t0 = time.perf_counter()
        computed = kv.find_computed_blocks(seq)
        out["find"].append(time.perf_counter() - t0)
        if computed.num_session_tokens != expect or \
                (computed.session_outcome is SessionOutcome.LOADED) != (expect > 0):
            raise SystemExit(f"expected a session of {expect} tokens, got {computed}")
        t0 = time.perf_counter()
        hashes = block_hashes_for(prompt, bs, ek)
        t1 = time.perf_counter()
        kv.pool.get_computed_blocks(prompt, hashes)
        t2 = time.perf_counter()
        found, _ = kv.sessions.deepest_match(TENANT, hashes, max_blocks)
        t3 = time.perf_counter()
        if found is not None:
            common_prefix_len(found.token_ids, prompt)
        t4 = time.perf_counter()
        for key, dt in (("hash", t1 - t0), ("cache", t2 - t1), ("match", t3 - t2), ("compare", t4 - t3)):
            out[key].append(dt)
    return out


def part1(sessions: int, session_tokens: int, repeats: int, seed: int) -> list[tuple]:
    rows = []
    for layout in ("shared", "distinct"):
        gc.collect()
        rss0, t0 = _rss_mib(), time.perf_counter()
        kv, saved = build(layout, sessions, session_tokens, random.Random(seed))
        built_s, rss1 = time.perf_counter() - t0, _rss_mib()
        grew = f"{rss1 - rss0:.0f} MiB RSS" if rss0 is not None and rss1 is not None else "RSS n/a"
        index = kv.sessions._by_hash
        index_mib = index.sizeof() / 2**20
        print(f"\n[1] layout {layout}: {sessions} sessions x {session_tokens:,} tokens, "
              f"{kv.sessions.pinned_blocks:,} pinned blocks of a {kv.num_blocks:,}-block pool; "
              f"built in {built_s:.2f} s, {grew} (pool, sessions, prefix cache and index); "
              f"hash index {len(index):,} keys, {index_mib:.1f} MiB of dicts", flush=True)
        for name, (prompt, expect) in prompts(saved, session_tokens, random.Random(seed + 1)).items():
            t = time_matching(kv, prompt, expect, repeats)
            rows.append((layout, name, expect, t))
            print(f"  {len(prompt):,}-token prompt, {name} (loads {expect:,} tokens): "
                  f"find_computed_blocks {_med(t['find'])}; of it: block_hashes_for "
                  f"{_med(t['hash'])}, get_computed_blocks {_med(t['cache'])}, deepest_match "
                  f"{_med(t['match'])}, session token compare {_med(t['compare'])}", flush=True)
        del kv, saved
    return rows


# -- 2. and 3. a real station and a real host
async def connect_times(sock: Path, repeats: int) -> tuple[list[float], int]:
    """What the host does per (re)connect now: hello (in open_station_client) + negotiate."""
    times, probes = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        async with open_station_client(sock) as conn:
            negotiated = await negotiate(conn, conn.hello or {})
            times.append(time.perf_counter() - t0)
        probes = sum(how == PROBE for how in negotiated.learned.values())
    return times, probes


def _chat(kind: str, nonce: str) -> list[dict]:
    """A chat prompt that no earlier request shares a block with (the nonce comes first)."""
    if kind == "short":
        # A system message of our own: the template's default one would be shared.
        return [{"role": "system", "content": nonce},
                {"role": "user", "content": "What is the capital of France?"}]
    return [{"role": "system", "content": f"{nonce} " + long_system_prompt(1530)},
            {"role": "user", "content": "Summarise the words above in one sentence."}]


def _expect(resp: Streamed, outcome: str, what: str) -> None:
    g = resp.gnosis
    ok = g.get("liquid_memory") == outcome and g.get("path") == "liquid"
    if outcome == "hit":
        ok = ok and int(g.get("cached_tokens") or 0) > 0
    if not ok:
        raise SystemExit(f"{what}: expected liquid_memory={outcome!r} on the liquid path, got {g}")


def part3(port: int, rounds: int) -> dict:
    """Per round and kind: a miss (fresh prompt, saved), then the same prompt again (a hit)."""
    warm = _chat("short", f"warm-up-{uuid.uuid4().hex[:8]}")
    _expect(stream_chat(port, warm, 2), "miss", "warm-up")
    data: dict[str, dict[str, list[Any]]] = {
        k: {"miss": [], "hit": [], "n": [], "cached": []} for k in ("short", "long")}
    for r in range(rounds):
        for kind in (("short", "long") if r % 2 == 0 else ("long", "short")):
            messages = _chat(kind, f"round-{r}-{uuid.uuid4().hex[:8]}")
            miss = stream_chat(port, messages, 2)
            _expect(miss, "miss", f"round {r} {kind} first request")
            hit = stream_chat(port, messages, 2)
            _expect(hit, "hit", f"round {r} {kind} repeat")
            d = data[kind]
            d["miss"].append(miss.gnosis["ttft_ms"] / 1000)
            d["hit"].append(hit.gnosis["ttft_ms"] / 1000)
            d["cached"].append(hit.gnosis["cached_tokens"])
            d["n"].append(hit.gnosis["prompt_tokens"])
            print(f"  round {r} {kind}: {d['n'][-1]} prompt tokens, miss {miss.gnosis['ttft_ms']:.0f} ms, "
                  f"hit {hit.gnosis['ttft_ms']:.0f} ms (cached {hit.gnosis['cached_tokens']})", flush=True)
    return data


def run_station(args, settings, tmp: Path) -> tuple[tuple[list[float], int], dict]:
    runtime_dir = tmp / "run"
    station = start_station(settings, runtime_dir, tmp / "station.log")
    host = None
    try:
        sock = runtime_dir / "station.sock"
        print("\n[2] per (re)connect: the host sends hello + negotiate and lists no session "
              "(0 kv_session.list requests)", flush=True)
        connect = trio.run(connect_times, sock, args.connect_repeats)
        print(f"  hello + negotiate over the socket: {_med(connect[0])}; capability probes: "
              f"{connect[1]}", flush=True)
        port = free_port()
        host = start_host(settings, runtime_dir, port, tmp / "host.log", liquid=True)
        print(f"\n[3] through the API (host on :{port}, liquid memory effective), "
              f"{args.rounds} interleaved rounds:", flush=True)
        return connect, part3(port, args.rounds)
    finally:
        if host is not None:
            host.terminate()
            host.wait(timeout=30)
        stop_station(station)


def summary(header: str, rows: list[tuple], connect, api: dict | None, sessions: int) -> None:
    print("\n" + "=" * 78 + "\nSUMMARY\n" + header)
    print(f"\n1. Matching per request, in the station at admission (medians, ms; "
          f"{sessions} sessions, one tenant):")
    print("layout   | prompt       | loads | find_computed_blocks | hashing | cache lookup | "
          "deepest_match | token compare")
    for layout, name, expect, t in rows:
        m = {k: statistics.median(v) * 1000 for k, v in t.items()}
        print(f"{layout:8} | {name:12} | {expect:5} | {m['find']:20.3f} | {m['hash']:7.3f} | "
              f"{m['cache']:12.3f} | {m['match']:13.3f} | {m['compare']:.3f}")
    worst, match, compare = (max(statistics.median(t[k]) for *_, t in rows) * 1000
                             for k in ("find", "match", "compare"))
    print(f"old: the host's SessionIndex.plan scan, worst case (256 x 8,176, all share the prefix): "
          f"{OLD['scan_ms']} ms per request, on the host's event loop, plus a tokenize round trip "
          f"({OLD['tokenize_short_ms']} ms short / {OLD['tokenize_long_ms']} ms long)")
    print(f"new: find_computed_blocks at most {worst:.3f} ms per request in total (worst median "
          f"above), on the engine thread. Added by matching: deepest_match, at most {match:.3f} ms. "
          f"The hashing and cache lookup ran at admission before matching existed, and the token "
          f"compare (at most {compare:.3f} ms) ran for the old design's explicit load_session too")
    print("\n2. Per (re)connect:")
    print(f"old: {OLD['connect']}")
    if connect is not None:
        print(f"new: 0 listing requests; hello + negotiate {_med(connect[0])}, "
              f"{connect[1]} capability probes")
    else:
        print("new: 0 listing requests (host/liquid_memory.py on_connect only negotiates)")
    print("\n3. Through the API (host ttft_ms; no tokenize round trip any more):")
    if api is None:
        print("skipped (--skip-api)")
    else:
        print("chat prompt | prompt tokens | hit TTFT | miss TTFT | hit / miss (of medians) | cached on hit")
        for kind, d in api.items():
            hit, miss = statistics.median(d["hit"]), statistics.median(d["miss"])
            print(f"{kind:11} | {min(d['n']):6}-{max(d['n']):6} | {_med(d['hit'], digits=0)} | "
                  f"{_med(d['miss'], digits=0)} | {hit / miss:.3f} | "
                  f"{min(d['cached'])}-{max(d['cached'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.session_matching", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved API rounds (part 3)")
    parser.add_argument("--repeats", type=int, default=200, help="timed admissions per prompt (part 1)")
    parser.add_argument("--connect-repeats", type=int, default=20, help="hello + negotiate (part 2)")
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--session-tokens", type=int, default=8176,
                        help="a multiple of the block size (16)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--skip-api", action="store_true",
                        help="no station or host: part 1 only (part 2 stated, not timed)")
    args = parser.parse_args(argv)
    if args.session_tokens % BLOCK_SIZE or args.sessions < 1:
        parser.error("--session-tokens must be a multiple of 16 and --sessions at least 1")
    command = " ".join(["python -m bench.session_matching",
                        *(argv if argv is not None else sys.argv[1:])])
    header = (f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, "
              f"{os.cpu_count()} CPUs, {cpu_model()}; python {platform.python_version()}\n"
              f"command: {command}")
    print(header, flush=True)
    configure_logging("bench", level="warning")  # negotiate logs each connect at info
    rows = part1(args.sessions, args.session_tokens, args.repeats, args.seed)
    connect, api = None, None
    if not args.skip_api:
        settings = load_settings(cli={"kv_session_budget": max(256, args.sessions)})
        with tempfile.TemporaryDirectory(prefix="gnosis-matching-") as tmp:
            connect, api = run_station(args, settings, Path(tmp))
    summary(header, rows, connect, api, args.sessions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
