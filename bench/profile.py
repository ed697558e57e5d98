"""Where a decode token's time goes (`make profile`, or `python -m bench --profile`).

One greedy stream of the default model decodes the same prompt at three depths, in one run:

1. **in process**: a ``PagedEngine`` on this process's engine thread, profiled with
   ``torch.profiler`` started on that thread (an engine call). Every op's own time is
   charged to the first of its ancestors (or itself) that names a part: the linear layers
   and the vocabulary head (**weights**), the paged attention function (**attention**: the
   KV pool's writes and gathers and the SDPA), the sampler (**sampling**); torch ops outside
   those are **other ops** (norms, rotary, residual adds...). What a step's wall time holds
   beyond its ops is **Python** (transformers' module calls, our step code). The engine's
   time between steps (events, scheduling the next step, the loop) is **engine loop**.
2. **through the station's socket**: a station process, the ``generate`` op streamed; the
   per-token time beyond the in-process one is the socket, msgpack and the station's serving
   side; **detokenizing** is measured apart (the incremental detokenizer over the same
   tokens) and taken out of it.
3. **through the HTTP API**: a host on that station, a streamed chat completion; beyond the
   socket's per-token time is **the host** (HTTP, SSE, JSON).

Per-token times are medians over ``--rounds`` interleaved rounds. The profiler slows every
op it records, so one extra pass runs under it and gives only each in-process part's
share of a step; the unprofiled rounds' step time is split by those shares. The three
depths run the same number of tokens after the first.
"""

from __future__ import annotations

import argparse
import collections
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import free_port, make_prompt_ids, start_station, stop_station
from gnosis_daemon.client import open_station_client
from gnosis_daemon.settings import load_settings

PARTS = ("C decode step", "weights", "attention", "other ops", "Python", "sampling", "engine loop",
         "detokenizing", "socket + station serving", "host (HTTP, SSE)")
_WEIGHT_OPS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise",
               "aten::mkldnn_linear", "gnosis::vocab_head")


_C_CALLS = ("gnosis::vocab_head", "gnosis::cpu_step")


def _part_of(event: Any) -> str | None:
    """The part an op's own time belongs to: its own name or its nearest named ancestor's."""
    node = event
    while node is not None:
        name = node.name
        if name == "gnosis::cpu_step":  # station.kernels.cpu_step: the layers in one C call
            return "C decode step"
        if name in ("gnosis::attention",):
            return "attention"
        if name == "gnosis::sampling":
            return "sampling"
        if name in _WEIGHT_OPS or "linear" in name or "pack_mm" in name:  # int4/int8 kernels
            return "weights"
        node = node.cpu_parent
    return None


