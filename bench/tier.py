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
3. **decode while the writer is busy.** One stream decodes while ``kv_session.save``
   pins prompts already in the prefix cache: no prefill joins the steps, the writer
   writes whole sessions. The tier's budget (``kv_disk_bytes``) holds 1.5 sessions, so
   each save evicts the previous one from disk and every save rewrites its blocks: the
   writer stays busy for as long as saves are queued (one is kept queued). Idle rounds
   poll ``stats`` at the same rate and save nothing. At least ``BUSY_MIN_ROUNDS`` rounds:
   the goal is 5% and one round's noise on a shared machine is more than that.
4. **write-behind lag** of those saves, as ``stats`` reports it.

3 and 4 run twice: at the default ``kv_io_nice`` (the goal row) and at the other end of the
I/O process's priority (a row of the trade-off between decode and the write-behind bound).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import trio

from bench.common import Pairs, Report, make_prompt_ids, start_station, station_ttft, stop_station
from bench.page_cache import page_cache_cold
from gnosis_daemon.client import open_station_client

POLL_S = 0.05  # stats polls while a decode runs (both sides), and while waiting for the writer
POOL_BLOCKS = 24  # the restart figure's pool (about 17 MiB of SmolLM2-135M's float32 KV)
FILL_MULTIPLE = 10  # the restart figure's tier holds at least this many pools of KV
RESTART_ROUNDS = 3  # each round is two station starts (~8 s each here)
SEED = 1000  # prompt seeds of these figures: apart from the other figures'
BUSY_MIN_ROUNDS = 5


def tier_figures(report: Report, settings, args, tmp: Path) -> None:
    base = dataclasses.replace(settings, kv_persistence=True)
    session_bytes, block_file_bytes = _hit_figure(report, base, args, tmp / "tier-hit")
    _restart_figure(report, base, args, tmp / "tier-restart", block_file_bytes)
    _busy_figures(report, base, args, tmp / "tier-busy", session_bytes)
    # The other end of the I/O process's priority trade-off, measured in the same run.
    other = 0 if base.kv_io_nice else 19
    _busy_figures(report, dataclasses.replace(base, kv_io_nice=other), args,
                  tmp / f"tier-busy-nice{other}", session_bytes, primary=False)


class TierBenchError(RuntimeError):
    """The tier did not do what a figure relies on: it would measure nothing."""


@contextlib.contextmanager
def _station(settings, runtime_dir: Path):
    """A station on ``runtime_dir`` (its tier: ``runtime_dir/state/kv-tier``); -> (socket,
    seconds from spawn to the first hello answered). A clean stop flushes the writer."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = start_station(settings, runtime_dir, runtime_dir.parent / f"{runtime_dir.name}.log")
    started_s = time.perf_counter() - start
    try:
        yield runtime_dir / "station.sock", started_s
    finally:
        stop_station(proc)


def _check_tier(hello: dict) -> dict:
    tier = hello.get("kv_tier") or {}
    if not tier.get("enabled") or tier.get("error") or "start_sessions" not in tier:
        raise TierBenchError(f"the station has no disk tier: {tier}")
    return tier


async def _settle(conn, sessions: int = 0, timeout_s: float = 300.0) -> dict:
    """Wait until the write-behind is idle (nothing queued, no byte written for 3 polls)
    and the store holds at least ``sessions`` manifests; -> the stats then."""
    # An engine call wakes the engine thread: a session saved in a sequence's last step (a
    # generate of max_tokens 1) is only queued for writing when the engine next wakes up.
    await conn.request("kv_session.list", {})
    deadline = time.monotonic() + timeout_s
    last, still = None, 0
    while True:
        stats = await conn.request("stats", {})
        written = stats.get("disk_bytes_written")
        idle = stats["write_behind_queued"] == 0 and stats.get("disk_sessions", 0) >= sessions
        still = still + 1 if idle and written == last else 0
        if still >= 3:
            return stats
        if time.monotonic() > deadline:
            raise TierBenchError(f"the write-behind did not settle in {timeout_s:.0f} s: {stats}")
        last = written
        await trio.sleep(POLL_S)


# -- 1. disk hit / cold prefill
def _hit_figure(report: Report, settings, args, root: Path) -> tuple[float, int]:
    """-> (bytes of one saved session on disk, bytes of one block file)."""
    runtime_dir, rounds = root / "run", args.rounds
    cold: list[float] = []
    info: dict = {}

    async def phase_a(sock: Path) -> dict:
        async with open_station_client(sock) as conn:
            _check_tier(conn.hello)
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
                stats = await _settle(conn, sessions=r + 1)
            return stats

    with _station(settings, runtime_dir) as (sock, _):
        stats_a = trio.run(phase_a, sock)
    tier_dir = runtime_dir / "state" / "kv-tier"
    block_file_bytes = next(tier_dir.rglob("*.kvb")).stat().st_size
    cold_note = page_cache_cold(tier_dir)

    pairs, cached, loads = Pairs(), set(), {}

    async def phase_b(sock: Path) -> None:
        async with open_station_client(sock) as conn:
            tier = _check_tier(conn.hello)
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

    with _station(settings, runtime_dir) as (sock, _):
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
            _check_tier(conn.hello)
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
                stats = await _settle(conn, sessions=n)  # durable before the next evicts it
            if stats["kv_sessions_lost"] or stats["kv_sessions_offloaded"] == 0:
                raise TierBenchError(f"filling the tier lost sessions or offloaded none: {stats}")
            fill.update(sessions=n, bytes=stats["disk_bytes"], tokens=tokens)

    with _station(small, full_dir) as (sock, _):
        trio.run(fill_tier, sock)
    rounds, pairs = min(args.rounds, RESTART_ROUNDS), Pairs()
    for r in range(rounds):
        took = {}
        for kind in (("empty", "full") if r % 2 == 0 else ("full", "empty")):
            runtime_dir = full_dir if kind == "full" else root / f"empty-{r}"
            with _station(small, runtime_dir) as (sock, took[kind]):
                hello = trio.run(_hello, sock)  # untimed: start_station has waited for one
            tier = _check_tier(hello)
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


# -- 3./4. decode beside a busy writer; write-behind lag
@dataclasses.dataclass
class _Round:
    tps: float
    saves: int
    busy_through: bool  # every poll during the decode saw a queued save or the writer's progress
    window_cpu_s: float  # the I/O process's CPU between the first and the last poll inside the decode ...
    window_s: float  # ... and the seconds between those polls


class _Saver:
    """``kv_session.save`` of the prefix-cached prompts in turn, across rounds: the other
    prompt's blocks were evicted from disk by the last save, so each save writes them all."""

    def __init__(self, conn, sources: list[list[int]]) -> None:
        self.conn, self.sources, self.count = conn, sources, 0

    async def save(self) -> None:
        tokens = self.sources[self.count % len(self.sources)]
        await self.conn.request("kv_session.save", {"session_id": f"busy-{self.count}", "tokens": tokens,
                                                    "prefix_len": len(tokens), "tenant": "tier-busy"})
        self.count += 1


