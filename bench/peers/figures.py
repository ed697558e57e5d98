"""The peer rows: the daemon (station + host, through its OpenAI API) beside llama.cpp on the
same GGUF file, interleaved round by round; see ``section.METHOD`` for the method."""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol, TypeVar

import trio

from bench.common import Pairs, Report, cpu_model, free_port, start_station, stop_station
from bench.liquid import start_host
from bench.peers import plots
from bench.peers.http_side import Completion, aggregate, daemon_endpoint, text_prompt, text_prompt_tokens
from bench.peers.procs import InprocPeer, PeerProc, ServerPeer, measuring
from bench.peers.section import llama_cpp_version, render, skip_reason
from gnosis_daemon.client import open_station_client

T = TypeVar("T")  # what ``interleaved`` measures

PLAIN = "llama.cpp server without flash attention"  # the TTFT rows' second llama.cpp server
SINGLE = "single-stream decode tok/s, daemon / llama.cpp (better of server and in-process)"
DECODE_PNG = "decode_by_concurrency.png"
TTFT_PNG = "ttft_by_prompt.png"


def add_arguments(parser) -> None:
    group = parser.add_argument_group("the peer rows (llama.cpp beside the daemon)")
    group.add_argument("--peer", choices=("auto", "install", "off"), default="auto",
                       help="auto: run them when llama-cpp-python[server] is importable; install: "
                            "pip-install it first when it is not (compiles llama.cpp, ~10 min); "
                            "off: skip them (the reason is written)")
    group.add_argument("--peer-only", action="store_true",
                       help="run only the peer rows and rewrite only their section of --out")
    group.add_argument("--peer-streams", default="1,2,4,8,16",
                       help="concurrency levels of the decode plot")
    group.add_argument("--peer-prompts", default="250,500,1000,2000,4000,8000",
                       help="prompt lengths (tokens, about) of the TTFT plot and of llama.cpp's "
                            "line in the prefill plot")
    group.add_argument("--plot-rounds", type=int, default=2,
                       help="interleaved rounds per point of the plots (their median is plotted)")


class Target(Protocol):
    def complete(self, prompt: str, max_tokens: int) -> Completion: ...


@dataclass
class Side:
    name: str
    target: Target  # an HTTP endpoint or an in-process peer
    proc: PeerProc | None = None  # None: the daemon


@dataclass
class PeerResult:
    report: Report = field(default_factory=Report)
    skipped: str | None = None
    facts: list[str] = field(default_factory=list)
    images: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # llama.cpp's prefill tokens/s on a miss (its prompt tokens over its TTFT) at each of
    # ``prefill_lengths``, for the main section's prefill plot; empty when not measured
    prefill: dict[str, list[float | None]] = field(default_factory=dict)
    prefill_lengths: list[int] = field(default_factory=list)

    def markdown(self) -> str:
        return render(self.report, skipped=self.skipped, facts=self.facts, images=self.images,
                      notes=self.notes)


def model_path(settings) -> Path | None:
    if settings.model:
        return Path(settings.model)
    from station.model.loader import default_model_path

    try:
        return default_model_path()
    except Exception:  # noqa: BLE001 - no default model: a skip reason, not a crash
        return None


def peer_figures(settings, args, tmp: Path, out: Path) -> PeerResult:
    result = PeerResult()
    model = model_path(settings)
    result.skipped = skip_reason(args.peer, model)
    if result.skipped:
        print(f"peer rows skipped: {result.skipped}", flush=True)
        return result
    # its own date: `--peer-only` rewrites this section alone, under the main table's date
    result.facts += measured_facts(args, model)
    result.facts.append(_load("at the start"))
    with running_sides(settings, args, model, tmp, result) as running:
        running.bench.rows()
        running.bench.plots(out.parent / "img")
        result.facts.append(_load("at the end"))
    return result


def measured_facts(args, model: Path, plots: bool = True) -> list[str]:
    """The section's first lines: when, which llama.cpp on which file, the run's sizes."""
    # the machine too: `--peer-only` may run on another one than the main table's
    return [f"measured: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on "
            f"{cpu_model()}, {os.cpu_count()} CPUs",
            f"peer: llama-cpp-python {llama_cpp_version()}, n_threads {os.cpu_count() or 1}, "
            f"`use_extra_bufts=False`, one server with `flash_attn=True` and one without, "
            f"in-process without, on {model.name}",
            f"decode tokens {args.decode_tokens}, long prompt ~{args.prompt_tokens} tokens, "
            f"{args.streams} streams, {args.rounds} rounds a row"
            + (f", {args.plot_rounds} a plot point" if plots else "")]