class _EngineProfile:
    """An in-process engine with markers around attention, sampling and each step."""

    def __init__(self, settings) -> None:
        import torch
        from torch.profiler import record_function
        from transformers import AttentionInterface

        from station.engine import forks as fanout
        from station.forward import paged_attention
        from station.engine.loop import PagedEngine
        from station.model.loader import load_model

        self.torch = torch
        self.loaded = load_model(settings)
        self.engine = PagedEngine(self.loaded, settings)
        attention = paged_attention.paged_attention_forward

        def marked_attention(*args, **kwargs):
            with record_function("gnosis::attention"):
                return attention(*args, **kwargs)

        AttentionInterface.register(paged_attention.ATTN_IMPLEMENTATION, marked_attention)
        sample = fanout.sample_sequences  # the engine samples through fanout.sample_step

        def marked_sample(*args, **kwargs):
            with record_function("gnosis::sampling"):
                return sample(*args, **kwargs)

        fanout.sample_sequences = marked_sample
        head = self.engine.runner._head  # the vocabulary head (a C kernel's time has no op)
        if head is not None:
            def marked_head(x):
                with record_function("gnosis::vocab_head"):
                    return head(x)

            marked_head.kernel = head.kernel  # type: ignore[attr-defined]  # read as the head's

            self.engine.runner._head = marked_head  # type: ignore[assignment]  # a timed stand-in
        if self.engine.runner._step is not None:  # C calls: no ops of their own either
            self.engine.runner._step = _MarkedStep(  # type: ignore[assignment]  # a timed stand-in
                self.engine.runner._step, record_function)
        step = self.engine.step
        self.step_s: list[float] = []

        def timed_step() -> None:
            start = time.perf_counter()
            with record_function("gnosis::step"):
                step()
            self.step_s.append(time.perf_counter() - start)

        self.engine.step = timed_step  # type: ignore[method-assign]
        self.prof: Any = None  # torch.profiler.profile while a pass is profiled

    def _call(self, fn) -> None:
        done = threading.Event()

        def handler(calls, owner, on_done):
            fn()
            return {}

        self.engine.call(handler, "profile", lambda result, error: done.set())
        assert done.wait(60)

    def decode(self, prompt: list[int], tokens: int, profile: bool) -> tuple[float, list[int]]:
        """-> (seconds per token after the first, the tokens); ``profile``: under the profiler."""
        from station.core.requests import Finished, GenerationRequest, SamplingParams, Token

        from torch.profiler import ProfilerActivity, profile as torch_profile
        if profile:
            self.prof = torch_profile(activities=[ProfilerActivity.CPU])
            self._call(self.prof.__enter__)  # on the engine thread: it records that thread
        self.step_s.clear()
        times: list[float] = []
        ids: list[int] = []
        finished = threading.Event()

        def on_event(event) -> None:
            if isinstance(event, Token):
                times.append(time.perf_counter())
                ids.append(event.token_id)
            elif isinstance(event, Finished) or type(event).__name__ == "Failed":
                finished.set()

        self.engine.add_request(GenerationRequest(
            f"p{time.monotonic_ns()}", list(prompt),
            SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)), on_event)
        assert finished.wait(600)
        if profile:
            self._call(lambda: self.prof.__exit__(None, None, None))
        return (times[-1] - times[0]) / (len(times) - 1), ids

    def shares(self) -> dict[str, float]:
        """Each in-process part's share of a step's wall time, from the profiled pass (the
        profiler slows every op, so only the shares are kept, not its times)."""
        events = list(self.prof.events())
        steps = [e for e in events if e.name == "gnosis::step"]
        step_us = sum(e.cpu_time_total for e in steps)
        own: dict[str, float] = collections.defaultdict(float)
        for event in events:
            # a marker's own time is Python around its ops, except where the marked call is a
            # C kernel (the head, the C step): there its own time is the kernel's
            if (event.name.startswith("gnosis::") and event.name not in _C_CALLS) or not _inside(
                    event, "gnosis::step"):
                continue
            own[_part_of(event) or "other ops"] += event.self_cpu_time_total
        shares = {part: own.get(part, 0.0) / step_us
                  for part in ("C decode step", "weights", "attention", "other ops", "sampling")}
        shares["Python"] = max(0.0, 1 - sum(shares.values()))
        return shares


class _MarkedStep:
    """The C decode step (and the head it runs on its threads) under profiler markers."""

    def __init__(self, step: Any, record_function: Any) -> None:
        self.step, self.record_function, self.fits = step, record_function, step.fits

    def __call__(self, *args: Any) -> Any:
        with self.record_function("gnosis::cpu_step"):
            return self.step(*args)

    def head(self, *args: Any) -> Any:
        with self.record_function("gnosis::vocab_head"):
            return self.step.head(*args)


def _inside(event: Any, name: str) -> bool:
    node = event.cpu_parent
    while node is not None:
        if node.name == name:
            return True
        node = node.cpu_parent
    return False


def _detok_ms(tokenizer, prompt: list[int], ids: list[int]) -> float:
    from station.serving.detok import IncrementalDetokenizer

    best = float("inf")
    for _ in range(3):
        detok = IncrementalDetokenizer(tokenizer, prompt)
        start = time.perf_counter()
        for token in ids:
            detok.feed([token])
        best = min(best, (time.perf_counter() - start) / len(ids))
    return best * 1000


async def _socket_per_token(sock: Path, prompt: list[int], tokens: int) -> float:
    async with open_station_client(sock) as conn:
        times: list[float] = []
        async with conn.open_stream("generate", {"tokens": prompt, "max_tokens": tokens + 1,
                                                 "temperature": 0, "ignore_eos": True,
                                                 "tenant": "profile"}) as stream:
            async for event in stream:
                if event.get("type") == "tokens":
                    times.extend([time.perf_counter()] * len(event["token_ids"]))
    return (times[-1] - times[0]) / (len(times) - 1)


