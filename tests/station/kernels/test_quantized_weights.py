"""Weights that stay quantized (station.model.weights, station.kernels.quantized, gguf_groups).

The block formats are checked against gguf-py's own quantizer and dequantizer; the kernels
against ``F.linear`` over their own dequantized values; the engine's greedy output on a
quantized tiny model against that same quantized model's ``model.generate`` (a quantized
model is its own reference: the float model's output is compared in ``make bench``); and
the real default GGUF file's 210 4-bit weights against its dense conversion, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from gnosis_daemon.settings import Settings
from station.model.gguf_groups import decode_blocks, dequantize_like_gguf, groups_of
from station.model.loader import load_model
from station.kernels.q4_tiles import TiledLinear
from station.kernels.quantized import Int4Groups, Int4Linear, Int8Linear, Int8Rows
from tests.station.engine.test_paged_engine import BS, engine_for, prompt_of, submit
from tests.support.int4 import check_int4_layer
from tests.support.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_decode_as_gguf_dequantizes_them(kind):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 96)).astype(np.float32) * 0.05
    raw = quants.quantize(weight, GGMLQuantizationType[kind])
    q, d, m = decode_blocks(raw, kind)
    assert q.shape == (48, 96) and q.max() <= 15 and d.shape == (48, 3)
    want = quants.dequantize(raw, GGMLQuantizationType[kind])
    assert np.array_equal(dequantize_like_gguf(q, d, m), want)  # bit for bit
    # torch's (q - 8) * scale + zero form stands for the same values (float32 re-association)
    torch.testing.assert_close(groups_of(q, d, m).dequantize(), torch.from_numpy(want),
                               rtol=0, atol=1e-6)


def test_int4_layer_computes_its_dequantized_weights():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.1
    groups = Int4Groups.quantize(weight)
    assert (groups.dequantize() - weight).abs().max() <= (groups.scale.max() / 2) + 1e-6  # half a step at most
    check_int4_layer(groups, seed=2)


def test_int8_layer_computes_its_dequantized_weights():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.1
    rows = Int8Rows.quantize(weight)
    assert (rows.dequantize() - weight).abs().max() <= rows.scale.max() / 2 + 1e-6
    layer = Int8Linear(rows, None, torch.device("cpu"), torch.float32)
    assert layer.scales.dtype == torch.bfloat16  # a CPU computes in bfloat16 (5x faster at one row)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got, want = layer(x), F.linear(x, rows.dequantize())
        assert torch.equal(layer(x[2:3]), got[2:3])  # a row alone as in a batch
    assert got.dtype == torch.float32
    # bfloat16 activations and row scales: about 3 significant digits
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("quant"), "llama")


def test_float_checkpoint_auto_stays_float_and_int4_changes_the_fingerprint(tiny_dir, tmp_path):
    auto = load_model(Settings(model=str(tiny_dir), model_cache_dir=str(tmp_path)))
    assert auto.weights.summary()["int4_layers"] == 0 and auto.weights.tag == "float"
    int4 = load_model(Settings(model=str(tiny_dir), model_cache_dir=str(tmp_path), weights="int4"))
    summary = int4.weights.summary()
    assert summary["int4_layers"] == 14 and summary["float_layers"] == 0  # 7 linears x 2 layers
    assert summary["linear_bytes"] < summary["linear_bytes_dense"] / 4
    # the C step serves: its tiles are the layers' only copy, q/k/v and gate/up stacked
    tiled = [m for m in int4.model.modules() if isinstance(m, TiledLinear)]
    assert int4.weights.step is not None and len(tiled) == 14
    assert len({id(m.matrix) for m in tiled}) == 8 and summary["linear_bytes"] == int4.weights.step.nbytes
    assert type(int4.model.lm_head) is torch.nn.Linear  # the head keeps the model's dtype
    # KV made by one set of weights is never served to another
    assert int4.fingerprint != auto.fingerprint
    again = load_model(Settings(model=str(tiny_dir), model_cache_dir=str(tmp_path), weights="int4"))
    assert again.fingerprint == int4.fingerprint


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_engine_on_quantized_weights_equals_that_models_generate(tiny_dir, tmp_path, weights):
    # decode through torch's kernels, as model.generate does (the C decode step has its own
    # arithmetic and its own invariance test: tests/station/kernels/test_cpu_step.py)
    loaded = load_model(Settings(model=str(tiny_dir), model_cache_dir=str(tmp_path), weights=weights,
                                 cpu_decode_step="off"))
    kind = Int4Linear if weights == "int4" else Int8Linear
    assert sum(isinstance(m, kind) for m in loaded.model.modules()) == 14
    prompts = [prompt_of(40 + i, 5 + 9 * i) for i in range(5)]
    with engine_for(loaded, prefill_chunk_tokens=16) as engine:
        alone = submit(engine, "alone", prompts[0], 12).wait()
        batch = [submit(engine, f"r{i}", p, 12) for i, p in enumerate(prompts)]
        results = [r.wait().tokens for r in batch]
        hit = submit(engine, "hit", prompts[4], 12).wait()
    assert hit.events[0].cached_tokens >= len(prompts[4]) - BS
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                        do_sample=False)
        want = out[0, len(prompt):].tolist()
        assert results[i] == want, f"prompt {i} in a batch"
        if i == 0:
            assert alone.tokens == want
        if i == 4:
            assert hit.tokens == want


def test_the_default_gguf_keeps_its_q4_1_blocks_exactly(default_model_cache):
    """The real file: every 4-bit weight's blocks dequantize to the dense conversion bit for bit
    (``auto`` uses no block that did not, which also proves the Q/K row order), and the
    quantized model still answers."""
    from station.model.gguf_table import read_tensor_table
    from station.model.loader import default_model_path

    arch, tensors = read_tensor_table(default_model_path())
    kinds = {t.name: t.kind for t in tensors}
    assert arch == "llama" and kinds["token_embd.weight"] == "Q8_0"
    assert sum(kind == "Q4_1" for kind in kinds.values()) == 210
    quantized = load_model(Settings(weights="auto", model_cache_dir=str(default_model_cache.root)))
    summary = quantized.weights.summary()
    assert summary["int4_layers"] + summary["kept_float_faster"] == 210
    assert set(quantized.weights.source.values()) <= {"gguf"}
    tok = quantized.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.inference_mode():
        out = quantized.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                       do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
