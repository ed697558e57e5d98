"""``bench.step_overhead`` on a tiny model: the engine's time per step beyond the model's
own calls, in process and through a real station's socket, at each batch size asked for."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.procs import REPO, child_env


def test_step_overhead_reports_every_batch_in_process_and_through_the_socket():
    proc = subprocess.run([sys.executable, "-m", "bench.step_overhead", "--streams", "1,4",
                           "--tokens", "12", "--rounds", "1"], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| (-?[\d.]+) \| (-?[\d.]+) \| ([\d.]+) \| "
                      r"(-?[\d.]+) \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "4"], proc.stdout
    for _, step, forward, *_rest in rows:
        assert float(step) > float(forward) > 0  # a step holds its forward and more
    assert re.search(r"goal: <= 1 ms a step beyond the model's forward at 4 streams through the "
                     r"socket: -?[\d.]+ ms \((met|not met)\)", proc.stdout), proc.stdout
