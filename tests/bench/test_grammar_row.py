"""The structured-output row of `make bench` (bench.grammar) run alone on a tiny model:
the row is produced through a real station and host, both sides decode the same number of
tokens, and the rates are positive. (A tiny random model's figures mean nothing.)"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.procs import REPO, child_env
from tests.support.tiny_models import build_tiny_model

ROW = "decode tok/s grammar-constrained (json_schema) / unconstrained"


def test_grammar_row_alone_on_a_tiny_model(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.grammar", "--model", str(model_dir), "--rounds", "2",
         "--max-tokens", "12"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if ROW in line]
    m = re.search(r": (\d+\.\d{3}) \(goal >= 0\.8\) -- json_schema (\d+\.\d) tok/s \((\d+) tokens, "
                  r"finish (\w+), (\d)/2 rounds' JSON parsed\), unconstrained (\d+\.\d) tok/s "
                  r"\((\d+) tokens\); median of 2 interleaved rounds, per round "
                  r"(\d+\.\d{3}) (\d+\.\d{3}); A/A: slowest / fastest unconstrained round "
                  r"(\d\.\d{3})$", line)
    assert m, line
    ratio, grammar_tps, n, finish, _, plain_tps, plain_n, r1, r2, control = m.groups()
    assert float(grammar_tps) > 0 and float(plain_tps) > 0
    assert 0 < float(ratio) and float(r1) > 0 and float(r2) > 0
    assert 0 < float(control) <= 1
    # the unconstrained side is asked for exactly as many tokens as the grammar produced
    assert n == plain_n and 1 < int(n) <= 12
    assert finish in ("stop", "length")
