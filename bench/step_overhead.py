"""The engine's own time per decode step, beyond the model's forward (`make profile`, or
``python -m bench.step_overhead``).

A tiny random model makes the forward's arithmetic negligible, so what a step costs beyond
it is the per-step work that stays the same whatever the model: scheduling, building the
step's index lists, sampling, the token events, and the engine loop between steps. On a GPU
it is this time that keeps a 7B model's decode from the bandwidth limit (the device computes
a step in a few milliseconds; the host must not take longer to prepare the next one).

``B`` greedy streams decode together in one ``PagedEngine`` on its own thread, as in the
station. Each step's wall time is split into the model's own calls (the forward body: the
lean or transformers decoder, or the C step; and the vocabulary head) and the rest: the
runner's index lists and tensors around them, sampling, events, the loop between steps. The
figure is the median over steps of (step start to next step start) minus the forward, per
step and per stream, at each batch size. Detokenizing and the socket run on the station's
trio thread, beside the engine thread (sharing its GIL), so the same streams are then
decoded through a real station process's socket: the time a step takes there (the streams'
last token to first, over the tokens between) beyond the in-process forward is the
figure with everything the station does per step, and the one the goal is held to.

Both sides run the forward on one torch thread. On a GPU the forward leaves the host's
cores to the host; a tiny model's ops over two OpenMP threads instead keep the second core
spinning between regions (4-5 ms of CPU a step here), where the station's trio thread and
the bench's client must run, so the figure measured the spin, not the host's work. Each
side first runs one untimed round (oneDNN's first calls, the allocator), then ``--rounds``
timed ones, the two sides taking turns; the figures are medians over every timed step (in
process) or round (socket).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

GOAL_MS = 1.0  # at most 1 ms a step at the largest batch beyond the model's own forward


def _prompts(batch: int, vocab_size: int, prompt_len: int) -> list[list[int]]:
    """The streams' prompts, the same on both sides: ids from 1 to ``vocab_size - 2``."""
    return [[(7 * i + 3 * k) % (vocab_size - 2) + 1 for k in range(prompt_len)]
            for i in range(batch)]