async def _decode_round(conn, prompt: list[int], decode_tokens: int, saver: _Saver | None) -> _Round:
    """One stream's greedy decode tokens/s; with ``saver``, a save is kept queued behind
    the one the writer is writing for the whole decode."""
    polls: list[tuple[float, int, float, tuple]] = []  # (time, queued, I/O process CPU s, progress)
    saved_before = saver.count if saver else 0
    done = trio.Event()

    async def poll() -> None:
        while not done.is_set():
            stats = await conn.request("stats", {})
            # the writer's progress: a job taken, bytes and files (blocks, manifests) written,
            # blocks evicted from disk (a save's eviction writes no byte), a lag recorded
            progress = tuple(stats.get(k) for k in ("write_behind_queued", "disk_bytes_written",
                                                     "disk_writes", "disk_evicted_blocks",
                                                     "write_behind_lag_ms_p50"))
            polls.append((time.perf_counter(), stats["write_behind_queued"],
                          stats.get("kv_io_cpu_s") or 0.0, progress))
            if saver and stats["write_behind_queued"] == 0:
                await saver.save()
            await trio.sleep(POLL_S)

    first = end = None
    n = 0
    if saver:
        await saver.save()  # the writer starts before the decode does
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        async with conn.open_stream("generate", {"tokens": prompt, "max_tokens": decode_tokens + 1,
                                                 "temperature": 0, "ignore_eos": True,
                                                 "tenant": "tier-decode"}) as stream:
            async for event in stream:
                if event.get("type") == "tokens":
                    if first is None:
                        first = time.perf_counter()  # the prefill token is not counted
                    else:
                        n += len(event["token_ids"])
        end = time.perf_counter()
        done.set()
    inside = [i for i, poll in enumerate(polls) if first <= poll[0] <= end]
    busy = bool(inside) and all(polls[i][1] > 0 or (i > 0 and polls[i][3] != polls[i - 1][3])
                                for i in inside)
    window_cpu_s = polls[inside[-1]][2] - polls[inside[0]][2] if inside else 0.0
    window_s = polls[inside[-1]][0] - polls[inside[0]][0] if inside else 0.0
    saves = saver.count - saved_before if saver else 0
    return _Round(n / (end - first), saves, busy, window_cpu_s, window_s)


