"""`make bench` itself: its verdicts, and a whole run on a tiny model (so it cannot rot).

The figures of a tiny model on a shared CPU mean nothing; what is checked is that every
figure is measured through the real parts and reported, and that a prefix hit is a hit.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from bench.common import Row
from bench.peers import second_model
from tests.support.procs import REPO, child_env
from tests.support.tiny_models import build_tiny_model


@pytest.mark.parametrize(("value", "op", "bar", "noise", "met"), [
    (1.09, "<=", 1.1, 0.0, True),
    (1.11, "<=", 1.1, 0.0, False),
    (4.0, ">=", 4.0, 0.0, True),
    (3.99, ">=", 4.0, 0.0, False),
    (0.99, ">=", 1.0, 0.0, False),  # a parity bar with no measured noise is strict
    (0.95, ">=", 1.0, 0.06, True),  # short by less than identical runs differ
    (0.93, ">=", 1.0, 0.06, False),  # short by more: a real regression
    (0.08, ">=", 1.0, 0.2, False),  # the predecessor's liquid path
    (123.0, "info", None, 0.0, True),
])
def test_row_verdict(value, op, bar, noise, met):
    assert Row("figure", value, op, bar, "", noise).met is met


FIGURES = [
    "prefix-hit TTFT / miss TTFT (96-token shared prefix)",
    "miss TTFT / float32 dense forward (96-token prompt)",
    "miss TTFT / quantized torch path forward (96-token prompt)",
    "miss TTFT / fastest plain dense forward (48-token prompt)",
    "miss TTFT / fastest plain dense forward (96-token prompt)",
    "conversation turn: station ms before the first token, 20 new tokens on a 96-token cached conversation",
    "station single-stream decode / plain contiguous-cache loop",
    "aggregate decode at 3 streams / 1 stream",
    "decode_next round trip per token / generate per token",
    "decode tok/s liquid path / native path",
    "A/A control: slowest / fastest native round",
    "second-turn TTFT / first-turn TTFT (96-token first turn)",
    "/v1/messages turn-2 TTFT / turn-1 TTFT (cache_control on a 96-token system prompt)",
    "/v1/responses turn-2 TTFT / turn-1 TTFT (previous_response_id after a 96-token turn)",
    "decode tok/s grammar-constrained (json_schema) / unconstrained",
    "disk-tier hit TTFT / cold-prefill TTFT (96-token prompt)",
    "station start with a 10x-pool disk tier / with an empty tier",
    "decode beside a writer that meets its bound / idle",
    "write-behind lag p99 beside a saturating decode (ms)",
    "the same at kv_io_nice 0: decode busy / idle",
    "saturated writer at kv_io_nice 19: decode busy / idle",
    "A/A control: slowest / fastest idle decode round",
    "saturated writer at kv_io_nice 0: decode busy / idle",
    "greedy prompts whose 64 tokens are the same, quantized / float (5 prompts)",
    "top-1 agreement over 512 teacher-forced tokens, quantized / float",
    "top-1 agreement over 512 teacher-forced tokens, C decode step / float",
    "greedy prompts whose 64 tokens are the same, station (C decode step) / float (5 prompts)",
    "station single-stream decode, quantized weights / float",
    "station RSS after one request, quantized weights / float",
    "start check / station start, tiny-llama",
]


def test_bench_runs_every_figure_on_a_tiny_model(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--model", str(model_dir), "--prompt-tokens", "96",
         "--decode-tokens", "6", "--streams", "3", "--rounds", "1", "--out", str(out),
         "--second-model", "off",  # Gemma 3 270M beside llama.cpp: minutes where both are here
         "--prefill-rows", "48,96", "--prefill-plot", "32", "--tier-busy-rounds", "1"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    # 0: every goal met, 1: some missed (a tiny model's figures on a shared CPU); not a crash
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d+\.\d{3}", cells[1]):
            rows[cells[0]] = (float(cells[1]), cells[4])
    assert list(rows) == FIGURES
    # every figure is a positive ratio but the share of prompts whose greedy output survives
    # quantizing, which on a random tiny model may well be none
    shares = [n for n in FIGURES if n.startswith("greedy prompts whose")]
    assert len(shares) == 2
    assert all(value > 0 for name, (value, _) in rows.items() if name not in shares)
    assert all(0 <= rows[name][0] <= 1 for name in shares)
    # 96 prompt tokens: every one is reused (the first token from the logits kept after the last)
    assert "(cached 96)" in rows[FIGURES[0]][1]
    # the prefill rows: every plain forward measured, the fastest named; the turn adds 20
    # tokens to the 96 its conversation's miss left cached
    for name in FIGURES[3:5]:
        assert re.match(r"station \d+ ms, fp32 \d+ ms, bf16 \d+ ms; fastest: (fp32|bf16) \(1 of 1 rounds\)",
                        rows[name][1]), rows[name][1]
    assert rows[FIGURES[5]][1].endswith("; 116 prompt tokens, cached 96"), rows[FIGURES[5]][1]
    assert "(hit, cached" in rows[FIGURES[11]][1]
    # the disk tier's figures: a hit read back from disk after a restart, a tier of 10x the pool
    assert "(session_tier disk, cached 95," in rows[FIGURES[15]][1]
    assert re.search(r"= (\d+\.\d)x the", rows[FIGURES[16]][1])
    assert float(re.search(r"= (\d+\.\d)x the", rows[FIGURES[16]][1])[1]) >= 10
    # the dialects' second turns: read from the breakpoint's pin, and from the stored response
    m = re.search(r"cache_read_input_tokens (\d+)\), turn 1 .*cache_creation_input_tokens (\d+)",
                  rows[FIGURES[12]][1])
    assert m and int(m[1]) == int(m[2]) > 0, rows[FIGURES[12]][1]
    m = re.search(r"turn 2 \d+ ms \(cached (\d+) of (\d+)\)", rows[FIGURES[13]][1])
    assert m and 0 < int(m[1]) < int(m[2]), rows[FIGURES[13]][1]
    # the prefill plot: drawn beside the docs, its figures in a table, every length a row
    assert (out.parent / "img" / "prefill_by_prompt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = out.read_text()
    assert "![prefill tokens/s by prompt length](img/prefill_by_prompt.png)" in text
    table = text.split("## Prefill by prompt length", 1)[1]
    assert [line.split("|")[1].strip() for line in table.splitlines()
            if re.match(r"\| \d+ \|", line)] == ["32", "48", "96"]
    # the grammar row: the unconstrained side is asked for exactly as many tokens as the
    # grammar produced (bench.grammar runs alone too: python -m bench.grammar)
    m = re.search(r"json_schema [\d.]+ tok/s \((\d+) tokens, finish (\w+), .*unconstrained "
                  r"[\d.]+ tok/s \((\d+) tokens\)", rows[FIGURES[14]][1])
    assert m and m[1] == m[3] and int(m[1]) > 1 and m[2] in ("stop", "length"), rows[FIGURES[14]][1]
    # a float checkpoint's quantized side is int4 at load: all 14 of the tiny model's linears
    assert "weights int4: 14 int4 layers (load)" in rows[shares[0]][1]
    # the start check's cost, from the station's hello (a probe of 4 blocks and a few tokens)
    assert re.match(r"start check [\d.]+ s \(probe \d+ tokens", rows[FIGURES[-1]][1])
    second = out.read_text().split(second_model.BEGIN, 1)[1]
    assert "**Second model's rows skipped:** the second model is off (--second-model off)." in second
    assert f"{sum(r.startswith(('ok', 'MISS')) for r in proc.stdout.splitlines())}" == f"{len(FIGURES)}"


def test_profile_splits_a_decode_token_on_a_tiny_model(tmp_path):
    """`make profile` on a tiny model: every part is measured and the three depths agree
    in kind (the API's per-token time is the sum the table's shares are taken of)."""
    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--profile", "--model", str(model_dir), "--prompt-tokens", "16",
         "--decode-tokens", "8", "--rounds", "1"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"\d+\.\d\d", cells[1]):
            table[cells[0]] = float(cells[1])
    from bench.profile import PARTS

    assert list(table) == list(PARTS)
    assert table["weights"] > 0 and table["attention"] > 0  # ops found and charged by name
    total = re.search(r"\*\*total through the API\*\* \| \*\*(\d+\.\d\d)\*\*", proc.stdout)
    assert total and float(total[1]) > 0
