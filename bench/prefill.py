"""`make bench`, prefill rows: the station's miss beside the plain forwards of the same model.

A miss (a prompt the station has not cached) is held to the fastest plain forward this
machine has for the same model, measured in the same run: one in-process forward
(``logits_to_keep=1``) of the model dequantized to float32 (``weights=float``: torch's dense
linears, oneDNN/MKL), of that model cast to bfloat16 (where a forward in it runs), and of the
quantized torch path (``load_model`` as configured: a GGUF file's 4-bit groups kept). The
fastest dense forward of a length is the faster of float32 and bfloat16 in each round.

For each length the rounds interleave as the other rows do (which side goes first alternates
by round); a length among ``--prefill-rows`` gets a row (``--rounds`` rounds), one among
``--prefill-plot`` only a point of the plot (``--plot-rounds`` rounds). After the miss at the
conversation length (the longest row), the same tenant sends the prompt and ~20 new tokens: a
turn of a cached conversation, whose row is the station's own time before the first token
(its ``ttft_ms``). The plot: prefill tokens/s (prompt tokens over time to the first token)
by prompt length, with llama.cpp's line when the peer section measured it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Pairs, Plain, Report, make_prompt_ids, station_ttft
from bench.weights import quantized_mode

PREFILL_PNG = "prefill_by_prompt.png"
TURN_NEW_TOKENS = 20
DAEMON = "daemon (station miss)"
FP32, BF16, QUANT = "plain float32 dense", "plain bfloat16 dense", "plain quantized torch path"


def add_arguments(parser) -> None:
    group = parser.add_argument_group("the prefill rows (the station's miss beside plain forwards)")
    group.add_argument("--prefill-rows", default="500,1000,2000,4000",
                       help="prompt lengths (tokens) of the miss / fastest plain dense forward rows; "
                            "the longest is the conversation of the turn row")
    group.add_argument("--prefill-plot", default="250,8000",
                       help="more prompt lengths, plotted only (--plot-rounds rounds each)")


def lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class PlainForwards:
    """The three plain forwards, kept loaded for the run (about 1 GB for a 135M model)."""

    def __init__(self, settings) -> None:
        import torch

        self.quantized = Plain(settings, weights=quantized_mode(settings))  # load_model's path
        self.fp32 = Plain(settings, weights="float")
        self.bf16: Plain | None = None
        self.bf16_missing = ""
        try:
            self.bf16 = Plain.cast(self.fp32, torch.bfloat16)
        except (RuntimeError, TypeError) as exc:  # no bfloat16 forward on this machine
            self.bf16_missing = f"bfloat16 not measured ({type(exc).__name__}: {exc})"[:200]

    def dense_s(self, prompt: list[int]) -> tuple[float, float | None]:
        """(float32 s, bfloat16 s or None) of one forward of ``prompt`` each."""
        fp32 = self.fp32.prefill_s(prompt)
        return fp32, None if self.bf16 is None else self.bf16.prefill_s(prompt)


@dataclass
class Point:
    """One length's rounds: the station's miss and the plain forwards, seconds per round."""

    station: list[float] = field(default_factory=list)
    fp32: list[float] = field(default_factory=list)
    bf16: list[float | None] = field(default_factory=list)

    def fastest(self) -> Pairs:
        """(station, the faster dense forward of the same round) per round."""
        pairs = Pairs()
        for miss, fp32, bf16 in zip(self.station, self.fp32, self.bf16):
            pairs.add(miss, fp32 if bf16 is None else min(fp32, bf16))
        return pairs

    def fastest_names(self) -> list[str]:
        return ["bf16" if bf16 is not None and bf16 < fp32 else "fp32"
                for fp32, bf16 in zip(self.fp32, self.bf16)]


def fastest_detail(point: Point, missing: str = "") -> str:
    """A row's detail: every side's median, which was the faster dense forward, the spread."""
    pairs = point.fastest()
    names = point.fastest_names()
    bf16 = [b for b in point.bf16 if b is not None]
    won = max(("fp32", "bf16"), key=names.count)
    return (f"station {statistics.median(point.station) * 1000:.0f} ms, fp32 "
            f"{statistics.median(point.fp32) * 1000:.0f} ms, bf16 "
            + (f"{statistics.median(bf16) * 1000:.0f} ms" if bf16 else f"- ({missing or 'not measured'})")
            + f"; fastest: {won} ({names.count(won)} of {len(names)} rounds); {pairs.spread()}")


@dataclass
class Sweep:
    """What ``sweep`` measured: the points by length and the turn's rounds."""

    points: dict[int, Point] = field(default_factory=dict)
    quantized: dict[int, float] = field(default_factory=dict)  # seconds, at --prompt-tokens
    turns: list[tuple[float, int, int]] = field(default_factory=list)  # (ttft_ms, cached, prompt)
    missing_bf16: str = ""

    def series(self, xs: list[int]) -> dict[str, list[float | None]]:
        """Prefill tokens/s (median over rounds) of each side at each length in ``xs``."""
        def tps(n: int, values) -> float | None:
            kept = [v for v in values if v is not None]
            return n / statistics.median(kept) if kept else None

        out: dict[str, list[float | None]] = {DAEMON: [], FP32: [], BF16: [], QUANT: []}
        for n in xs:
            point = self.points.get(n, Point())
            out[DAEMON].append(tps(n, point.station))
            out[FP32].append(tps(n, point.fp32))
            out[BF16].append(tps(n, point.bf16))
            out[QUANT].append(n / self.quantized[n] if n in self.quantized else None)
        return out


