"""`make bench`: the engine's speed goals, measured side by side in one run.

Every figure is a ratio of two measurements taken in this run on this machine, so a
shared, noisy machine moves both sides together. Results go to stdout and to
docs/benchmarks.md with the machine described.

    python -m bench [--model PATH] [--prompt-tokens 2000] [--decode-tokens 64] [--out FILE]
                    [--peer auto|install|off] [--peer-only]
                    [--second-model auto|off] [--second-model-only]

The peer rows (bench.peers) put llama.cpp beside the daemon on the same GGUF file; with
--peer-only they run alone and rewrite only their section of --out. The second model's
section (bench.peers.second_model: Gemma 3 270M beside llama.cpp, greedy agreement with
generate, the start check's cost) follows them; --second-model-only runs it alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench import prefill
from bench.common import (
    Pairs,
    Report,
    free_port,
    make_prompt_ids,
    start_station,
    station_decode,
    station_ttft,
    stop_station,
)
from bench.grammar import grammar_figures
from bench.dialects import dialect_figures
from bench.liquid import decode_next_figures, liquid_figures, start_host
from bench.peers.figures import add_arguments as add_peer_arguments
from bench.peers.figures import peer_figures
from bench.peers import second_model
from bench.peers.section import splice
from bench.tier import tier_figures
from bench.tier_busy import BUSY_MIN_ROUNDS
from bench.weights import weights_figures
from gnosis_daemon.client import open_station_client
from gnosis_daemon.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds per figure; the median of the rounds' ratios is reported")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"))
    parser.add_argument("--tier-only", action="store_true",
                        help="run only the disk-tier rows and print them (writes no file)")
    parser.add_argument("--tier-busy-rounds", type=int, default=BUSY_MIN_ROUNDS,
                        help="the fewest busy and idle rounds of the decode-beside-a-writer rows "
                             "(one round's noise here is 10-20%%; the suite's tiny run takes 1)")
    parser.add_argument("--profile", action="store_true",
                        help="only print where a decode token's time goes (bench.profile)")
    add_peer_arguments(parser)
    prefill.add_arguments(parser)
    second_model.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.profile:  # its own options and defaults (a short prompt): hand it the arguments
        from bench.profile import main as profile_main

        return profile_main([a for a in (sys.argv[1:] if argv is None else argv) if a != "--profile"])

    settings = load_settings(cli={"model": args.model})
    report = Report()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
          flush=True)
    if args.peer_only:
        with tempfile.TemporaryDirectory(prefix="gnosis-bench-") as tmp:
            peer = peer_figures(settings, args, Path(tmp), Path(args.out))
        peer.report.print()
        splice(Path(args.out), peer.markdown())
        return 0 if peer.report.all_met() else 1
    if args.second_model_only:
        return second_model.run_alone(settings, args, Path(args.out))
    if args.tier_only:
        with tempfile.TemporaryDirectory(prefix="gnosis-bench-") as tmp:
            tier_figures(report, settings, args, Path(tmp))
        report.print()
        return 0 if report.all_met() else 1

    # 1. the plain in-process baselines (same weights: float32 and bfloat16 dense, the
    #    quantized torch path), kept loaded so that their measurements interleave with the
    #    station's
    plain = prefill.PlainForwards(settings)

    # 2. the station, as a real child process, through the real socket
    with tempfile.TemporaryDirectory(prefix="gnosis-bench-") as tmp:
        runtime_dir = Path(tmp) / "run"
        started = time.perf_counter()
        proc = start_station(settings, runtime_dir, Path(tmp) / "station.log")
        start_s = time.perf_counter() - started
        hosts = []
        try:
            hello, sweep = trio.run(_station_figures, runtime_dir / "station.sock", args, plain, report)
            # the start check's share of this station's start (the default model's probe)
            default_cost = second_model.StartCost.from_hello(
                second_model.default_name(settings), hello, start_s, Path(tmp) / "station.log")
            del plain  # the HTTP figures compare the station with itself
            # 3. liquid memory through HTTP: two hosts on the one station, liquid on and off
            liquid_port, native_port = free_port(), free_port()
            hosts.append(start_host(settings, runtime_dir, liquid_port, Path(tmp) / "host-liquid.log",
                                    liquid=True))
            hosts.append(start_host(settings, runtime_dir, native_port, Path(tmp) / "host-native.log",
                                    liquid=False))
            liquid_figures(report, liquid_port, native_port, args.decode_tokens, args.rounds,
                           args.prompt_tokens)
            dialect_figures(report, liquid_port, args.prompt_tokens)
            grammar_figures(report, liquid_port, args.rounds, 2 * args.decode_tokens + 32)
        finally:
            for host in hosts:
                stop_station(host)
            stop_station(proc)
        # 4. the disk tier behind the KV pool: stations of their own, one after another
        tier_figures(report, settings, args, Path(tmp))
        # 5. weights: the GGUF's 4-bit blocks against the same file dequantized
        weights_figures(report, settings, args.rounds, args.decode_tokens, Path(tmp))
        default_cost.add_row(report)  # the main table's last row: the start check's cost
        # 6. llama.cpp beside the daemon, on the same GGUF file (skipped with its reason)
        peer = peer_figures(settings, args, Path(tmp), Path(args.out))
        # 7. a second real model (Gemma 3 270M) beside llama.cpp (skipped with its reason)
        second = second_model.guarded_figures(settings, args, Path(tmp), default_cost)
    # 8. the prefill plot: the station's and the plain forwards' points, llama.cpp's if measured
    table, image = prefill.plot(sweep, args, Path(args.out).parent / "img", peer.prefill, peer.prefill_lengths)

    Report(report.rows + peer.report.rows + second.report.rows).print()
    report.write(Path(args.out), settings, args, extra=prefill.markdown(table, image) + "\n"
                 + peer.markdown() + "\n" + second.markdown())
    return 0 if report.all_met() and peer.report.all_met() and second.report.all_met() else 1


async def _station_figures(socket_path, args, plain: prefill.PlainForwards,
                           report: Report) -> tuple[dict, prefill.Sweep]:
    async with open_station_client(socket_path) as conn:
        vocab = conn.hello["model"]["vocab_size"]
        # warm-up: first forward pays one-time allocator costs
        await station_ttft(conn, make_prompt_ids(vocab, 64, seed=99), tenant="warmup")

        # (station miss, float32 dense forward), (miss, quantized torch path), (hit, miss)
        dense, quantized, prefix = Pairs(), Pairs(), Pairs()
        cached = set()
        for r in range(args.rounds):  # which side goes first alternates by round
            prompt = make_prompt_ids(vocab, args.prompt_tokens, seed=1 + r)
            if r % 2 == 0:
                forward_s = plain.fp32.prefill_s(prompt), plain.quantized.prefill_s(prompt)
            miss = await station_ttft(conn, prompt, tenant=f"bench-{r}")
            hit = await station_ttft(conn, prompt, tenant=f"bench-{r}")
            if r % 2 == 1:
                forward_s = plain.fp32.prefill_s(prompt), plain.quantized.prefill_s(prompt)
            dense.add(miss.ttft_s, forward_s[0])
            quantized.add(miss.ttft_s, forward_s[1])
            prefix.add(hit.ttft_s, miss.ttft_s)
            cached.add(hit.cached_tokens)
        report.add(f"prefix-hit TTFT / miss TTFT ({args.prompt_tokens:,}-token shared prefix)",
                   prefix.ratio, "<=", 0.05,
                   f"hit {prefix.median(0) * 1000:.1f} ms (cached {'/'.join(map(str, sorted(cached)))}), "
                   f"miss {prefix.median(1) * 1000:.1f} ms; {prefix.spread()}")
        for pairs, name in ((dense, "float32 dense"), (quantized, "quantized torch path")):
            report.add(f"miss TTFT / {name} forward ({args.prompt_tokens:,}-token prompt)", pairs.ratio,
                       "info", None, f"station {pairs.median(0) * 1000:.0f} ms, {name} "
                       f"{pairs.median(1) * 1000:.0f} ms; {pairs.spread()}")
        sweep = await prefill.sweep(conn, vocab, plain, args)
        sweep.quantized[args.prompt_tokens] = quantized.median(1)
        prefill.add_rows(report, sweep, args)

        short = make_prompt_ids(vocab, 32, seed=2)
        prompts = [make_prompt_ids(vocab, 16 + 8 * i, seed=10 + i) for i in range(args.streams)]
        single, batched = Pairs(), Pairs()  # (station 1 stream, plain), (N streams, 1 stream)
        for r in range(args.rounds):
            if r % 2 == 0:
                plain_tps = plain.quantized.decode_tps(short, args.decode_tokens)
            one = await station_decode(conn, [short], args.decode_tokens)
            many = await station_decode(conn, prompts, args.decode_tokens)
            if r % 2 == 1:
                plain_tps = plain.quantized.decode_tps(short, args.decode_tokens)
            single.add(one, plain_tps)
            batched.add(many, one)
        report.add("station single-stream decode / plain contiguous-cache loop", single.ratio,
                   ">=", 0.9, f"station {single.median(0):.1f} tok/s, plain {single.median(1):.1f} "
                   f"tok/s; {single.spread()}")
        # reported only: against one stream it measures nothing a user feels once one stream
        # is fast; the 8-stream goal is the one against llama.cpp's server (bench.peers)
        report.add(f"aggregate decode at {args.streams} streams / 1 stream", batched.ratio, "info", None,
                   f"{args.streams} streams {batched.median(0):.1f} tok/s, 1 stream "
                   f"{batched.median(1):.1f} tok/s; {batched.spread()}")
        await decode_next_figures(conn, report, short, args.decode_tokens, args.rounds)
        return conn.hello, sweep


if __name__ == "__main__":
    sys.exit(main())