@dataclass
class Running:
    """Both sides up on one GGUF file: the daemon (station + host) and llama.cpp's two
    child processes (paused), with the bench that measures them."""

    bench: PeerBench
    port: int  # the daemon's host
    server: ServerPeer  # with flash attention (the one without is a side of ``bench``'s)
    inproc: InprocPeer
    hello: dict  # the station's hello (model, attention kinds, start check)
    start_s: float  # station spawn to its first hello answered


@contextmanager
def running_sides(settings, args, model: Path, tmp: Path, result: PeerResult,
                  tag: str = "peer") -> Iterator[Running]:
    """The daemon on ``settings`` (whose model is ``model``, a GGUF file) and llama.cpp on
    the same file, up for the block; every process stopped after it, even on an error.
    ``tag`` names the run's directory and logs under ``tmp``."""
    threads = os.cpu_count() or 1
    # SIGTERM (and SIGINT, which a shell's background job ignores) unwinds through the
    # finally below, so no paused llama.cpp child or station outlives the bench
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runtime_dir = tmp / f"{tag}-run"
    started = time.perf_counter()
    station = start_station(settings, runtime_dir, tmp / f"{tag}-station.log")
    start_s = time.perf_counter() - started
    procs = [station]
    peers: list[PeerProc] = []
    try:
        hello = station_hello(runtime_dir / "station.sock")
        port = free_port()
        procs.append(start_host(settings, runtime_dir, port, tmp / f"{tag}-host.log", liquid=True))
        server = ServerPeer(model, threads, tmp / f"{tag}-server.log", free_port(), flash_attn=True)
        peers.append(server)
        server.pause()
        plain = ServerPeer(model, threads, tmp / f"{tag}-server-plain.log", free_port())
        peers.append(plain)
        plain.pause()
        inproc = InprocPeer(model, threads, tmp / f"{tag}-inproc.log")
        peers.append(inproc)
        inproc.pause()
        bench = PeerBench(args, peers, Side("daemon", daemon_endpoint(port)),
                          Side("llama.cpp server", server.endpoint, server),
                          Side("llama.cpp in-process", inproc, inproc), result,
                          Side(PLAIN, plain.endpoint, plain))
        yield Running(bench, port, server, inproc, hello, start_s)
    finally:
        for peer in peers:
            peer.stop()
        for proc in reversed(procs):
            stop_station(proc)


def station_hello(sock: Path) -> dict:
    """The station's ``hello`` answer (what it loaded, its attention kinds, its start check)."""
    async def ask() -> dict:
        async with open_station_client(sock) as conn:
            return conn.hello

    return trio.run(ask)


