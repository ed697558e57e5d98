"""The fleet drill's figures, verdicts and markdown section (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench.common import cpu_model, replace_marked
from bench.fleet.drill import Conversation, HitRate, hit_rate, later_turns

BEGIN, END = "<!-- fleet:begin -->", "<!-- fleet:end -->"
GOAL_HASH = 0.95  # turn-2+ hit rate through consistent hashing
GOAL_MOVED = 0.9  # moved conversations' next turns that hit on the survivor


@dataclass
class Figures:
    args: argparse.Namespace
    phase1: dict[str, list[Conversation]] = field(default_factory=dict)
    phase2: list[Conversation] = field(default_factory=list)
    victim: str | None = None
    moved: list[str] = field(default_factory=list)
    killed_pids: list[int] = field(default_factory=list)
    written_wait_s: float | None = None
    after_kill_s: float = 0.0
    router_log: str = ""
    seconds: float = 0.0

    # -- the figures
    def rate(self, name: str) -> HitRate:
        return hit_rate(later_turns(self.phase1.get(name, [])))

    def moved_turns(self) -> list:
        return [c.results[2] for c in self.phase2 if c.script.conv_id in self.moved]

    def stayed_turns(self) -> list:
        return [c.results[2] for c in self.phase2 if c.script.conv_id not in self.moved]

    def moved_rate(self) -> HitRate:
        return hit_rate(self.moved_turns())

    def mismatches(self) -> list[str]:
        """Turns of phase 2 whose answer differs from the uninterrupted run's (phase 1)."""
        reference = {c.script.conv_id: c.answers for c in self.phase1.get("reference", [])}
        out = []
        for c in self.phase2:
            for r in c.results:
                want = reference.get(c.script.conv_id, [None] * 3)[r.turn]
                if r.text != want:
                    out.append(f"{c.script.conv_id} turn {r.turn + 1}: {r.text!r} != {want!r}")
        return out

    def errors(self) -> list[str]:
        every = [r for cs in self.phase1.values() for c in cs for r in c.results]
        every += [r for c in self.phase2 for r in c.results]
        return [f"{r.conv_id} turn {r.turn + 1}: {r.error}" for r in every if r.error]

    def moved_landed_on_survivor(self) -> bool:
        return all(r.replica not in (None, self.victim) for r in self.moved_turns())

    @property
    def checks(self) -> list[tuple[str, bool]]:
        hashed, robin = self.rate("hash"), self.rate("robin")
        return [
            (f"turn-2+ hit rate through consistent hashing >= {GOAL_HASH}", hashed.rate >= GOAL_HASH),
            ("round robin's below consistent hashing's", robin.rate < hashed.rate),
            ("a replica was killed and some conversations moved", bool(self.moved)),
            ("the moved conversations' next turns landed on the survivor",
             bool(self.moved) and self.moved_landed_on_survivor()),
            (f"moved conversations' next turns that hit >= {GOAL_MOVED}",
             bool(self.moved) and self.moved_rate().rate >= GOAL_MOVED),
            ("greedy answers equal the uninterrupted run's, every turn", not self.mismatches()),
            ("no request failed", not self.errors()),
        ]

    @property
    def met(self) -> bool:
        return all(ok for _, ok in self.checks)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(f: Figures) -> str:
    a = f.args
    hashed, robin, ref = f.rate("hash"), f.rate("robin"), f.rate("reference")
    moved, stayed = f.moved_rate(), hit_rate(f.stayed_turns())
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Fleet: two replicas behind vllm-router (`make fleet-bench`)",
        "",
        f"Run {when} on {platform.node() or 'this host'} ({cpu_model()}, {os.cpu_count()} cores), "
        f"{f.seconds:.0f} s; model "
        f"`{a.model or 'default (SmolLM2-135M-Instruct)'}`; {a.conversations} conversations per "
        f"set, system prompts of {a.system_words} words (distinct from their first words), "
        f"greedy, {a.max_tokens} tokens a turn; the official `openai` client with "
        "`X-Session-Id` per conversation; vllm-router 0.1.17 on loopback. A turn counts as a "
        "hit when liquid memory loaded its own conversation's KV (`hit` and at least half the "
        "prompt cached), not a block another conversation shares.",
        "",
        "| set | router policy | turn-2+ hits | TTFT hit ms (median) | TTFT miss ms (median) | turns per replica |",
        "|---|---|---:|---:|---:|---|",
        f"| A: 2 turns | consistent_hash on `X-Session-Id` | {hashed.text()} | "
        f"{_ms(hashed.ttft_hit_ms)} | {_ms(hashed.ttft_miss_ms)} | {_spread(f.phase1.get('hash', []))} |",
        f"| B: 2 turns | round_robin | {robin.text()} | {_ms(robin.ttft_hit_ms)} | "
        f"{_ms(robin.ttft_miss_ms)} | {_spread(f.phase1.get('robin', []))} |",
        f"| F: 3 turns, uninterrupted (the reference) | consistent_hash | {ref.text()} | "
        f"{_ms(ref.ttft_hit_ms)} | {_ms(ref.ttft_miss_ms)} | {_spread(f.phase1.get('reference', []))} |",
        "",
        f"Replica loss, on a shared tier (`kv_shared_dir`, `kv_shared_scan_s` {a.scan_s:g}): set F "
        f"again on two fresh replicas; after turn 2, `{f.victim}` (which served "
        f"{len(f.moved)} of the {len(f.phase2)} conversations' turn 2) lost every process at "
        f"once (SIGSTOP then SIGKILL of pids {', '.join(map(str, f.killed_pids))})"
        + ("" if f.written_wait_s is None else
           f", {f.written_wait_s:.1f} s after its write-behind had nothing queued plus two rescan periods")
        + f". Turn 3 of every conversation took {f.after_kill_s:.1f} s in all.",
        "",
        "| conversations | turn 3 hits | TTFT hit ms (median) | TTFT miss ms (median) | landed on | hits' KV from |",
        "|---|---:|---:|---:|---|---|",
        f"| moved (their replica was killed) | {moved.text()} | {_ms(moved.ttft_hit_ms)} | "
        f"{_ms(moved.ttft_miss_ms)} | {_landed(f.moved_turns())} | {_tiers(f.moved_turns())} |",
        f"| stayed | {stayed.text()} | {_ms(stayed.ttft_hit_ms)} | {_ms(stayed.ttft_miss_ms)} | "
        f"{_landed(f.stayed_turns())} | {_tiers(f.stayed_turns())} |",
        "",
        "| check | met |",
        "|---|---|",
        *[f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in f.checks],
    ]
    for title, items in (("Answers that differ from the uninterrupted run", f.mismatches()),
                         ("Requests that failed", f.errors())):
        if items:
            lines += ["", f"{title}:", "", *[f"- {item}" for item in items[:20]]]
    lines += ["", f"Verdict: **{'pass' if f.met else 'fail'}**."]
    return "\n".join(lines) + "\n"


def _spread(convs: list[Conversation]) -> str:
    counts: dict[str, int] = {}
    for c in convs:
        for r in c.results:
            counts[r.replica or "?"] = counts.get(r.replica or "?", 0) + 1
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "-"


def _tiers(results: list) -> str:
    counts: dict[str, int] = {}
    for r in results:
        if r.kept:
            counts[r.tier or "?"] = counts.get(r.tier or "?", 0) + 1
    return ", ".join(f"{tier} {n}" for tier, n in sorted(counts.items())) or "-"


def _landed(results: list) -> str:
    names = sorted({r.replica or "?" for r in results})
    return ", ".join(names) if names else "-"


def write_section(path: Path, section: str) -> None:
    """Replace the text between the fleet markers of ``path`` (append them when missing)."""
    replace_marked(path, BEGIN, END, section, "Benchmarks")
