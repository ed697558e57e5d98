"""`make bench`: the engine's speed goals, measured side by side in one run.

Every figure is a ratio of two measurements taken in this run on this machine, so a
shared, noisy machine moves both sides together. Results go to stdout and to
docs/benchmarks.md with the machine described.

    python -m bench [--model PATH] [--prompt-tokens 2000] [--decode-tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import trio

from bench.common import (
    Report,
    free_port,
    make_prompt_ids,
    Plain,
    start_station,
    station_decode,
    station_ttft,
    stop_station,
)
from bench.liquid import decode_next_figures, liquid_figures, start_host
from gnosis_daemon.client import open_station_client
from gnosis_daemon.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved repeats; each side's best is compared")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"))
    args = parser.parse_args(argv)

    settings = load_settings(cli={"model": args.model})
    report = Report()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
          flush=True)

    # 1. the plain in-process baseline (same weights, contiguous DynamicCache), kept loaded
    #    so that its measurements interleave with the station's (best of --rounds each)
    plain = Plain(settings)

    # 2. the station, as a real child process, through the real socket
    with tempfile.TemporaryDirectory(prefix="gnosis-bench-") as tmp:
        runtime_dir = Path(tmp) / "run"
        proc = start_station(settings, runtime_dir, Path(tmp) / "station.log")
        hosts = []
        try:
            trio.run(_station_figures, runtime_dir / "station.sock", args, plain, report)
            del plain  # the HTTP figures compare the station with itself
            # 3. liquid memory through HTTP: two hosts on the one station, liquid on and off
            liquid_port, native_port = free_port(), free_port()
            hosts.append(start_host(settings, runtime_dir, liquid_port, Path(tmp) / "host-liquid.log",
                                    liquid=True))
            hosts.append(start_host(settings, runtime_dir, native_port, Path(tmp) / "host-native.log",
                                    liquid=False))
            liquid_figures(report, liquid_port, native_port, args.decode_tokens, args.rounds,
                           args.prompt_tokens)
        finally:
            for host in hosts:
                stop_station(host)
            stop_station(proc)

    report.print()
    report.write(Path(args.out), settings, args)
    return 0 if report.all_met() else 1


async def _station_figures(socket_path, args, plain: Plain, report: Report) -> None:
    async with open_station_client(socket_path) as conn:
        vocab = conn.hello["model"]["vocab_size"]
        # warm-up: first forward pays one-time allocator costs
        await station_ttft(conn, make_prompt_ids(vocab, 64, seed=99), tenant="warmup")

        plain_prefill, misses, hits = [], [], []
        for r in range(args.rounds):  # which side goes first alternates by round
            prompt = make_prompt_ids(vocab, args.prompt_tokens, seed=1 + r)
            if r % 2 == 0:
                plain_prefill.append(plain.prefill_s(prompt))
            misses.append(await station_ttft(conn, prompt, tenant=f"bench-{r}"))
            hits.append(await station_ttft(conn, prompt, tenant=f"bench-{r}"))
            if r % 2 == 1:
                plain_prefill.append(plain.prefill_s(prompt))
        miss = min(misses, key=lambda t: t.ttft_s)
        hit = min(hits, key=lambda t: t.ttft_s)
        forward_s = min(plain_prefill)
        report.add(f"prefix-hit TTFT / miss TTFT ({args.prompt_tokens:,}-token shared prefix)", hit.ttft_s / miss.ttft_s,
                   "<=", 0.05, f"hit {hit.ttft_s * 1000:.1f} ms (cached {hit.cached_tokens}), "
                   f"miss {miss.ttft_s * 1000:.1f} ms")
        report.add("miss TTFT (chunked prefill) / one plain forward", miss.ttft_s / forward_s,
                   "<=", 1.1, f"station {miss.ttft_s * 1000:.0f} ms, plain {forward_s * 1000:.0f} ms")

        short = make_prompt_ids(vocab, 32, seed=2)
        prompts = [make_prompt_ids(vocab, 16 + 8 * i, seed=10 + i) for i in range(args.streams)]
        plain_rates, ones, manys = [], [], []
        for r in range(args.rounds):
            if r % 2 == 0:
                plain_rates.append(plain.decode_tps(short, args.decode_tokens))
            ones.append(await station_decode(conn, [short], args.decode_tokens))
            manys.append(await station_decode(conn, prompts, args.decode_tokens))
            if r % 2 == 1:
                plain_rates.append(plain.decode_tps(short, args.decode_tokens))
        one, many, plain_tps = max(ones), max(manys), max(plain_rates)
        report.add("station single-stream decode / plain contiguous-cache loop", one / plain_tps,
                   ">=", 0.9, f"station {one:.1f} tok/s, plain {plain_tps:.1f} tok/s")
        report.add(f"aggregate decode at {args.streams} streams / 1 stream", many / one, ">=", 4.0,
                   f"{args.streams} streams {many:.1f} tok/s, 1 stream {one:.1f} tok/s")
        await decode_next_figures(conn, report, short, args.decode_tokens, args.rounds)


if __name__ == "__main__":
    sys.exit(main())