class PeerBench:
    def __init__(self, args, peers: list[PeerProc], daemon: Side, server: Side, inproc: Side,
                 result: PeerResult, plain: Side | None = None) -> None:
        self.args, self.peers, self.result = args, peers, result
        self.daemon, self.server, self.inproc = daemon, server, inproc
        # the TTFT rows' llama.cpp servers: with flash attention (``server``), and without
        self.ttft_peers = [server] + ([plain] if plain is not None else [])
        self.n = args.decode_tokens

    def interleaved(self, sides: list[Side], rounds: int,
                    measure: Callable[[Side, int], T]) -> list[dict[str, T]]:
        """Per round, every side measured in turn (the order reversed every other round),
        each with every peer but its own paused."""
        out = []
        for r in range(rounds):
            got: dict[str, T] = {}
            for side in sides if r % 2 == 0 else sides[::-1]:
                with measuring(self.peers, side.proc):
                    got[side.name] = measure(side, r)
            out.append(got)
        return out

    def rows(self, goals: bool = True) -> None:
        """The decode and TTFT rows; ``goals`` off: the decode rows are reported without
        the default model's bars (a model the issues set none for)."""
        args, n, report = self.args, self.n, self.result.report

        def bar(value: float) -> tuple[str, float | None]:
            return (">=", value) if goals else ("info", None)

        def ceiling(value: float) -> tuple[str, float | None]:
            return ("<=", value) if goals else ("info", None)

        d, s, i = self.daemon, self.server, self.inproc
        short = text_prompt(32, seed=7)
        # warm-up (first-call costs) and a first check that every side decodes exactly n
        warm = self.interleaved([d, s, i], 1, lambda side, r: side.target.complete(short, n))[0]
        self.result.facts.append(
            "short prompt tokens: " + ", ".join(f"{name} {c.prompt_tokens}" for name, c in warm.items()
                                                if c.prompt_tokens is not None))

        single = single_stream(self.interleaved(
            [d, s, i], args.rounds, lambda side, r: side.target.complete(short, n).decode_tps))
        report.add(SINGLE, single.pairs.ratio, *bar(1.0), single.detail(n))

        prompts = [text_prompt(16 + 8 * k, seed=20 + k) for k in range(args.streams)]
        agg = Pairs()
        for got in self.interleaved([d, s], args.rounds,
                                    lambda side, r: aggregate(side.target, prompts, n)[0]):
            agg.add(got[d.name], got[s.name])
        report.add(f"{args.streams}-stream aggregate decode tok/s, daemon / llama.cpp server",
                   agg.ratio, *bar(4.0),
                   f"daemon {agg.median(0):.1f} tok/s, llama.cpp server {agg.median(1):.1f} tok/s "
                   f"({args.streams} x {n} tokens); {agg.spread()}")

        # llama.cpp's figure of a round: the faster of its two servers, with flash attention
        # (the faster prompt) and without (the faster single token at a long context)
        ttft, peers = TTFTRows(), self.ttft_peers
        for got in self.interleaved([d, *peers], args.rounds, lambda side, r: miss_then_hit(
                side, text_prompt(args.prompt_tokens, seed=1000 + r))):
            ttft.add(got, d.name, *(p.name for p in peers))
        daemon_hit = ttft.seen[d.name][1]
        report.add(f"long-prompt TTFT (miss), daemon / llama.cpp server (the faster of with and "
                   f"without flash attention; ~{args.prompt_tokens:,} tokens)", ttft.miss.ratio,
                   *ceiling(0.25),
                   f"daemon {ttft.miss.median(0) * 1000:.0f} ms, llama.cpp "
                   f"{ttft.miss.median(1) * 1000:.0f} ms ({ttft.ms(0, 0)}) "
                   f"({ttft.seen[d.name][0].prompt_tokens} prompt tokens on the daemon); "
                   f"{ttft.miss.spread()}; ms per round, daemon/llama.cpp "
                   + " ".join(f"{a * 1000:.0f}/{b * 1000:.0f}" for a, b in ttft.miss.pairs))
        report.add("prefix-hit TTFT (the same prompt again), daemon / llama.cpp server (the faster "
                   "of with and without flash attention)", ttft.hit.ratio, *ceiling(1.0),
                   f"daemon {ttft.hit.median(0) * 1000:.1f} ms (cached {daemon_hit.cached_tokens} "
                   f"of {daemon_hit.prompt_tokens}), llama.cpp {ttft.hit.median(1) * 1000:.1f} ms "
                   f"({ttft.ms(1, 1)}); {ttft.hit.spread()}")

    def plots(self, img_dir: Path) -> None:
        args, n, d, s, i = self.args, self.n, self.daemon, self.server, self.inproc
        levels = [int(x) for x in args.peer_streams.split(",") if x]
        lengths = [int(x) for x in args.peer_prompts.split(",") if x]
        decode: dict[str, list[float | None]] = {d.name: [], s.name: [], i.name: []}
        for level in levels:
            prompts = [text_prompt(16 + 8 * (k % 8), seed=300 + k) for k in range(level)]
            sides = [d, s, i] if level == 1 else [d, s]
            got = self.interleaved(sides, args.plot_rounds,
                                   lambda side, r: aggregate(side.target, prompts, n)[0])
            for side in (d, s, i):
                values = [g[side.name] for g in got if side.name in g]
                decode[side.name].append(statistics.median(values) if values else None)
            print(f"peer plot: {level} streams: " + ", ".join(
                f"{name} {vs[-1]:.1f}" for name, vs in decode.items() if vs[-1] is not None)
                + " tok/s", flush=True)
        ttft: dict[str, list[float | None]] = {f"{side.name} {kind}": [] for side in (d, s)
                                               for kind in ("miss", "hit")}
        prefill: list[float | None] = []  # llama.cpp server's miss, tokens/s
        for length in lengths:
            got = self.interleaved([d, s], args.plot_rounds, lambda side, r: miss_then_hit(
                side, text_prompt_tokens(length, seed=5000 + 10 * length + r)))
            for side in (d, s):
                for k, kind in enumerate(("miss", "hit")):
                    ttft[f"{side.name} {kind}"].append(
                        statistics.median(g[side.name][k].ttft_s * 1000 for g in got))
            prefill.append(statistics.median(
                (g[s.name][0].prompt_tokens or length) / g[s.name][0].ttft_s for g in got))
            print(f"peer plot: ~{length}-token prompt: " + ", ".join(
                f"{name} {vs[-1]:.0f} ms" for name, vs in ttft.items()), flush=True)
        self.result.notes.append(plot_table(levels, decode, lengths, ttft))
        self.result.prefill, self.result.prefill_lengths = {"llama.cpp server (miss)": prefill}, lengths
        try:
            plots.plot_decode_by_concurrency(
                levels, decode, img_dir / DECODE_PNG,
                f"aggregate decode, {n} tokens a stream (median of {args.plot_rounds} round(s))")
            plots.plot_ttft_by_prompt(
                lengths, ttft, img_dir / TTFT_PNG,
                f"time to first token, miss then prefix hit (median of {args.plot_rounds} round(s))")
        except ImportError as exc:
            self.result.notes.append(f"Plots not drawn: {exc} (`pip install -e '.[bench]'`).")
            return
        self.result.images += [("decode tok/s by concurrency", f"img/{DECODE_PNG}"),
                               ("TTFT by prompt length", f"img/{TTFT_PNG}")]