def _http_per_token(port: int, text: str, tokens: int) -> float:
    from bench.liquid import stream_chat

    streamed = stream_chat(port, [{"role": "user", "content": text}], tokens + 1, ignore_eos=True)
    return 1 / streamed.decode_tps


def _measure(local: _EngineProfile, settings, args) -> dict[str, Any]:
    from bench.liquid import start_host

    prompt = make_prompt_ids(local.loaded.vocab_size, args.prompt_tokens, seed=7)
    text = local.loaded.tokenizer.decode(prompt)
    depths: dict[str, list[float]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="gnosis-profile-") as tmp:
        runtime_dir = Path(tmp) / "run"
        proc = start_station(settings, runtime_dir, Path(tmp) / "station.log")
        port = free_port()
        host = start_host(settings, runtime_dir, port, Path(tmp) / "host.log", liquid=False)
        try:
            _http_per_token(port, text, 4)  # warm-ups
            local.decode(prompt, 4, profile=False)
            local.decode(prompt, args.decode_tokens, profile=True)  # the shares only
            shares = local.shares()
            step_s: list[float] = []
            for _ in range(args.rounds):
                s, ids = local.decode(prompt, args.decode_tokens, profile=False)
                depths["engine"].append(s)
                step_s.append(statistics.median(local.step_s))
                depths["socket"].append(trio.run(_socket_per_token, runtime_dir / "station.sock",
                                                 prompt, args.decode_tokens))
                depths["http"].append(_http_per_token(port, text, args.decode_tokens))
        finally:
            stop_station(host)
            stop_station(proc)
    return {"depths": depths, "shares": shares, "step_s": step_s, "ids": ids, "prompt": prompt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    settings = load_settings(cli={"model": args.model, "kv_persistence": False})
    print(f"profile of one decode token: {args.decode_tokens} greedy tokens after a "
          f"{args.prompt_tokens}-token prompt, one stream, medians of {args.rounds} rounds", flush=True)
    # As in the station (station/main.py): one thread loads the model and runs the engine,
    # so libgomp keeps one OpenMP pool; this thread drives it and runs no torch op.
    booted: queue.Queue = queue.Queue()

    def torch_thread() -> None:
        try:
            engine = _EngineProfile(settings)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            booted.put(exc)
            return
        booted.put(engine)
        engine.engine.run_here()

    thread = threading.Thread(target=torch_thread, name="station-torch", daemon=True)
    thread.start()
    local = booted.get()
    if isinstance(local, BaseException):
        raise local
    try:
        out = _measure(local, settings, args)
    finally:
        local.engine.shutdown()
    depths, shares, step_s, ids, prompt = (out[k] for k in ("depths", "shares", "step_s", "ids", "prompt"))
    engine_s, socket_s, http_s = (statistics.median(depths[k]) for k in ("engine", "socket", "http"))
    step_ms = statistics.median(step_s) * 1000
    parts = {part: share * step_ms for part, share in shares.items()}
    parts["engine loop"] = max(0.0, engine_s * 1000 - step_ms)
    parts["detokenizing"] = _detok_ms(local.loaded.tokenizer, prompt, ids)
    parts["socket + station serving"] = max(0.0, (socket_s - engine_s) * 1000 - parts["detokenizing"])
    parts["host (HTTP, SSE)"] = max(0.0, (http_s - socket_s) * 1000)
    total = http_s * 1000
    print("\n| part | ms per token | share |\n|---|---|---|")
    for part in PARTS:
        print(f"| {part} | {parts[part]:.2f} | {parts[part] / total:.0%} |")
    print(f"| **total through the API** | **{total:.2f}** ({1000 / total:.1f} tok/s) | 100% |")
    print(f"\nin process {engine_s * 1000:.2f} ms/token, through the socket {socket_s * 1000:.2f}, "
          f"through HTTP {http_s * 1000:.2f}; a step's wall time (median) {step_ms:.2f} ms, "
          f"split by the shares of one profiled pass", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
