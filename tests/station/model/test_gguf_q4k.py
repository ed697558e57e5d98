"""GGUF Q4_K weights kept as 4-bit groups (station.model.gguf_groups, gguf_table, weights).

gguf-py has no Q4_K quantizer, so the blocks are random bytes with sane float16 ``d`` and
``dmin``: every 6-bit scale and min and every nibble occurs. The reference is gguf-py's own
dequantizer, which is what transformers' GGUF conversion calls for every tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from station.model.gguf_groups import decode_blocks, dequantize_like_gguf, groups_of, read_gguf_weights
from station.model.gguf_table import read_tensor_table
from station.model.weights import apply_weights, decoder_linears
from tests.support.int4 import check_int4_layer

pytestmark = pytest.mark.usefixtures("few_threads")

Q4_K = GGMLQuantizationType.Q4_K
EPS32 = 2.0 ** -23  # float32's relative step


def q4_k_bytes(rows: int, cols: int, seed: int, d_range=(1e-4, 2e-3), dmin_range=(1e-4, 2e-3)):
    """Random Q4_K rows [rows, cols / 256 * 144]: ``d``/``dmin`` log-uniform in their ranges."""
    rng = np.random.default_rng(seed)
    supers = cols // 256
    raw = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    for start, (lo, hi) in ((0, d_range), (2, dmin_range)):
        values = np.exp(rng.uniform(np.log(lo), np.log(hi), (rows, supers))).astype(np.float16)
        raw[..., start:start + 2] = values.view(np.uint8).reshape(rows, supers, 2)
    return raw.reshape(rows, supers * 144)


# d and dmin of one magnitude (as a quantizer makes them), and four decades apart
@pytest.mark.parametrize("d_range,dmin_range", [((1e-4, 2e-3), (1e-4, 2e-3)),
                                                ((1e-5, 1e-1), (1e-5, 1e-1)),
                                                ((1e-2, 1e-1), (1e-5, 1e-4)),
                                                ((1e-5, 1e-4), (1e-2, 1e-1))])
def test_q4_k_blocks_decode_as_gguf_dequantizes_them(d_range, dmin_range):
    for seed in range(20):
        raw = q4_k_bytes(8, 512, seed, d_range, dmin_range)
        q, d, m = decode_blocks(raw, "Q4_K")
        assert q.shape == (8, 512) and q.dtype == np.uint8 and q.max() <= 15
        assert d.shape == m.shape == (8, 16)  # one step and one min per group of 32
        want = quants.dequantize(raw, Q4_K)
        got = dequantize_like_gguf(q, d, m)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit, signs of 0 too
        # (q - 8) * scale + zero: (q - 8) * scale is exact (a float16 times a 6-bit integer
        # times a 4-bit one fits float32); zero = m + 8 * scale and the final add each round
        # by at most half a step, so each value is within one float32 step of the larger of
        # |zero| and |w|. Measured over 200 seeds: no difference at all when d and dmin are of
        # one magnitude (or d far below dmin), up to 0.9999 of that step (0.998 of the
        # tensor's largest |w|'s) when d is decades above dmin; a value near 0 then differs
        # by many of its own steps, so a relative tolerance would not hold.
        groups = groups_of(q, d, m)
        w = torch.from_numpy(want)
        zero = groups.zero.repeat_interleave(32, dim=1)
        assert torch.all((groups.dequantize() - w).abs() <= EPS32 * torch.maximum(zero.abs(), w.abs()))


def test_q4_k_zero_and_negative_steps_keep_gguf_bits():
    """``d * q + (-(dmin * mn))`` is ``d * q - dmin * mn`` to the sign of a zero."""
    raw = q4_k_bytes(4, 256, seed=11).reshape(4, 144)
    for row, (d, dmin) in enumerate([(0.0, 0.0), (-0.0, 1e-3), (1e-3, -0.0), (-2e-3, -1e-3)]):
        raw[row, 0:4] = np.array([d, dmin], dtype=np.float16).view(np.uint8)
    q, d, m = decode_blocks(raw, "Q4_K")
    want = quants.dequantize(raw, Q4_K)
    assert np.array_equal(dequantize_like_gguf(q, d, m).view(np.uint32), want.view(np.uint32))


def test_an_int4_layer_on_q4_k_groups_computes_its_dequantized_weights():
    check_int4_layer(groups_of(*decode_blocks(q4_k_bytes(64, 512, seed=7), "Q4_K")), seed=8)


def test_a_q4_k_tensor_written_by_gguf_py_reads_back(tmp_path):
    path = tmp_path / "q4k.gguf"
    raw = q4_k_bytes(24, 768, seed=3)
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("norm.weight", np.ones(768, dtype=np.float32))  # moves the Q4_K tensor's offset
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch, tensors = read_tensor_table(path)
    entry = next(t for t in tensors if t.name == "blk.0.ffn_up.weight")
    assert arch == "llama" and entry.kind == "Q4_K" and entry.shape == (768, 24)
    rows = entry.rows()
    assert rows.shape == (24, 3 * 144) and np.array_equal(rows, raw)
    q, d, m = decode_blocks(rows, "Q4_K")
    assert np.array_equal(dequantize_like_gguf(q, d, m), quants.dequantize(raw, Q4_K))


def _tiny_llama_from_q4_k_file(path):
    """A one-layer Llama whose every decoder linear is a Q4_K tensor of ``path``, converted as
    transformers converts a GGUF file: gguf-py's dequantize, then its tensor processor."""
    from gguf import MODEL_ARCH, get_tensor_name_map
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
    model = LlamaForCausalLM(config).eval()
    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": 4, "num_key_value_heads": 2})
    table = get_tensor_name_map(MODEL_ARCH.LLAMA, 1)
    writer = GGUFWriter(path, "llama")
    with torch.no_grad():
        for seed, (name, _, _, layer) in enumerate(decoder_linears(model)):
            gguf_name = f"{table.get_name(name)}.weight"
            rows, cols = layer.weight.shape
            raw = q4_k_bytes(rows, cols, seed)
            writer.add_tensor(gguf_name, raw, raw_dtype=Q4_K)
            dense = processor.process(weights=quants.dequantize(raw, Q4_K), name=gguf_name,
                                      tensor_key_mapping={}, parsed_parameters={}).weights
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(dense)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def test_a_llama_files_q4_k_weights_stay_4_bit(tmp_path):
    """Every Q4_K weight checks out against its conversion bit for bit (Q and K through the
    rows transformers un-permutes), and ``auto`` keeps them as 4-bit groups."""
    path = tmp_path / "tiny-q4k.gguf"
    model = _tiny_llama_from_q4_k_file(path)
    read = read_gguf_weights(path, model)
    assert not read.rejected
    assert len(read.int4) == 7 and set(read.types.values()) == {"Q4_K"}
    params = dict(model.named_parameters())
    for name, groups in read.int4.items():
        assert groups.q.shape == params[name].shape and groups.scale.shape[1] == params[name].shape[1] // 32
    report = apply_weights(model, "auto", torch.device("cpu"), torch.float32, gguf=path)
    assert report.count("int4") + len(report.slower) == 7
    assert set(report.source.values()) <= {"gguf"}
