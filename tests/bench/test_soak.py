"""`make soak` itself, so it cannot rot: a `--quick` drill on a tiny model, for seconds.

The drill starts `gnosis-daemon run`, loads it from a few clients, SIGKILLs the station,
SIGSTOPs it until the supervisor replaces it, SIGKILLs the host, and writes its report. What
is checked is the drill's own verdict (no hang, every fault recovered from, no leaked KV
block, no restart it did not cause, the host restart kept the station's sessions) and that
the report holds every table the issue asks for. Its figures on a shared CPU mean nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys

from bench.soak.load import ROUTES
from bench.soak.report import BEGIN, END, write_section
from tests.support.procs import REPO, child_env
from tests.support.tiny_models import build_tiny_model


def test_quick_soak_on_a_tiny_model(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    out = tmp_path / "reliability.md"
    out.write_text("# Reliability\n\nHand-written text stays.\n\n" + BEGIN + "\nold\n" + END + "\n\nTail.\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--quick", "--model", str(model_dir), "--clients", "6",
         "--duration", "4", "--out", str(out)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    report = out.read_text()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    # before each fault the station listed both probes as durable (kv_session.list)
    assert proc.stdout.count("the probes were durable") == 3, proc.stdout[-4000:]
    assert report.startswith("# Reliability\n\nHand-written text stays.\n\n" + BEGIN)
    assert report.endswith(END + "\n\nTail.\n") and "\nold\n" not in report

    rows = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in report.splitlines()
        if line.startswith("| "))}
    for route in ROUTES:
        assert int(rows[route][1]) > 0, route  # every kind of request was sent
    assert "Hangs: **0**." in report
    faults = ["station SIGKILL", "station SIGSTOP (hung)", "host SIGKILL"]
    for fault in faults:
        assert re.fullmatch(r"\d+\.\d", rows[fault][2]), rows[fault]  # probes durable after
        assert re.fullmatch(r"\d+\.\d", rows[fault][5]), rows[fault]  # recovery seconds
    assert rows["station SIGSTOP (hung)"][4].endswith("(unresponsive: 2 failed health checks)")
    assert rows["host SIGKILL"][8].count("hit (") == 2  # the station kept both probe sessions
    assert re.search(r"leaked \(held − pinned\) = 0\*\*", report)
    assert "Restarts counted by the supervisor: host 1, station 2." in report
    assert "Verdict: **pass**" in report
    for name in ("supervisor", "host", "station"):
        assert name in rows  # RSS and fds of every process


def test_write_section_appends_the_markers_once(tmp_path):
    path = tmp_path / "r.md"
    path.write_text("# Reliability\n")
    write_section(path, "first")
    write_section(path, "second")
    assert path.read_text() == f"# Reliability\n\n{BEGIN}\nsecond\n{END}\n"
