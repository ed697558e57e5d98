"""The prefill rows' parts: the fastest plain dense forward per round, the figures plotted,
and the plain forwards themselves on a tiny model (real forwards, in process)."""

from __future__ import annotations

import argparse
import re

import torch

from bench import prefill
from bench.common import Report
from gnosis_daemon.settings import load_settings
from tests.support.tiny_models import build_tiny_model

PNG = b"\x89PNG\r\n\x1a\n"


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prefill.add_arguments(parser)
    args = parser.parse_args([])
    args.rounds, args.plot_rounds = 3, 2
    for key, value in kw.items():
        setattr(args, key, value)
    return args


def test_the_fastest_dense_forward_is_chosen_round_by_round():
    point = prefill.Point(station=[1.0, 2.0, 3.0], fp32=[2.0, 1.0, 4.0], bf16=[1.0, 4.0, None])
    # round 1: bf16 (1.0) beats fp32; round 2: fp32; round 3: no bf16, fp32 by default
    assert point.fastest().pairs == [(1.0, 1.0), (2.0, 1.0), (3.0, 4.0)]
    assert point.fastest_names() == ["bf16", "fp32", "fp32"]
    assert point.fastest().ratio == 1.0
    assert prefill.fastest_detail(point) == (
        "station 2000 ms, fp32 2000 ms, bf16 2500 ms; fastest: fp32 (2 of 3 rounds); "
        "median of 3 interleaved rounds, per round 1.000 2.000 0.750")


def test_without_bfloat16_the_detail_says_why_and_fp32_is_the_fastest():
    point = prefill.Point(station=[3.0], fp32=[2.0], bf16=[None])
    assert prefill.fastest_detail(point, "bfloat16 not measured (RuntimeError: no)") == (
        "station 3000 ms, fp32 2000 ms, bf16 - (bfloat16 not measured (RuntimeError: no)); "
        "fastest: fp32 (1 of 1 rounds); median of 1 interleaved rounds, per round 1.500")


def test_rows_for_each_row_length_and_the_turn():
    sweep = prefill.Sweep(points={500: prefill.Point([1.0], [2.0], [0.5]),
                                  4000: prefill.Point([8.0], [8.0], [None])},
                          turns=[(41.0, 4000, 4020), (39.0, 4000, 4020), (70.0, 4000, 4020)])
    report = Report()
    prefill.add_rows(report, sweep, _args(prefill_rows="500,4000"))
    assert [(r.name, r.value, r.op, r.bar, r.met) for r in report.rows] == [
        ("miss TTFT / fastest plain dense forward (500-token prompt)", 2.0, "<=", 1.0, False),
        ("miss TTFT / fastest plain dense forward (4,000-token prompt)", 1.0, "<=", 1.0, True),
        ("conversation turn: station ms before the first token, 20 new tokens on a 4,000-token "
         "cached conversation", 41.0, "<=", 60.0, True)]
    assert report.rows[2].detail.endswith("rounds: 41.0 39.0 70.0; 4020 prompt tokens, cached 4000")


def test_plot_has_every_measured_side_and_llama_cpp_where_it_ran(tmp_path):
    sweep = prefill.Sweep(points={250: prefill.Point([0.5], [0.25], [None]),
                                  1000: prefill.Point([1.0, 3.0], [2.0, 2.0], [1.0, 1.0])},
                          quantized={1000: 4.0})
    table, image = prefill.plot(sweep, _args(), tmp_path / "img",
                                {"llama.cpp server (miss)": [100.0, None, 50.0]}, [250, 500, 1000])
    assert image == "img/prefill_by_prompt.png"
    assert (tmp_path / image).read_bytes()[:8] == PNG
    lines = table.splitlines()
    assert lines[2] == ("| prompt tokens | daemon (station miss) | plain float32 dense | plain bfloat16 "
                        "dense | plain quantized torch path | llama.cpp server (miss) |")
    # tokens over the median seconds; a side not measured at a length is "-"
    assert lines[4:] == ["| 250 | 500 | 1000 | - | - | 100 |", "| 1000 | 500 | 500 | 1000 | 250 | 50 |"]
    assert "![prefill tokens/s by prompt length](img/prefill_by_prompt.png)" in prefill.markdown(table, image)


def test_plain_forwards_of_a_tiny_model_are_three_real_models(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    plain = prefill.PlainForwards(load_settings(cli={"model": str(model_dir)}))
    assert plain.bf16 is not None and plain.bf16_missing == ""
    assert {p.dtype for p in plain.fp32.model.parameters()} == {torch.float32}
    assert {p.dtype for p in plain.bf16.model.parameters()} == {torch.bfloat16}
    # a float checkpoint's quantized torch path is int4 at load (bench.weights' rule)
    assert plain.quantized.model is not plain.fp32.model
    assert any(re.search("int4", type(m).__name__, re.I) for m in plain.quantized.model.modules())
    fp32, bf16 = plain.dense_s([5] * 40)
    assert fp32 > 0 and bf16 is not None and bf16 > 0