def _engine_round(loaded: Any, batch: int, max_batch: int, tokens: int,
                  prompt_len: int) -> tuple[list[float], list[float]]:
    """One round of ``batch`` streams in a new engine -> (step periods, forwards) in s, of
    the steps where every stream decodes."""
    from gnosis_daemon.settings import Settings
    from station.core.requests import Finished, GenerationRequest, SamplingParams
    from station.engine.loop import PagedEngine

    settings = Settings(runtime_dir=tempfile.gettempdir(), max_batch_size=max_batch)
    engine = PagedEngine(loaded, settings, num_blocks=max(64, batch * (prompt_len + tokens) // 8 + 64))
    runner = engine.runner
    forward_s: list[float] = []  # per step: the model's own calls (body and head)
    starts: list[float] = []
    step = engine.step

    def timed(call: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                forward_s[-1] += time.perf_counter() - start
        return wrapper

    # The model's own work: the forward body (lean/transformers decoder, or the C step)
    # and the head; the runner's index lists and tensors around them are the host's.
    for name in ("_decoder", "_head", "_step"):
        if getattr(runner, name, None) is not None:
            setattr(runner, name, timed(getattr(runner, name)))

    def timed_step(step: Any = step) -> None:
        starts.append(time.perf_counter())
        forward_s.append(0.0)
        step()

    engine.step = timed_step  # type: ignore[method-assign]  # a timed stand-in
    engine.start()
    try:
        done = threading.Semaphore(0)

        def on_event(event: Any) -> None:
            if isinstance(event, Finished) or type(event).__name__ == "Failed":
                done.release()

        for i, prompt in enumerate(_prompts(batch, loaded.vocab_size, prompt_len)):
            engine.add_request(GenerationRequest(
                f"b{batch}-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                        ignore_eos=True)), on_event)
        for _ in range(batch):
            assert done.acquire(timeout=600), "a stream did not finish"
    finally:
        engine.shutdown(flush_tier=False)
    # the steps where every stream decodes: after the prefills, before the first ends
    first, last = 2, min(len(starts), len(forward_s)) - 2
    return [starts[i + 1] - starts[i] for i in range(first, last)], forward_s[first:last]


async def _socket_step_ms(sock: Path, prompts: list[list[int]], tokens: int) -> float:
    """``len(prompts)`` greedy streams through the station's socket at once -> ms a step:
    from the last stream's first token to the last token, over the tokens between."""
    import trio

    from gnosis_daemon.client import open_station_client

    firsts: list[float] = []
    lasts: list[float] = []

    async def one(conn: Any, prompt: list[int]) -> None:
        first = None
        async with conn.open_stream("generate", {"tokens": prompt, "max_tokens": tokens,
                                                 "temperature": 0, "ignore_eos": True}) as stream:
            async for event in stream:
                if event.get("type") == "tokens" and event.get("token_ids"):
                    first = first or time.perf_counter()
                    last = time.perf_counter()
        assert first is not None
        firsts.append(first)
        lasts.append(last)

    async with open_station_client(sock) as conn:
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, conn, prompt)
    return (min(lasts) - max(firsts)) / (tokens - 1) * 1000


def _station(model_dir: Path, tmp: Path, max_batch: int) -> Any:
    """A station process serving ``model_dir`` on one torch thread (see the docstring)."""
    from bench.common import start_station
    from gnosis_daemon.settings import load_settings

    settings = load_settings(cli={"model": str(model_dir), "kv_persistence": False,
                                  "max_batch_size": max_batch})
    return start_station(settings, tmp / "run", tmp / "station.log", {"OMP_NUM_THREADS": "1"})


def measure(loaded: Any, model_dir: Path, tmp: Path, batches: list[int], tokens: int,
            rounds: int, prompt_len: int = 16) -> dict[int, dict[str, float]]:
    """-> batch -> {"step_ms", "forward_ms", "overhead_ms", "socket_ms"}: the in-process
    medians over the decode steps of ``rounds`` timed rounds, and the median round through
    a station's socket, the two sides taking turns round by round (after one untimed round
    each) so that both figures come from the same minutes of a shared machine."""
    import trio

    from bench.common import stop_station

    proc = _station(model_dir, tmp, max(batches))
    try:
        out: dict[int, dict[str, float]] = {}
        for batch in batches:
            prompts = _prompts(batch, loaded.vocab_size, prompt_len)
            periods: list[float] = []
            forwards: list[float] = []
            socket: list[float] = []
            for timed in [False] + [True] * rounds:
                p, f = _engine_round(loaded, batch, max(batches), tokens, prompt_len)
                there = trio.run(_socket_step_ms, tmp / "run" / "station.sock", prompts, tokens)
                if timed:
                    periods += p
                    forwards += f
                    socket.append(there)
            overheads = [a - b for a, b in zip(periods, forwards)]
            out[batch] = {"step_ms": statistics.median(periods) * 1000,
                          "forward_ms": statistics.median(forwards) * 1000,
                          "overhead_ms": statistics.median(overheads) * 1000,
                          "socket_ms": statistics.median(socket)}
        return out
    finally:
        stop_station(proc)


def report(figures: dict[int, dict[str, float]]) -> str:
    lines = ["| streams | step (ms) | forward (ms) | beyond the forward (ms a step) | per stream (ms) "
             "| step through the socket (ms) | beyond the forward there (ms) |",
             "|---|---|---|---|---|---|---|"]
    for batch, f in sorted(figures.items()):
        lines.append(f"| {batch} | {f['step_ms']:.2f} | {f['forward_ms']:.2f} | "
                     f"{f['overhead_ms']:.2f} | {f['overhead_ms'] / batch:.3f} | "
                     f"{f['socket_ms']:.2f} | {f['socket_ms'] - f['forward_ms']:.2f} |")
    top = max(figures)
    held = figures[top]["socket_ms"] - figures[top]["forward_ms"]
    met = "met" if held <= GOAL_MS else "not met"
    lines.append(f"\ngoal: <= {GOAL_MS:g} ms a step beyond the model's forward at {top} streams"
                 f" through the socket: {held:.2f} ms ({met})")
    return "\n".join(lines)


def tiny_loaded(tmp: Path) -> tuple[Path, Any]:
    """A tiny random Llama (tests/support/tiny_models.py): its directory, and the model
    loaded as the station loads one."""
    import importlib

    from gnosis_daemon.settings import Settings
    from station.model.loader import load_model

    # the suite's builder (tests/ is not type-checked as a package: imported by name)
    tiny_models = importlib.import_module("tests.support.tiny_models")
    path = tiny_models.build_tiny_model(tmp / "tiny-llama", "llama")
    return path, load_model(Settings(runtime_dir=str(tmp), model=str(path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_overhead", description=__doc__)
    parser.add_argument("--streams", default="1,8,32", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each stream decodes")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed rounds a batch size, after an untimed one")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.streams.split(",")]
    import torch

    torch.set_num_threads(1)  # the forward on one thread, as the station's: see the docstring
    with tempfile.TemporaryDirectory(prefix="gnosis-overhead-") as tmp:
        path, loaded = tiny_loaded(Path(tmp))
        print(f"engine time per decode step beyond the forward: a tiny random Llama on one "
              f"torch thread, {args.tokens} greedy tokens a stream, medians of {args.rounds} "
              f"rounds", flush=True)
        figures = measure(loaded, path, Path(tmp), batches, args.tokens, args.rounds)
        print(report(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
