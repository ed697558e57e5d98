"""Disk-tier figures 3 and 4 for `make bench`: decode beside the writer, and its lag.

One stream decodes (its threads keep every core busy: a saturating decode) while
``kv_session.save`` pins prompts already in the prefix cache: no prefill joins the steps,
the writer writes whole sessions. The tier's budget (``kv_disk_bytes``) holds 1.5
sessions, so each save evicts the previous one from disk and every save rewrites its
blocks. Idle rounds poll ``stats`` at the same rate and save nothing; busy and idle rounds
alternate, at least ``BUSY_MIN_ROUNDS`` of each (``--tier-busy-rounds``; one round's noise here
is 10-20%).

* **a writer that must meet its bound** (the goal rows): a save of a chat-sized prompt
  (``BOUNDED_PROMPT_TOKENS``) every ``kv_write_behind_s`` through longer decodes, what
  a busy conversation host sees; decode busy / idle, and the lag p99 against twice the
  bound. Run at the default ``kv_io_nice`` (19: the writer yields to decode until half the
  bound's first quarter, then rises to the station's priority) and at 0 (it never yields): which design
  costs decode least, measured side by side.
* **a saturated writer** (info rows): saves of ``--prompt-tokens`` prompts queued back to
  back, one always waiting: more than the disk can take beside decode, so every save is
  late and the writer works at the station's priority; what decode pays then, at both
  ends of ``kv_io_nice``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import trio

from bench.common import Pairs, Report, make_prompt_ids, station_ttft
from bench.tier_station import POLL_S, TierBenchError, check_tier, settle, tier_station
from gnosis_daemon.client import open_station_client

SEED = 1500  # prompt seeds of these figures: apart from the other figures'
BUSY_MIN_ROUNDS = 5
BOUNDED_PROMPT_TOKENS = 512  # a conversation's saved prefix, a few turns in (at most --prompt-tokens)
BOUNDED_DECODES = 4  # x --decode-tokens (256: about 3 s here, several paced saves in each)


@dataclasses.dataclass
class _Round:
    tps: float
    saves: int
    busy_through: bool  # every poll during the decode saw a queued save or the writer's progress
    window_cpu_s: float  # the I/O process's CPU between the first and the last poll inside the decode ...
    window_s: float  # ... and the seconds between those polls


@dataclasses.dataclass
class _Run:
    pairs: Pairs
    idle_rates: list[float]
    rounds: list[_Round]
    stats: dict
    written: int

    @property
    def saves(self) -> int:
        return sum(r.saves for r in self.rounds)

    @property
    def cpu_share(self) -> str:
        cpu, window = sum(r.window_cpu_s for r in self.rounds), sum(r.window_s for r in self.rounds)
        return (f"the I/O process ran {cpu * 1000:.0f} ms of CPU inside the busy decodes "
                f"({cpu / window * 100 if window else 0:.0f}% of one core)")

    def lag(self, bound_s: float) -> str:
        s = self.stats
        return (f"write-behind lag p50 {s.get('write_behind_lag_ms_p50')} ms, p99 "
                f"{s.get('write_behind_lag_ms_p99')} ms, {s.get('write_behind_late')} of "
                f"{s.get('write_behind_done')} saves later than kv_write_behind_s {bound_s} s, "
                f"{s.get('write_behind_errors')} errors, {s.get('write_behind_dropped')} dropped, "
                f"{s.get('disk_write_risen_blocks')} blocks written at the station's priority")


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


async def _decode_round(conn, prompt: list[int], decode_tokens: int, saver: _Saver | None,
                        period_s: float | None) -> _Round:
    """One stream's greedy decode tokens/s; with ``saver``, a save every ``period_s``
    (None: a save is kept queued behind the one being written for the whole decode)."""
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
            if saver and period_s is None and stats["write_behind_queued"] == 0:
                await saver.save()
            await trio.sleep(POLL_S)

    async def paced() -> None:
        while not done.is_set():
            await saver.save()
            await trio.sleep(period_s)

    first = end = None
    n = 0
    async with trio.open_nursery() as nursery:
        if saver and period_s is None:
            await saver.save()  # the writer starts before the decode does
        elif saver:
            nursery.start_soon(paced)
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


def _run(settings, args, root: Path, prompt_tokens: int, decode_tokens: int, session_bytes: float,
         period_s: float | None) -> _Run:
    """Interleaved idle and busy decode rounds on a station of their own."""
    budget = max(1, int(session_bytes * 1.5))  # each save evicts the last
    rounds = max(args.rounds, args.tier_busy_rounds)
    run = _Run(Pairs(), [], [], {}, 0)

    async def measure(sock: Path) -> None:
        async with open_station_client(sock) as conn:
            check_tier(conn.hello)
            vocab = conn.hello["model"]["vocab_size"]
            short = make_prompt_ids(vocab, 32, seed=2)
            sources = [make_prompt_ids(vocab, prompt_tokens, seed=SEED + prompt_tokens + i) for i in range(2)]
            for prompt in sources:  # into the prefix cache: the saves pin resident blocks
                await station_ttft(conn, prompt, "tier-busy")
            await _decode_round(conn, short, decode_tokens, None, None)  # warm-up
            saver = _Saver(conn, sources)
            run.stats = await settle(conn)
            for r in range(rounds):
                got = {}
                for side in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
                    before = run.stats.get("disk_bytes_written", 0)
                    got[side] = await _decode_round(conn, short, decode_tokens,
                                                    saver if side == "busy" else None, period_s)
                    run.stats = await settle(conn)
                    run.written += run.stats.get("disk_bytes_written", 0) - before
                    if side == "busy" and run.written < 0.5 * saver.count * session_bytes:
                        raise TierBenchError(f"round {r}: {saver.count} saves wrote only "
                                             f"{run.written} bytes: {got['busy']}, {run.stats}")
                run.pairs.add(got["busy"].tps, got["idle"].tps)
                run.idle_rates.append(got["idle"].tps)
                run.rounds.append(got["busy"])

    with tier_station(dataclasses.replace(settings, kv_disk_bytes=budget), root / "run") as (sock, _):
        trio.run(measure, sock)
    if run.stats.get("write_behind_lag_ms_p99") is None:
        raise TierBenchError(f"no write-behind lag reported after {run.saves} saves: {run.stats}")
    return run


def bounded_figures(report: Report, settings, args, root: Path, session_bytes: float) -> None:
    """The goal rows: a save every ``kv_write_behind_s`` beside a saturating decode, at the
    default ``kv_io_nice`` and at 0 (``session_bytes``: a ``--prompt-tokens`` session's)."""
    bound = settings.kv_write_behind_s
    tokens, decode = min(BOUNDED_PROMPT_TOKENS, args.prompt_tokens), BOUNDED_DECODES * args.decode_tokens
    size = session_bytes * tokens / args.prompt_tokens
    other = 0 if settings.kv_io_nice else 19
    runs = {nice: _run(dataclasses.replace(settings, kv_io_nice=nice), args, root / f"nice{nice}",
                       tokens, decode, size, bound)
            for nice in (settings.kv_io_nice, other)}
    run = runs[settings.kv_io_nice]
    load = (f"a kv_session.save of a {tokens}-token prefix-cached prompt "
            f"({size / 1e6:.1f} MB) every {bound} s through {decode}-token decodes")
    report.add("decode beside a writer that meets its bound / idle", run.pairs.ratio, ">=", 0.9,
               f"kv_io_nice {settings.kv_io_nice} (the default: the writer yields to decode steps "
               f"until kv_write_behind_s / 4 after a save, {run.stats.get('disk_write_yield_s')} s "
               f"of waiting in all, then writes at the station's priority); {load}, {run.saves} "
               f"saves, {run.written / 1e6:.1f} MB written; busy {run.pairs.median(0):.1f} tok/s, "
               f"idle {run.pairs.median(1):.1f} tok/s; {run.cpu_share}; {run.pairs.spread()}")
    report.add("write-behind lag p99 beside a saturating decode (ms)",
               run.stats["write_behind_lag_ms_p99"], "<=", 2000 * bound, run.lag(bound))
    alt = runs[other]
    report.add(f"the same at kv_io_nice {other}: decode busy / idle", alt.pairs.ratio, "info", None,
               f"busy {alt.pairs.median(0):.1f} tok/s, idle {alt.pairs.median(1):.1f} tok/s, the "
               f"same load; {alt.lag(bound)}; {alt.cpu_share}; {alt.pairs.spread()}")


def busy_figures(report: Report, settings, args, root: Path, session_bytes: float) -> None:
    """The info rows: the writer saturated, at the default ``kv_io_nice`` and at the other end."""
    bound = settings.kv_write_behind_s
    other = 0 if settings.kv_io_nice else 19
    for nice in (settings.kv_io_nice, other):
        run = _run(dataclasses.replace(settings, kv_io_nice=nice), args, root / f"nice{nice}",
                   args.prompt_tokens, args.decode_tokens, session_bytes, None)
        through = sum(r.busy_through for r in run.rounds)
        report.add(f"saturated writer at kv_io_nice {nice}: decode busy / idle", run.pairs.ratio,
                   "info", None,
                   f"{run.saves} kv_session.save of {args.prompt_tokens:,}-token prefix-cached "
                   f"prompts ({session_bytes / 1e6:.1f} MB each, {run.written / 1e6:.1f} MB written "
                   f"in all), one kept queued, so every save is late and written at the station's "
                   f"priority; busy {run.pairs.median(0):.1f} tok/s, idle {run.pairs.median(1):.1f} "
                   f"tok/s over {args.decode_tokens} tokens; {run.lag(bound)}; {run.cpu_share}; a save "
                   f"queued or the writer's progress seen at every stats poll of the decode in "
                   f"{through}/{len(run.rounds)} rounds; {run.pairs.spread()}")
        if nice == settings.kv_io_nice:
            control = min(run.idle_rates) / max(run.idle_rates)
            report.add("A/A control: slowest / fastest idle decode round", control, "info", None,
                       f"the machine's own noise between identical runs of the row above "
                       f"({len(run.rounds)} rounds)")