def _load(when: str) -> str:
    """The machine's load beside the figures: on a shared machine it explains their spread."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return f"load average {when}: unknown"
    return f"load average {when}: {load:.1f} ({os.cpu_count()} CPUs)"


@dataclass
class TTFTRows:
    """The miss and hit rows' rounds: the daemon against the faster llama.cpp side of each
    round, both llama.cpp sides kept for the detail."""

    miss: Pairs = field(default_factory=Pairs)
    hit: Pairs = field(default_factory=Pairs)
    sides: dict[str, list[list[float]]] = field(default_factory=dict)  # name -> [miss, hit] s
    seen: dict = field(default_factory=dict)  # the last round's completions by side

    def add(self, got: dict, daemon: str, *peers: str) -> None:
        for k, pairs in enumerate((self.miss, self.hit)):
            pairs.add(got[daemon][k].ttft_s, min(got[p][k].ttft_s for p in peers))
            for p in peers:
                self.sides.setdefault(p, [[], []])[k].append(got[p][k].ttft_s)
        self.seen = got

    def ms(self, k: int, digits: int) -> str:
        """Each llama.cpp side's median (k 0: miss, 1: hit), in ms."""
        return ", ".join(f"{name.removeprefix('llama.cpp ')} "
                         f"{statistics.median(values[k]) * 1000:.{digits}f}"
                         for name, values in self.sides.items())


def miss_then_hit(side: Side, prompt: str):
    miss = side.target.complete(prompt, 1)
    return miss, side.target.complete(prompt, 1)


@dataclass
class Single:
    pairs: Pairs  # (daemon, the better llama.cpp figure) per round
    server: list[float]
    inproc: list[float]
    daemon: list[float]

    def detail(self, n: int) -> str:
        rounds = " ".join(f"{d:.1f}/{s:.1f}/{i:.1f}" for d, s, i in
                          zip(self.daemon, self.server, self.inproc))
        return (f"daemon {self.pairs.median(0):.1f} tok/s, llama.cpp {self.pairs.median(1):.1f} "
                f"tok/s (server {statistics.median(self.server):.1f}, in-process "
                f"{statistics.median(self.inproc):.1f}); {n} tokens each; tok/s per round "
                f"daemon/server/in-process {rounds}; {self.pairs.spread()}")


def single_stream(rounds: list[dict[str, float]], daemon: str = "daemon",
                  server: str = "llama.cpp server", inproc: str = "llama.cpp in-process") -> Single:
    """Each round's daemon figure against the better of that round's two llama.cpp figures."""
    pairs = Pairs()
    for got in rounds:
        pairs.add(got[daemon], max(got[server], got[inproc]))
    return Single(pairs, [g[server] for g in rounds], [g[inproc] for g in rounds],
                  [g[daemon] for g in rounds])


def plot_table(levels: list[int], decode: dict, lengths: list[int], ttft: dict) -> str:
    """The plots' figures as text (the PNGs show them; this keeps them diffable)."""
    def cell(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = ["Plotted figures (medians): aggregate decode tok/s by streams", "",
             "| streams | " + " | ".join(decode) + " |", "|---|" + "---|" * len(decode)]
    lines += [f"| {level} | " + " | ".join(cell(vs[k], ".1f") for vs in decode.values()) + " |"
              for k, level in enumerate(levels)]
    lines += ["", "TTFT (ms) by prompt length", "",
              "| prompt tokens | " + " | ".join(ttft) + " |", "|---|" + "---|" * len(ttft)]
    lines += [f"| ~{length} | " + " | ".join(cell(vs[k], ".1f") for vs in ttft.values()) + " |"
              for k, length in enumerate(lengths)]
    return "\n".join(lines)
