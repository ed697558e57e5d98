"""Disk-tier figures for `make bench`: the KV pool's disk tier (``<state_dir>/kv-tier``).

Each figure runs its own station processes on their own runtime (and state) directories:

1. **disk hit / cold prefill.** Station A prefills a fresh prompt per round with
   ``save_session`` (a miss: the cold TTFT) and writes it behind; A stops cleanly (SIGTERM
   flushes the writer), the tier files are dropped from the page cache, and station B (an
   empty pool on the same tier) answers each round's prompt with ``match_session``: a
   disk hit, read back and checked. Round i's hit is paired with round i's miss.
2. **restart.** Station start (spawn to the first ``hello`` answered) on a tier holding at
   least 10x the pool's KV bytes, against an empty tier; a small pool (``kv_cache_bytes``,
   24 blocks; it sizes the CPU pool only) keeps 10x affordable. One station fills the
   tier: each saved session is on disk before the next prompt evicts it from the pool.
3./4. **decode beside the writer, and the write-behind lag**: ``bench.tier_busy``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import trio

from bench.common import Pairs, Report, make_prompt_ids, station_ttft
from bench.page_cache import page_cache_cold
from bench.tier_busy import bounded_figures, busy_figures
from bench.tier_station import TierBenchError, check_tier, settle, tier_station
from gnosis_daemon.client import open_station_client

POOL_BLOCKS = 24  # the restart figure's pool (about 17 MiB of SmolLM2-135M's float32 KV)
FILL_MULTIPLE = 10  # the restart figure's tier holds at least this many pools of KV
RESTART_ROUNDS = 3  # each round is two station starts (~8 s each here)
SEED = 1000  # prompt seeds of these figures: apart from the other figures'


def tier_figures(report: Report, settings, args, tmp: Path) -> None:
    base = dataclasses.replace(settings, kv_persistence=True)
    session_bytes, block_file_bytes = _hit_figure(report, base, args, tmp / "tier-hit")
    _restart_figure(report, base, args, tmp / "tier-restart", block_file_bytes)
    bounded_figures(report, base, args, tmp / "tier-bounded", session_bytes)
    busy_figures(report, base, args, tmp / "tier-busy", session_bytes)


# -- 1. disk hit / cold prefill
def _hit_figure(report: Report, settings, args, root: Path) -> tuple[float, int]:
    """-> (bytes of one saved session on disk, bytes of one block file)."""
    runtime_dir, rounds = root / "run", args.rounds
    cold: list[float] = []
    info: dict = {}

    async def phase_a(sock: Path) -> dict:
        async with open_station_client(sock) as conn:
            check_tier(conn.hello)
            info["vocab"] = conn.hello["model"]["vocab_size"]
            info["bs"] = conn.hello["kv_pool"]["block_size"]
            await station_ttft(conn, make_prompt_ids(info["vocab"], 64, seed=99), tenant="warmup")
            for r in range(rounds):
                prompt = make_prompt_ids(info["vocab"], args.prompt_tokens, seed=SEED + r)
                miss = await station_ttft(conn, prompt, f"tier-{r}", save_session=f"tier-{r}")
                if miss.cached_tokens != 0 or not miss.prefill.get("saved"):
                    raise TierBenchError(f"round {r}'s first generate was no saved miss: {miss.prefill}")
                cold.append(miss.ttft_s)
                # on disk before the next round: its prefill should not share the CPU with the writer
                stats = await settle(conn, sessions=r + 1)
            return stats

    with tier_station(settings, runtime_dir) as (sock, _):
        stats_a = trio.run(phase_a, sock)
    tier_dir = runtime_dir / "state" / "kv-tier"
    block_file_bytes = next(tier_dir.rglob("*.kvb")).stat().st_size
    cold_note = page_cache_cold(tier_dir)

    pairs, cached, loads = Pairs(), set(), {}

    async def phase_b(sock: Path) -> None:
        async with open_station_client(sock) as conn:
            tier = check_tier(conn.hello)
            if tier["start_sessions"] != rounds or conn.hello["kv_pool"]["blocks_free"] != \
                    conn.hello["kv_pool"]["blocks_total"]:
                raise TierBenchError(f"the restarted station should find {rounds} sessions on "
                                     f"disk and an empty pool: {tier}, {conn.hello['kv_pool']}")
            await station_ttft(conn, make_prompt_ids(info["vocab"], 64, seed=99), tenant="warmup")
            for r in range(rounds):
                prompt = make_prompt_ids(info["vocab"], args.prompt_tokens, seed=SEED + r)
                hit = await station_ttft(conn, prompt, f"tier-{r}", match_session=True)
                pre = hit.prefill
                if not (pre.get("session_loaded") and pre.get("session_tier") == "disk"
                        and hit.cached_tokens >= len(prompt) - 2 * info["bs"]):
                    raise TierBenchError(f"round {r}: no disk hit for a disk-only session: {pre}")
                pairs.add(hit.ttft_s, cold[r])
                cached.add(hit.cached_tokens)
            loads.update(await conn.request("stats", {}))

    with tier_station(settings, runtime_dir) as (sock, _):
        trio.run(phase_b, sock)
    session_bytes = stats_a["disk_bytes"] / rounds
    read_back = loads.get("read_back_ms_p50")
    report.add(f"disk-tier hit TTFT / cold-prefill TTFT ({args.prompt_tokens:,}-token prompt)",
               pairs.ratio, "<=", 0.2,
               f"hit {pairs.median(0) * 1000:.1f} ms (session_tier disk, cached "
               f"{'/'.join(map(str, sorted(cached)))}, {session_bytes / 1e6:.1f} MB read back and "
               f"checked, read-back p50 {read_back} ms), cold prefill {pairs.median(1) * 1000:.1f} "
               f"ms; misses on station A, hits on station B restarted on A's tier with an empty "
               f"pool (a round's two sides up to minutes apart), round i's hit paired with round "
               f"i's miss; "
               f"{cold_note}; {pairs.spread()}")
    return session_bytes, block_file_bytes


# -- 2. restart with a full tier / an empty one
async def _hello(sock: Path) -> dict:
    async with open_station_client(sock) as conn:
        return conn.hello


def _restart_figure(report: Report, settings, args, root: Path, block_file_bytes: int) -> None:
    # A block file is its KV plus a small header: this pool holds POOL_BLOCKS blocks (a
    # header's worth more on a tiny model), and pool bytes counted in block files are a
    # slight overcount, so the multiple below is if anything understated.
    small = dataclasses.replace(settings, kv_cache_bytes=POOL_BLOCKS * block_file_bytes)
    full_dir = root / "full"
    fill: dict = {}

    async def fill_tier(sock: Path) -> None:
        async with open_station_client(sock) as conn:
            check_tier(conn.hello)
            vocab, pool = conn.hello["model"]["vocab_size"], conn.hello["kv_pool"]
            blocks, bs = pool["blocks_total"], pool["block_size"]
            fill["pool_blocks"], fill["pool_bytes"] = blocks, blocks * block_file_bytes
            tokens = max(1, blocks * 2 // 3) * bs  # fits the pool beside nothing else
            stats = await conn.request("stats", {})
            n = 0
            while stats["disk_bytes"] < FILL_MULTIPLE * fill["pool_bytes"]:
                if n >= 400:
                    raise TierBenchError(f"400 sessions did not fill the tier to {FILL_MULTIPLE}x a "
                                         f"pool of {blocks} blocks: {stats}")
                prompt = make_prompt_ids(vocab, tokens, seed=SEED + 1000 + n)
                await station_ttft(conn, prompt, "tier-fill", save_session=f"fill-{n}")
                n += 1
                stats = await settle(conn, sessions=n)  # durable before the next evicts it
            if stats["kv_sessions_lost"] or stats["kv_sessions_offloaded"] == 0:
                raise TierBenchError(f"filling the tier lost sessions or offloaded none: {stats}")
            fill.update(sessions=n, bytes=stats["disk_bytes"], tokens=tokens)

    with tier_station(small, full_dir) as (sock, _):
        trio.run(fill_tier, sock)
    rounds, pairs = min(args.rounds, RESTART_ROUNDS), Pairs()
    for r in range(rounds):
        took = {}
        for kind in (("empty", "full") if r % 2 == 0 else ("full", "empty")):
            runtime_dir = full_dir if kind == "full" else root / f"empty-{r}"
            with tier_station(small, runtime_dir) as (sock, took[kind]):
                hello = trio.run(_hello, sock)  # untimed: start_station has waited for one
            tier = check_tier(hello)
            want = fill["sessions"] if kind == "full" else 0
            if tier["start_sessions"] != want or hello["kv_pool"]["blocks_free"] != fill["pool_blocks"]:
                raise TierBenchError(f"a {kind} start should find {want} sessions and load no KV: "
                                     f"{tier}, {hello['kv_pool']}")
        pairs.add(took["full"], took["empty"])
    report.add(f"station start with a {FILL_MULTIPLE}x-pool disk tier / with an empty tier",
               pairs.ratio, "<=", 1.2,
               f"full {pairs.median(0):.2f} s, empty {pairs.median(1):.2f} s (spawn to the first "
               f"hello answered, polled every 0.2 s); tier {fill['sessions']} sessions of "
               f"{fill['tokens']} tokens, {fill['bytes'] / 1e6:.0f} MB = "
               f"{fill['bytes'] / fill['pool_bytes']:.1f}x the {fill['pool_bytes'] / 1e6:.1f} MB "
               f"pool ({fill['pool_blocks']} blocks), found without loading KV; {rounds} rounds"
               f"{f' of --rounds {args.rounds}' if rounds < args.rounds else ''} (two starts "
               f"each); {pairs.spread()}")
