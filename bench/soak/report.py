"""What the drill found: its verdict, its report, and writing it between the soak markers."""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import subprocess
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import REPO, cpu_model, replace_marked
from bench.soak.faults import PROBE_SESSIONS
from bench.soak.load import MIX, ROUTES, TENANTS
from bench.soak.measures import Fault, Record, Sample

BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
SESSIONS_WHY_STATION = (
    "The probes were saved more than `kv_write_behind_s` before the fault, and the drill "
    "waited until the station listed both as durable (the wait past the bound is in the "
    "table: the write-behind's lag under this load), so the write-behind had them on disk; "
    "the restarted station finds them in its disk tier, so these must all be hits.")
SESSIONS_WHY_HOST = (
    "Sessions live in the station, which kept running, and the station matches them; "
    "these must all be hits.")


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
            if any(s.get("after") != "hit" for s in fault.sessions if s.get("saved")):
                problems.append(f"a session saved before the {fault.name} was not a hit after it")
        return problems

    @property
    def passed(self) -> bool:
        return not self.failures()

    def render(self, args: argparse.Namespace, argv: Sequence[str] = ()) -> str:
        """The report; ``argv``: the command line's arguments when run as ``python -m bench.soak``."""
        lines = [f"### Soak run, {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}", ""]
        command = "make soak" if not args.quick else "python -m bench.soak --quick"
        extra = " ".join(argv)
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
            + ("(keys enforced: a request without a key got 401)" if self.keys_enforced
               else "(keys NOT enforced by this build)"),
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
                  "| fault | at s | probes durable, s past the bound | pid old → new | detected after s "
                  "| recovery s | in flight, not ok | not ok before recovery | probe sessions after recovery |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---|"]
        for f in self.faults:
            sessions = "; ".join(f"{s['id']}: saved {'yes' if s.get('saved') else 'no'}, "
                                 f"{s.get('after')} ({s.get('cached', '-')}"
                                 + (f", {s['reason']}" if s.get("reason") else "") + ")"
                                 for s in f.sessions) or "-"
            detected = f"{f.detected_s:.1f} ({f.exit_reason})" if f.detected_s is not None else "-"
            recovery = f"{f.recovery_s:.1f}" if f.recovery_s is not None else "**not recovered**"
            durable = f"{f.durable_wait_s:.1f}" if f.durable_wait_s is not None else "**not durable**"
            lines.append(f"| {f.name} | {f.at:.1f} | {durable} | {f.old_pid} → {f.new_pid} | {detected} | "
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
                           "unexpected restart, sessions kept across every fault."
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
    replace_marked(path, BEGIN, END, section, "Reliability")
