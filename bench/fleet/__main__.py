"""`make fleet-bench`: two replicas behind vllm-router on loopback, conversations through it.

Phase 1, each replica with its own tier: two routers in front of the same two replicas, one
hashing ``X-Session-Id`` (``--policy consistent_hash``) and one ``round_robin``; 8 two-turn
conversations through each (distinct system prompts, the official `openai` client), and a
third set of 3-turn conversations through the hashing router, uninterrupted: their answers
are the reference for phase 2. Turn-2+ hit rate and TTFT by policy.

Phase 2, the fleet on a shared tier (``kv_shared_dir``): the same 3-turn conversations
through the hashing router; after turn 2 the replica that served most of them loses every
process at once (SIGSTOP, then SIGKILL: a machine gone), once its write-behind has nothing
queued and the survivor has had a rescan period to learn of it (`--no-wait-written` skips
the wait and measures what a kill at any moment costs). Turn 3 of the conversations that
moved must be hits on the survivor, read back from the shared tier, with the same greedy
answers as phase 1.

Exit status: 0 when every goal holds, 1 when one is missed, 2 when the drill broke.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO
from bench.fleet.cluster import Replica, Router
from bench.fleet.drill import Conversation, client_for, run_turns, scripts
from bench.fleet.report import Figures, render, write_section


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the daemon's default model)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--system-words", type=int, default=60,
                   help="words of each conversation's system prompt (60: about 310 tokens)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--scan-s", type=float, default=1.0,
                   help="the replicas' kv_shared_scan_s (1.0: the setting's default)")
    p.add_argument("--no-wait-written", action="store_true",
                   help="kill without waiting for the write-behind (what a kill at any moment costs)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the report into this markdown file (docs/benchmarks.md)")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and tiers here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="gnosis-fleet-"))
    base.mkdir(parents=True, exist_ok=True)
    env = {"GNOSIS_LOG_LEVEL": "warning", "GNOSIS_TENANT_SALT": "fleet-drill-salt",
           "GNOSIS_KV_SHARED_SCAN_S": str(args.scan_s)}
    figures = Figures(args)
    started = time.monotonic()
    try:
        phase1(args, base / "phase1", env, figures)
        phase2(args, base / "phase2", env, figures)
    except SystemExit as exc:
        print(f"fleet drill broke: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    figures.seconds = time.monotonic() - started
    text = render(figures)
    print(text)
    if args.out is not None:
        write_section(args.out, text)
        print(f"written to {args.out}")
    return 0 if figures.met else 1


def start_all(replicas: list[Replica]) -> None:
    """Spawn every replica, then wait for each to serve (their starts overlap)."""
    for r in replicas:
        r.launch()
    for r in replicas:
        r.wait_ready(600)


def phase1(args: argparse.Namespace, base: Path, env: dict[str, str], figures: Figures) -> None:
    replicas = [Replica(base, f"replica-{i}", args.model, None, env) for i in range(2)]
    routers: list[Router] = []
    try:
        start_all(replicas)
        workers = [r.url for r in replicas]
        routers = [Router(base, "consistent_hash", workers), Router(base, "round_robin", workers)]
        for router in routers:
            router.launch()
        for router in routers:
            router.wait_ready()
        hashed, robin = routers
        n = args.conversations
        sets = {
            "hash": [Conversation(s) for s in scripts("h", n, 2, args.system_words, 1)],
            "robin": [Conversation(s) for s in scripts("r", n, 2, args.system_words, 2)],
            "reference": [Conversation(s) for s in scripts("f", n, 3, args.system_words, 3)],
        }
        run_turns(client_for(hashed.url), sets["hash"], range(2), args.max_tokens, seed=1)
        run_turns(client_for(robin.url), sets["robin"], range(2), args.max_tokens, seed=2)
        run_turns(client_for(hashed.url), sets["reference"], range(3), args.max_tokens, seed=3)
        figures.phase1 = sets
    finally:
        for router in routers:
            router.stop()
        for r in replicas:
            r.stop()


def phase2(args: argparse.Namespace, base: Path, env: dict[str, str], figures: Figures) -> None:
    shared = base / "shared"
    replicas = [Replica(base, f"replica-{i}", args.model, shared, env) for i in range(2)]
    router: Router | None = None
    try:
        start_all(replicas)
        router = Router(base, "consistent_hash", [r.url for r in replicas])
        router.start()
        client = client_for(router.url)
        convs = [Conversation(s) for s in scripts("f", args.conversations, 3, args.system_words, 3)]
        run_turns(client, convs, range(2), args.max_tokens, seed=3)
        served = [c.results[1].replica for c in convs]
        victim = max(replicas, key=lambda r: served.count(r.name))
        figures.victim = victim.name
        figures.moved = [c.script.conv_id for c in convs if c.results[1].replica == victim.name]
        if not args.no_wait_written:
            figures.written_wait_s = victim.wait_written()
            time.sleep(2 * args.scan_s)  # the survivor's rescan learns of the last writes
        figures.killed_pids = victim.kill_all()
        killed_at = time.monotonic()
        run_turns(client, convs, range(2, 3), args.max_tokens, seed=4)
        figures.after_kill_s = time.monotonic() - killed_at
        figures.phase2 = convs
        figures.router_log = router.log_tail(10)
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
