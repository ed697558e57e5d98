"""The GPU run's Mistral-7B-shaped bench (tests/gpu/device_bench.py, tests/gpu/mistral_shape.py)
on the CPU: the full shape is Mistral-7B's (built on the meta device, nothing allocated), and
the same code at every dimension divided by 16 runs end to end as tests/gpu/device_check.sh
runs it, printing every figure with a number. Not marked ``gpu``: it runs in ``make test``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.mistral_shape import build_on_device, shape_config, weight_bytes

REPO = Path(__file__).resolve().parents[2]
NUMBER = r"(\d+(?:\.\d+)?)"
STREAMS = (1, 8, 32, 64)
GRAPHS = ("off", "on")  # on: a CPU runs the static step the GPU replays as graphs


def test_the_full_shape_is_mistral_7b():
    from transformers import AutoModelForCausalLM

    config = shape_config(1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert type(model).__name__ == "MistralForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.vocab_size, config.sliding_window) == (32, 4096, 14336, 32, 8, 128, 32000, None)
    assert sum(p.numel() for p in model.parameters()) == 7_241_732_096


def test_the_weights_are_made_in_place_and_the_rotary_tables_computed_again():
    """``to_empty`` leaves every tensor unset, the rotary tables (buffers) too: they must equal
    the ones an ordinary build computes, the norms 1, the matrices normal(0, 0.02), in bf16."""
    from transformers import AutoModelForCausalLM

    config = shape_config(16)
    model = build_on_device(config, torch.device("cpu"), torch.bfloat16)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, buffer in reference.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    assert torch.equal(params["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    std = params["model.layers.0.mlp.up_proj.weight"].float().std().item()
    assert 0.019 < std < 0.021, std
    assert weight_bytes(model) == 2 * sum(p.numel() for p in reference.parameters())


def test_a_shape_scale_outside_the_list_is_refused():
    with pytest.raises(ValueError, match="shape scale"):
        shape_config(3)


def test_the_scaled_run_prints_every_figure(tmp_path):
    out = tmp_path / "bench.txt"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "gpu" / "device_bench.py"), "--allow-cpu",
         "--models", "mistral-7b-shape", "--shape-scale", "16", "--streams", "1,8,32,64",
         "--tokens", "4", "--prompt-len", "128", "--graphs", ",".join(GRAPHS),
         "--budget-s", "100", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    text = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in text and "budget spent" not in text, text
    assert out.read_text() == "".join(line + "\n" for line in text.splitlines()), "--out differs"

    def figure(pattern: str, graphs: str = "") -> list[str]:
        """The numbers of the line ``[mistral-7b-shape /16( graphs=...)] <pattern>``."""
        tag = f" graphs={graphs}" if graphs else ""
        found = re.search(rf"^\[mistral-7b-shape /16{tag}\] " + pattern, text, re.MULTILINE)
        assert found, f"no line matching {pattern!r} in:\n{text}"
        return list(found.groups())

    figure(r"built on cpu in [\d.]+ s: [\d.]+B params, [\d.]+ GB of torch.bfloat16 weights, "
           r"2 layers, hidden 256, FFN 896, heads 2/1 of 128, vocab 2000$")
    (bandwidth,) = figure(rf"copy bandwidth: {NUMBER} GB/s")
    limit, step_ms, bandwidth_again = figure(
        rf"bandwidth limit: {NUMBER} tok/s per stream, {NUMBER} ms a step \([\d.]+ GB of weights "
        rf"read once a step / {NUMBER} GB/s\)$")
    assert float(bandwidth) > 0 and float(limit) > 0 and float(step_ms) > 0
    assert bandwidth_again == bandwidth
    for graphs in GRAPHS:
        for n in STREAMS:
            (rate,) = figure(rf" *{n} stream\(s\) x 4 tokens: +{NUMBER} tok/s aggregate", graphs)
            assert float(rate) > 0
        for label in ("miss", "prefix-cache hit"):
            (ms,) = figure(rf"TTFT 128-token prompt \({label}\): {NUMBER} ms", graphs)
            assert float(ms) > 0
    # graphs=on replayed its static steps; off had none
    (replays,) = figure(rf"decode graphs: \{{.*'decode_graph_replays': {NUMBER}", "on")
    assert int(replays) > 0
    figure("decode graphs: none$", "off")
    read_back, tokens = figure(rf"disk tier read-back 128-token session: {NUMBER} ms \(p50; "
                               rf"session_tier disk, {NUMBER} tokens, [\d.]+ MB of KV, hit TTFT "
                               r"[\d.]+ ms, error None\)")
    assert float(read_back) > 0 and int(tokens) == 112  # the prompt's 7 full blocks before its last token
    (peak,) = figure(rf"peak memory: {NUMBER} GiB \(peak RSS\)")
    assert float(peak) > 0
