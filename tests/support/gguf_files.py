"""Tiny synthetic GGUF files of the families users download, in the mixes llama.cpp makes.

``write_gguf(path, family, mix)`` writes a two-layer model of ``family`` (Llama, Mistral,
Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3) the way llama.cpp's converter lays it out: the
architecture's metadata keys, a small tokenizer in ``tokenizer.ggml.*`` form (byte-level BPE,
"gpt2"; Gemma's a sentencepiece vocabulary with byte fallback, "llama", as Gemma files have),
and the tensors under llama.cpp's names (Phi-3's fused ``attn_qkv`` and ``ffn_up``, Gemma's
norms stored as ``1 + w``). Nothing is downloaded: the weights are made here.

``mix`` is a quantization recipe shaped like llama.cpp's ``Q4_K_M`` / ``Q5_K_M``: the default
type for most decoder linears, Q6_K for the output head and for ``attn_v`` / ``ffn_down``
of the first layer (llama.cpp's ``use_more_bits`` layers), Q5_K for Phi-3's fused QKV, and
(in ``Q4_K_M``) Q5_0 and Q8_0 on two of the second layer's tensors, as llama.cpp's fallbacks
and hand-made mixes put them. Norms are F32 (one F16 in ``Q5_K_M``), biases F32. The widths
are multiples of 256, the K-quants' super-block.

gguf-py quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 (``gguf.quants.quantize``) but no K-quant, so
K-quant blocks are made here: random nibbles with sane float16 scales, each group's minimum
centring it. The model a file stands for is whatever its blocks dequantize to
(``gguf.quants.dequantize``, which transformers' conversion calls): that is the ground
truth the tests compare against, not the float weights the blocks were drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
MIXES = ("Q4_K_M", "Q5_K_M")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
SPECIALS = ("<|endoftext|>", "<|begin|>", "<|end|>")  # ids 256, 257, 258: pad, bos, eos
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"))
WINDOW = 64  # the Gemma files' sliding window: tests keep their prompts shorter


@dataclass(frozen=True, slots=True)
class Family:
    arch: str  # general.architecture
    name: str  # general.name (transformers reads a file named "mistral" as Mistral)
    head_dim: int = HIDDEN // HEADS
    tied: bool = False  # no output.weight: the head is the embedding table
    qkv_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False  # post-attention/post-FFN norms, norms stored as 1 + w, window
    fused: bool = False  # Phi-3: attn_qkv and ffn_up (gate and up) in one tensor each
    pre: str = "default"  # tokenizer.ggml.pre
    rope_base: float = 10000.0
    extra: dict = field(default_factory=dict)


SPECS = {
    "llama": Family("llama", "tiny-llama", pre="llama-bpe"),
    "mistral": Family("llama", "mistral"),
    "qwen2": Family("qwen2", "tiny-qwen2", tied=True, qkv_bias=True, pre="qwen2", rope_base=1e6),
    # transformers' GGUF config for qwen3 reads no head_dim: Qwen3Config's 128 applies (as
    # every released Qwen3 has), so the file says 128 too
    "qwen3": Family("qwen3", "tiny-qwen3", head_dim=128, tied=True, qk_norm=True, pre="qwen2",
                    rope_base=1e6),
    "gemma2": Family("gemma2", "tiny-gemma2", tied=True, gemma=True,
                     extra={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": Family("gemma3", "tiny-gemma3", tied=True, qk_norm=True, gemma=True, rope_base=1e6),
    "phi3": Family("phi3", "tiny-phi3", fused=True),
}


def tensor_type(mix: str, role: str, layer: int, tied: bool) -> str:
    """The GGUF type of one tensor in ``mix`` (``role``: embd, output, q, k, v, o, qkv, gate,
    up, down; ``layer`` -1 outside the blocks)."""
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}[mix]
    if role == "output":
        return "Q6_K"
    if role == "embd":
        if not tied:
            return base
        return "Q6_K" if mix == "Q4_K_M" else "Q8_0"  # Q8_0: the head through the file's blocks
    if role in ("v", "down") and layer == 0:
        return "Q6_K"
    if role == "qkv":
        # llama.cpp gives a fused QKV Q5_K (Q4_K_M) / Q6_K (Q5_K_M); layer 0 of Q4_K_M is
        # Q4_K here so that a fused 4-bit tensor's mapping is exercised
        if mix == "Q4_K_M":
            return "Q4_K" if layer == 0 else "Q5_K"
        return "Q6_K" if layer == 0 else "Q5_K"
    if mix == "Q4_K_M" and layer == 1:
        if role == "k":
            return "Q5_0"  # llama.cpp's fallback for a Q4_K tensor whose rows are not 256-wide
        if role == "o":
            return "Q8_0"
    return base


# ---- blocks -------------------------------------------------------------------------------

def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [..., 8] -> llama.cpp's 12 packed bytes [..., 12]."""
    out = np.empty(sc.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return out


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def k_quant_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """Valid ``kind`` (Q4_K, Q5_K, Q6_K) rows [rows, cols / 256 * bytes]: random quants, 6-bit
    scales in 16..63 (Q6_K: signed 8-bit), and each group's min chosen to centre it, with the
    float16 ``d`` set so the values' spread is about ``std``."""
    assert cols % 256 == 0, f"{kind} rows must be a multiple of 256 wide, not {cols}"
    supers = cols // 256
    shape = (rows, supers)
    if kind == "Q6_K":
        ql = rng.integers(0, 256, shape + (128,), dtype=np.uint8)
        qh = rng.integers(0, 256, shape + (64,), dtype=np.uint8)
        scales = (rng.integers(16, 128, shape + (16,)) * rng.choice([-1, 1], shape + (16,))).astype(np.int8)
        d = std / (70 * 18.5) * np.exp(rng.uniform(-0.3, 0.3, shape))
        return np.concatenate([ql, qh, scales.view(np.uint8), _f16_bytes(d)], axis=-1).reshape(rows, -1)
    levels = {"Q4_K": 16, "Q5_K": 32}[kind]
    mid, spread = (levels - 1) / 2, levels / np.sqrt(12)
    sc = rng.integers(16, 64, shape + (8,), dtype=np.uint8)
    d = std / (40 * spread) * np.exp(rng.uniform(-0.3, 0.3, shape))
    ratio = levels // 2  # dmin = d * levels / 2: a group's centring min fits in 6 bits
    mn = np.clip(np.round(mid * sc / ratio), 0, 63).astype(np.uint8)
    head = np.concatenate([_f16_bytes(d), _f16_bytes(d * ratio), _pack_scales(sc, mn)], axis=-1)
    qs = rng.integers(0, 256, shape + (128,), dtype=np.uint8)
    parts = [head, qs] if kind == "Q4_K" else [head, rng.integers(0, 256, shape + (32,), dtype=np.uint8), qs]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def quantized(kind: str, rows: int, cols: int, rng: np.random.Generator, std: float):
    """(the array GGUFWriter.add_tensor takes, its raw_dtype or None) for one [rows, cols] weight."""
    from gguf import GGMLQuantizationType, quants

    if kind in ("F32", "F16"):
        values = rng.standard_normal((rows, cols)).astype(np.float32) * std
        return values.astype(np.float16 if kind == "F16" else np.float32), None
    qtype = GGMLQuantizationType[kind]
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return k_quant_blocks(kind, rows, cols, rng, std), qtype
    values = rng.standard_normal((rows, cols)).astype(np.float32) * std
    return quants.quantize(values, qtype), qtype


# ---- the file -----------------------------------------------------------------------------

def tokens() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary ("gpt2"): (tokens, token types, merges): every byte as
    its byte-level character, three control tokens (ids 256-258), then the merges' products."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    listed = alphabet + list(SPECIALS) + ["".join(m) for m in MERGES]
    types = [1] * 256 + [3] * len(SPECIALS) + [1] * len(MERGES)  # 1 normal, 3 control
    return listed, types, [" ".join(m) for m in MERGES]


SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # Gemma's ids 0-4
SPM_PIECES = ("▁t", "he", "▁the", "in", "▁a", "er", "▁c", "at")


def sentencepiece_tokens() -> tuple[list[str], list[int], list[float]]:
    """A Gemma-style sentencepiece vocabulary ("llama"): (tokens, token types, scores): the
    special tokens, a byte-fallback token per byte, "▁", the printable ASCII characters,
    then a few longer pieces (Gemma files list no merges: transformers derives them from
    the pieces' order)."""
    chars = [chr(c) for c in range(33, 127)]
    listed = list(SPM_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + chars + list(SPM_PIECES)
    types = [3, 3, 3, 2, 3] + [6] * 256 + [1] * (1 + len(chars) + len(SPM_PIECES))  # 2 unknown, 6 byte
    scores = [0.0] * (len(SPM_SPECIALS) + 256) + [-float(i) for i in range(1 + len(chars) + len(SPM_PIECES))]
    return listed, types, scores


def write_gguf(path: str | Path, family: str, mix: str = "Q4_K_M", seed: int = 0,
               name: str | None = None) -> Path:
    """Write a tiny ``family`` model quantized as ``mix`` to ``path``; -> the path. ``name``
    replaces the family's ``general.name`` (the tensors stay the same for the same seed)."""
    from gguf import GGUFWriter

    spec = SPECS[family]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed * 100 + FAMILIES.index(family) * 10 + MIXES.index(mix))
    if spec.gemma:
        listed, types, scores = sentencepiece_tokens()
    else:
        listed, types, merges = tokens()
    vocab = len(listed)
    writer = GGUFWriter(path, spec.arch)
    writer.add_name(spec.name if name is None else name)
    writer.add_file_type({"Q4_K_M": 15, "Q5_K_M": 17}[mix])  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6 if spec.gemma else 1e-5)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(vocab)
    if spec.gemma or spec.qk_norm:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    if spec.gemma:
        writer.add_sliding_window(WINDOW)
    for key, value in spec.extra.items():
        getattr(writer, f"add_{key}")(value)
    if spec.gemma:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(listed)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_pad_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_bos_token_id(2)
        writer.add_unk_token_id(3)
        writer.add_add_bos_token(True)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(spec.pre)
        writer.add_token_list(listed)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_pad_token_id(256)
        writer.add_bos_token_id(257)
        writer.add_eos_token_id(258)
        writer.add_add_bos_token(False)
    writer.add_quantization_version(2)

    def add(name: str, kind: str, rows: int, cols: int, std: float) -> None:
        array, raw = quantized(kind, rows, cols, rng, std)
        writer.add_tensor(name, array, raw_dtype=raw)

    def norm(name: str, width: int, kind: str = "F32", scale: float = 1.0) -> None:
        # Gemma's files hold 1 + w (transformers subtracts the 1); others w itself, near 1
        values = (scale * (1.0 + 0.1 * rng.standard_normal(width))).astype(np.float32)
        writer.add_tensor(name, values.astype(np.float16) if kind == "F16" else values)

    q_rows, kv_rows = HEADS * spec.head_dim, KV_HEADS * spec.head_dim
    # Gemma scales its (tied) embeddings by sqrt(hidden) = 16 on the way in: small ones, layer
    # outputs made larger by the post-norms, and a larger final norm keep a random model from
    # answering every prompt with its last token
    add("token_embd.weight", tensor_type(mix, "embd", -1, spec.tied), vocab, HIDDEN,
        1.0 / 128 if spec.gemma else 1.0)
    for i in range(LAYERS):
        blk = f"blk.{i}"
        norm(f"{blk}.attn_norm.weight", HIDDEN)
        if spec.fused:
            add(f"{blk}.attn_qkv.weight", tensor_type(mix, "qkv", i, spec.tied), q_rows + 2 * kv_rows,
                HIDDEN, 0.12)
        else:
            for role, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                add(f"{blk}.attn_{role}.weight", tensor_type(mix, role, i, spec.tied), rows, HIDDEN, 0.12)
                if spec.qkv_bias:
                    writer.add_tensor(f"{blk}.attn_{role}.bias",
                                      (0.1 * rng.standard_normal(rows)).astype(np.float32))
        if spec.qk_norm:
            norm(f"{blk}.attn_q_norm.weight", spec.head_dim)
            norm(f"{blk}.attn_k_norm.weight", spec.head_dim)
        add(f"{blk}.attn_output.weight", tensor_type(mix, "o", i, spec.tied), HIDDEN, q_rows, 0.12)
        if spec.gemma:
            norm(f"{blk}.post_attention_norm.weight", HIDDEN, scale=3.0)
        norm(f"{blk}.ffn_norm.weight", HIDDEN)
        if spec.fused:
            add(f"{blk}.ffn_up.weight", tensor_type(mix, "up", i, spec.tied), 2 * FFN, HIDDEN, 0.12)
        else:
            add(f"{blk}.ffn_gate.weight", tensor_type(mix, "gate", i, spec.tied), FFN, HIDDEN, 0.12)
            add(f"{blk}.ffn_up.weight", tensor_type(mix, "up", i, spec.tied), FFN, HIDDEN, 0.12)
        add(f"{blk}.ffn_down.weight", tensor_type(mix, "down", i, spec.tied), HIDDEN, FFN, 0.12)
        if spec.gemma:
            norm(f"{blk}.post_ffw_norm.weight", HIDDEN, scale=3.0)
    norm("output_norm.weight", HIDDEN, "F16" if mix == "Q5_K_M" else "F32",
         scale=40.0 if spec.gemma else 1.0)
    if not spec.tied:
        add("output.weight", tensor_type(mix, "output", -1, spec.tied), vocab, HIDDEN, 1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def file_types(path: str | Path) -> dict[str, str]:
    """GGUF tensor name -> its type, as the file says."""
    from station.model.gguf_table import read_tensor_table

    return {t.name: t.kind for t in read_tensor_table(Path(path))[1]}


def reference_model(path: str | Path):
    """transformers' own model of the file (``from_pretrained(gguf_file=...)``), float32, eval.
    The file parsed and gguf's name table built once (``gguf_parsed_once``: memoized, the same
    values): transformers rebuilds that table for every tensor, 6-7 s of a 0.5B file's load."""
    import torch
    from transformers import AutoModelForCausalLM

    from station.model.gguf_convert import gguf_parsed_once

    path = Path(path)
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
    return model.eval()


def reference_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