async def sweep(conn, vocab: int, plain: PlainForwards, args) -> Sweep:
    """Every length of ``--prefill-rows`` and ``--prefill-plot``: a miss the station has not
    seen beside one forward of each dense model, interleaved by round; the turn after the
    longest row's miss."""
    rows, extra = lengths(args.prefill_rows), lengths(args.prefill_plot)
    context = max(rows) if rows else None
    out = Sweep(missing_bf16=plain.bf16_missing)
    for n in sorted(set(rows) | set(extra)):
        point = out.points.setdefault(n, Point())
        for r in range(args.rounds if n in rows else args.plot_rounds):
            prompt = make_prompt_ids(vocab, n, seed=1_000_000 + 100 * n + r)  # unseen: a miss
            tenant = f"prefill-{n}-{r}"
            if r % 2 == 0:
                dense = plain.dense_s(prompt)
            miss = await station_ttft(conn, prompt, tenant=tenant)
            if n == context:  # the next turn of this conversation, its prompt cached
                turn = prompt + make_prompt_ids(vocab, TURN_NEW_TOKENS, seed=2_000_000 + r)
                got = await station_ttft(conn, turn, tenant=tenant)
                assert got.station_ms is not None, "the station's result carries no ttft_ms"
                out.turns.append((got.station_ms, got.cached_tokens, len(turn)))
            if r % 2 == 1:
                dense = plain.dense_s(prompt)
            point.station.append(miss.ttft_s)
            point.fp32.append(dense[0])
            point.bf16.append(dense[1])
        print(f"prefill: {n}-token miss: station {statistics.median(point.station) * 1000:.0f} ms, "
              f"fp32 {statistics.median(point.fp32) * 1000:.0f} ms", flush=True)
    return out


def add_rows(report: Report, got: Sweep, args) -> None:
    for n in lengths(args.prefill_rows):
        point = got.points[n]
        report.add(f"miss TTFT / fastest plain dense forward ({n:,}-token prompt)", point.fastest().ratio,
                   "<=", 1.0, fastest_detail(point, got.missing_bf16))
    if got.turns:
        ms = statistics.median(t[0] for t in got.turns)
        cached = "/".join(str(c) for c in sorted({t[1] for t in got.turns}))
        prompt = got.turns[0][2]
        report.add(f"conversation turn: station ms before the first token, {TURN_NEW_TOKENS} new tokens "
                   f"on a {prompt - TURN_NEW_TOKENS:,}-token cached conversation", ms, "<=", 60.0,
                   f"the station's ttft_ms (arrival to the first token), median of {len(got.turns)} "
                   f"rounds: " + " ".join(f"{t[0]:.1f}" for t in got.turns)
                   + f"; {prompt} prompt tokens, cached {cached}")


def plot(got: Sweep, args, img_dir: Path, peer: dict[str, list[float | None]] | None = None,
         peer_lengths: list[int] | None = None) -> tuple[str, str | None]:
    """The prefill plot (``peer``: llama.cpp's tokens/s at ``peer_lengths``, when measured):
    (the figures as a markdown table, the image's path relative to docs/ or None with why
    not in the table's last line)."""
    from bench.peers import plots

    xs = sorted(got.points)
    series = got.series(xs)
    if peer:
        for name, values in peer.items():
            by_length = dict(zip(peer_lengths or [], values))
            series[name] = [by_length.get(n) for n in xs]
    series = {name: ys for name, ys in series.items() if any(y is not None for y in ys)}
    lines = ["Prefill tokens/s by prompt length (prompt tokens over time to the first token; "
             "medians)", "", "| prompt tokens | " + " | ".join(series) + " |",
             "|---|" + "---|" * len(series)]
    lines += [f"| {n} | " + " | ".join("-" if ys[k] is None else f"{ys[k]:.0f}" for ys in series.values())
              + " |" for k, n in enumerate(xs)]
    try:
        plots.plot_prefill_by_prompt(xs, series, img_dir / PREFILL_PNG,
                                     f"prefill tokens/s, miss (median of {args.rounds} rounds a row "
                                     f"length, {args.plot_rounds} a plot length)")
    except ImportError as exc:
        return "\n".join(lines + ["", f"Plot not drawn: {exc} (`pip install -e '.[bench]'`)."]), None
    return "\n".join(lines), f"img/{PREFILL_PNG}"


def markdown(table: str, image: str | None) -> str:
    head = ["## Prefill by prompt length", ""]
    return "\n".join(head + ([f"![prefill tokens/s by prompt length]({image})", ""] if image else [])
                     + [table, ""])
