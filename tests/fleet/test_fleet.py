"""`make fleet-bench` itself, on a tiny model: two replicas behind vllm-router on loopback.

What is checked is the drill's own verdict and the facts behind it: through consistent
hashing on `X-Session-Id` every turn 2 reached its conversation's replica and was a hit;
round robin scattered them (fewer hits); with a shared tier, the conversations whose replica
lost every process at once were served by the survivor, read back from the shared tier, with
the same greedy answers as the uninterrupted run. Timings on a shared CPU mean nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile

from bench.fleet.report import BEGIN, END
from tests.support.procs import REPO, child_env
from tests.support.tiny_models import build_tiny_model


def test_fleet_drill_on_a_tiny_model(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\nKept.\n")
    # The replicas bind Unix sockets under the workdir: a short one, since tmp_path under
    # pytest-xdist (".../popen-gw1/...") can pass the 107 bytes a socket path may have.
    workdir = tempfile.mkdtemp(prefix="gnosis-fleet-")
    try:
        proc = _drill(model_dir, out, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = out.read_text()
    assert report.startswith("# Benchmarks\n\nKept.\n\n" + BEGIN) and report.rstrip().endswith(END)
    rows = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in report.splitlines()
        if line.startswith("| "))}
    assert rows["A: 2 turns"][2] == "8/8 = 1.00"
    robin = int(rows["B: 2 turns"][2].split("/")[0])
    assert robin < 8  # scattered: some turn 2 reached the replica without its KV
    assert rows["F: 3 turns, uninterrupted (the reference)"][2] == "16/16 = 1.00"
    moved = rows["moved (their replica was killed)"]
    n = int(moved[1].split("/")[1].split()[0])
    assert n > 0 and moved[1] == f"{n}/{n} = 1.00"
    killed = re.search(r"after turn 2, `(replica-\d)`", report).group(1)
    assert moved[4] != killed and moved[4].startswith("replica-")  # the survivor served them
    assert moved[5] == f"disk {n}"  # read back from the shared tier, not recomputed
    for check, met in ((c[0], c[1]) for c in rows.values() if len(c) == 2 and c[0] != "check"):
        assert met == "yes", check
    assert "Verdict: **pass**." in report


def _drill(model_dir, out, workdir):
    return subprocess.run(
        [sys.executable, "-m", "bench.fleet", "--model", str(model_dir), "--conversations", "8",
         "--system-words", "30", "--max-tokens", "6", "--scan-s", "0.25", "--out", str(out),
         "--workdir", workdir],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)


def test_make_bench_rewrites_its_table_and_keeps_the_fleet_section(tmp_path):
    """`make bench` rewrites docs/benchmarks.md whole; the section `make fleet-bench` wrote
    into it stays."""
    from types import SimpleNamespace

    from bench.common import Report

    path = tmp_path / "benchmarks.md"
    fleet = f"{BEGIN}\n## Fleet\n\n| set | hits |\n{END}"
    path.write_text(f"# Benchmarks\n\nan old table\n\n{fleet}\n")
    report = Report()
    report.add("a figure", 1.5, ">=", 1.0, "measured")
    report.write(path, SimpleNamespace(model=None),
                 SimpleNamespace(prompt_tokens=1, decode_tokens=1, streams=1))
    text = path.read_text()
    assert "an old table" not in text and "| a figure | 1.500 |" in text
    assert text.count(BEGIN) == 1 and text.rstrip().endswith(fleet)
