"""Structured-output decode speed for `make bench`, through real HTTP.

The same chat prompt, greedy, streamed with ``stream_options.include_usage`` (exact token
counts), once with ``response_format`` ``json_schema`` (strict; nested objects, an array and
an enum) and once without. The grammar ends the output when the JSON is complete, so the
constrained side is measured first (a warm-up: greedy output is the same every round) and
the unconstrained side is asked for exactly as many tokens (``max_tokens`` and
``ignore_eos``). A side's rate is its tokens after the first over the decode time, from the
first content chunk (TTFT) to the finish chunk, as the client sees them. Rounds interleave
(alternating which side goes first); the figure is the median of the rounds' ratios.

    python -m bench.grammar [--model PATH] [--rounds 5] [--max-tokens 160]

runs this row alone: its own station and host, no other figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Pairs, Report, sse_chunks

MESSAGES = [{"role": "system", "content": "You are a librarian. Answer in JSON."},
            {"role": "user", "content": "Describe a library: its name, its address, how many "
                                        "books it holds, its genres and two of its staff."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 40},
                                   "city": {"type": "string", "maxLength": 30},
                                   "country": {"enum": ["France", "Norway", "Peru", "Japan"]}},
                    "required": ["street", "city", "country"], "additionalProperties": False},
        "books": {"type": "integer", "minimum": 0, "maximum": 10_000_000},
        "genres": {"type": "array", "maxItems": 4,
                   "items": {"enum": ["fiction", "history", "science", "poetry", "travel"]}},
        "staff": {"type": "array", "minItems": 2, "maxItems": 2,
                  "items": {"type": "object",
                            "properties": {"name": {"type": "string", "maxLength": 30},
                                           "role": {"enum": ["head", "clerk", "archivist"]}},
                            "required": ["name", "role"], "additionalProperties": False}},
    },
    "required": ["name", "address", "books", "genres", "staff"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "library", "schema": SCHEMA, "strict": True}}


@dataclass
class Run:
    ttft_s: float
    decode_s: float  # from the first content chunk to the finish chunk
    completion_tokens: int
    finish_reason: str
    text: str

    @property
    def tps(self) -> float:
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0


def stream(port: int, max_tokens: int, *, constrained: bool) -> Run:
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "seed": 7,
            "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = RESPONSE_FORMAT
    else:
        body["ignore_eos"] = True  # exactly max_tokens, as many as the constrained side made
    start = time.perf_counter()
    first = end = None
    usage: dict = {}
    finish = ""
    pieces: list[str] = []
    for chunk in sse_chunks(port, body):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                first = first or time.perf_counter()
                pieces.append(content)
            if choice.get("finish_reason"):
                end, finish = time.perf_counter(), choice["finish_reason"]
    assert first is not None and end is not None and usage, "no content, finish or usage streamed"
    return Run(first - start, end - first, usage["completion_tokens"], finish, "".join(pieces))


def grammar_figures(report: Report, port: int, rounds: int, max_tokens: int = 160) -> None:
    """``max_tokens``: room for the whole JSON (SmolLM2-135M writes about 115 tokens); in
    `make bench` 2 x --decode-tokens + 32, 160 at the default 64."""
    warm = stream(port, max_tokens, constrained=True)  # also compiles (and caches) the grammar
    n = warm.completion_tokens
    stream(port, n, constrained=False)
    pairs = Pairs()  # (constrained, unconstrained) tok/s
    valid = 0
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        runs = {c: stream(port, n, constrained=c) for c in order}
        pairs.add(runs[True].tps, runs[False].tps)
        valid += _valid(runs[True].text)
        counts = (runs[True].completion_tokens, runs[False].completion_tokens)
    plain = [b for _, b in pairs.pairs]
    report.add("decode tok/s grammar-constrained (json_schema) / unconstrained", pairs.ratio,
               ">=", 0.8,
               f"json_schema {pairs.median(0):.1f} tok/s ({counts[0]} tokens, finish "
               f"{warm.finish_reason}, {valid}/{rounds} rounds' JSON parsed), unconstrained "
               f"{pairs.median(1):.1f} tok/s ({counts[1]} tokens); {pairs.spread()}; A/A: "
               f"slowest / fastest unconstrained round {min(plain) / max(plain):.3f}")


def _valid(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    from bench.common import free_port, start_station, stop_station
    from bench.liquid import start_host
    from gnosis_daemon.settings import load_settings

    parser = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args(argv)
    settings = load_settings(cli={"model": args.model})
    report = Report()
    with tempfile.TemporaryDirectory(prefix="gnosis-bench-grammar-") as tmp:
        runtime_dir = Path(tmp) / "run"
        station = start_station(settings, runtime_dir, Path(tmp) / "station.log")
        host = None
        try:
            port = free_port()
            host = start_host(settings, runtime_dir, port, Path(tmp) / "host.log", liquid=True)
            grammar_figures(report, port, args.rounds, args.max_tokens)
        finally:
            if host is not None:
                stop_station(host)
            stop_station(station)
    report.print()
    return 0 if report.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
