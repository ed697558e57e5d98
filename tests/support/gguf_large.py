"""A ~0.5B-parameter Llama-shaped GGUF file, Q4_0 or Q8_0 throughout, made in seconds.

Its blocks are random bytes with a fixed float16 step, so nothing is quantized (gguf-py's
quantizers would take minutes over half a billion weights): each value is ``d * (q - 8)``
(Q4_0) or ``d * q`` (Q8_0) for uniform ``q``, about N(0, std) for the ``d`` chosen here.
The model the file stands for is what its blocks dequantize to, as in ``gguf_files``.

So that greedy decoding has clear margins (a random model's top two logits are often a
hair apart, and bfloat16 activations in the 4-bit kernels would flip them), the head is the
embedding table shifted by one row: the logit of token ``j`` is the final state times the
embedding of ``j - 1``, which the residual stream carries, so the model's answer to a token
``t`` leans to ``t + 1``. The decoder's layers add to that stream about half as much again,
so they move every logit, and a wrong layer shows in the per-layer checks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.support.gguf_files import tokens

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 1024, 4864, 28, 16, 4, 4096
# value std per step: Q4_0's q - 8 over 0..15 has std 4.61, Q8_0's q over -128..127 has 73.9
_STD_PER_D = {"Q4_0": 4.61, "Q8_0": 73.9}
_BLOCK = {"Q4_0": 18, "Q8_0": 34}  # bytes per 32 weights


def parameters() -> int:
    per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * (HIDDEN // HEADS) + 3 * HIDDEN * FFN
    return LAYERS * per_layer + 2 * VOCAB * HIDDEN


def decoder_linears() -> int:
    return 7 * LAYERS


def _blocks(kind: str, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random ``kind`` rows [rows, cols / 32 * block bytes] with one step ``d`` for ``std``."""
    size = _BLOCK[kind]
    raw = np.frombuffer(rng.bytes(rows * (cols // 32) * size), dtype=np.uint8).reshape(rows, cols // 32, size).copy()
    d = np.float16(std / _STD_PER_D[kind])
    raw[..., 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def write_llama(path: str | Path, kind: str, seed: int = 0) -> Path:
    """Write the model in ``kind`` (Q4_0 or Q8_0) to ``path``; -> the path."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = Path(path)
    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(seed)
    listed, types, merges = tokens()
    filler = VOCAB - len(listed)
    listed, types = listed + [f"<x{i}>" for i in range(filler)], types + [1] * filler
    writer = GGUFWriter(path, "llama")
    writer.add_name("large-llama")
    writer.add_file_type({"Q4_0": 2, "Q8_0": 7}[kind])  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(listed)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_pad_token_id(256)
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_add_bos_token(False)
    writer.add_quantization_version(2)

    def add(name: str, rows: int, cols: int, std: float) -> np.ndarray:
        raw = _blocks(kind, rows, cols, std, rng)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        return raw

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    embeddings = add("token_embd.weight", VOCAB, HIDDEN, 1.0)
    kv_rows = KV_HEADS * (HIDDEN // HEADS)
    for i in range(LAYERS):
        blk = f"blk.{i}"
        norm(f"{blk}.attn_norm.weight")
        for role, rows in (("q", HIDDEN), ("k", kv_rows), ("v", kv_rows), ("output", HIDDEN)):
            add(f"{blk}.attn_{role}.weight", rows, HIDDEN, 0.01)
        norm(f"{blk}.ffn_norm.weight")
        add(f"{blk}.ffn_gate.weight", FFN, HIDDEN, 0.01)
        add(f"{blk}.ffn_up.weight", FFN, HIDDEN, 0.01)
        add(f"{blk}.ffn_down.weight", HIDDEN, FFN, 0.01)
    norm("output_norm.weight")
    writer.add_tensor("output.weight", np.roll(embeddings, 1, axis=0), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
