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
import shutil
import sys
import tempfile
from pathlib import Path

import trio

from bench.common import REPO
from bench.soak.daemon import Daemon, loadavg
from bench.soak.drill import Drill
from bench.soak.faults import PROBE_KEY
from bench.soak.load import TENANTS
from bench.soak.report import write_section


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
    load_before = loadavg()
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
        text = result.render(args, sys.argv[1:] if __name__ == "__main__" else ())
        print(text, flush=True)
        if args.out:
            write_section(Path(args.out), text)
            print(f"written to {args.out}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