def _busy_figures(report: Report, settings, args, root: Path, session_bytes: float,
                  primary: bool = True) -> None:
    """Rows 3 and 4 at ``settings.kv_io_nice``; ``primary``: the default's (the goal row),
    else one row of the trade-off at another priority."""
    budget, rounds = max(1, int(session_bytes * 1.5)), max(args.rounds, BUSY_MIN_ROUNDS)  # each save evicts the last
    pairs, idle_rates, busy_rounds = Pairs(), [], []
    out: dict = {"written": 0}

    async def measure(sock: Path) -> None:
        async with open_station_client(sock) as conn:
            _check_tier(conn.hello)
            vocab = conn.hello["model"]["vocab_size"]
            short = make_prompt_ids(vocab, 32, seed=2)
            sources = [make_prompt_ids(vocab, args.prompt_tokens, seed=SEED + 500 + i) for i in range(2)]
            for prompt in sources:  # into the prefix cache: the saves pin resident blocks
                await station_ttft(conn, prompt, "tier-busy")
            await _decode_round(conn, short, args.decode_tokens, None)  # warm-up
            saver = _Saver(conn, sources)
            out["stats"] = await _settle(conn)
            for r in range(rounds):
                got = {}
                for side in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
                    before = out["stats"].get("disk_bytes_written", 0)
                    got[side] = await _decode_round(conn, short, args.decode_tokens,
                                                    saver if side == "busy" else None)
                    out["stats"] = await _settle(conn)
                    out["written"] += out["stats"].get("disk_bytes_written", 0) - before
                    if side == "busy" and out["written"] < 0.5 * saver.count * session_bytes:
                        raise TierBenchError(f"round {r}: {saver.count} saves wrote only "
                                             f"{out['written']} bytes: {got['busy']}, {out['stats']}")
                pairs.add(got["busy"].tps, got["idle"].tps)
                idle_rates.append(got["idle"].tps)
                busy_rounds.append(got["busy"])

    with _station(dataclasses.replace(settings, kv_disk_bytes=budget), root / "run") as (sock, _):
        trio.run(measure, sock)
    stats = out["stats"]
    saves = sum(b.saves for b in busy_rounds)
    if not primary:
        report.add(f"at kv_io_nice {settings.kv_io_nice}: decode busy / idle", pairs.ratio, "info", None,
                   f"busy {pairs.median(0):.1f} tok/s, idle {pairs.median(1):.1f} tok/s, the same load as "
                   f"the rows above; write-behind lag p50 {stats.get('write_behind_lag_ms_p50')} ms, p99 "
                   f"{stats.get('write_behind_lag_ms_p99')} ms, {stats.get('write_behind_late')} of "
                   f"{stats.get('write_behind_done')} saves later than kv_write_behind_s; {pairs.spread()}")
        return
    cpu, window = sum(b.window_cpu_s for b in busy_rounds), sum(b.window_s for b in busy_rounds)
    through = sum(b.busy_through for b in busy_rounds)
    control = min(idle_rates) / max(idle_rates)
    report.add("decode tok/s of another stream while the writer is busy / idle", pairs.ratio, ">=", 0.95,
               f"I/O process at kv_io_nice {settings.kv_io_nice} (the default; its writer waits for "
               f"decode steps to pause until kv_write_behind_s / 2 after a save: "
               f"{stats.get('disk_write_yield_s')} s of waiting in all); busy {pairs.median(0):.1f} "
               f"tok/s, idle {pairs.median(1):.1f} tok/s over {args.decode_tokens} tokens; {saves} "
               f"kv_session.save of {args.prompt_tokens:,}-token prefix-cached prompts "
               f"({session_bytes / 1e6:.1f} MB each, disk budget {budget / 1e6:.1f} MB so every save "
               f"rewrites its blocks: {out['written'] / 1e6:.1f} MB written in all), one kept queued: "
               f"the I/O process ran {cpu * 1000:.0f} ms of CPU inside the busy decodes "
               f"({cpu / window * 100 if window else 0:.0f}% of one core), "
               f"a save queued or the writer's progress seen at every stats poll "
               f"of the decode in {through}/{rounds} rounds; both sides poll stats every "
               f"{POLL_S * 1000:.0f} ms; {pairs.spread()}; noise: A/A row below")
    report.add("A/A control: slowest / fastest idle decode round", control, "info", None,
               f"the machine's own noise between identical runs of the row above ({rounds} rounds)")
    p99, p50 = stats.get("write_behind_lag_ms_p99"), stats.get("write_behind_lag_ms_p50")
    if p99 is None:
        raise TierBenchError(f"no write-behind lag reported after {saves} saves: {stats}")
    report.add("write-behind lag p99 under load (ms)", p99, "info", None,
               f"p50 {p50} ms over the {saves} saves above (from save to durable, queued behind "
               f"one {session_bytes / 1e6:.1f} MB session being written, beside a decode); "
               f"{stats.get('write_behind_late')} later than kv_write_behind_s {settings.kv_write_behind_s}"
               f" s, {stats.get('write_behind_errors')} errors, "
               f"{stats.get('write_behind_done')} sessions made durable, "
               f"{stats.get('disk_writes')} files written")
