"""A GGUF file's 4-bit weights as they are stored (Q4_0, Q4_1, Q4_K), read without rounding.

transformers dequantizes every GGUF tensor to float when it converts the file (and the
station caches that checkpoint). To keep the 4-bit form we read the blocks themselves:

* Q4_1, 20 bytes per 32 weights: ``d`` (float16), ``m`` (float16), 16 bytes of nibbles
  (weights 0-15 in the low halves, 16-31 in the high): ``w = d * q + m``.
* Q4_0, 18 bytes per 32 weights: ``d``, 16 bytes of nibbles: ``w = d * (q - 8)``.
* Q4_K, 144 bytes per super-block of 256 weights: ``d`` and ``dmin`` (float16), 12 bytes
  holding a 6-bit scale ``sc`` and a 6-bit min ``mn`` for each of 8 groups of 32, then 128
  bytes of nibbles (per 64 weights, 32 bytes: the low halves are the first 32, the high
  halves the next 32): ``w = d * sc * q - dmin * mn``. That is a Q4_1 group with step
  ``d * sc`` and ``m = -(dmin * mn)``, both products float32 as gguf-py forms them.

GGUF names and row orders are transformers' own: the same name map and tensor processor
it used for the conversion (for Llama-family files that un-permutes the rows of Q and K)
are applied to the nibbles and to each group's ``d`` and ``m``, which works because they
only reorder rows. Each weight is then checked against the dense checkpoint: its blocks,
dequantized with the file format's own arithmetic, must give the converted weight bit for
bit, or the weight is not used (it stays float, and the log says which and why).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gnosis_daemon.logs import get_logger
from station.model.gguf_table import read_tensor_table
from station.kernels.quantized import GROUP, Int4Groups

log = get_logger(__name__)

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}  # Q4_K: a super-block of 256 weights


@dataclass(slots=True)
class GgufWeights:
    int4: Mapping[str, Int4Groups]  # the model's parameter name -> its 4-bit groups
    types: dict[str, str]  # the model's parameter name -> the file's tensor type (Q4_1, Q8_0, F32...)
    rejected: dict[str, str]  # name -> why its blocks were not used
    # every tensor of the file, in file order: GGUF name -> (its type, the model's parameter
    # name it became, None where none did)
    tensors: dict[str, tuple[str, str | None]] = field(default_factory=dict)


# The types whose blocks a layer can keep (``weights``): Q4_0/Q4_1/Q4_K as 4-bit groups, Q8_0
# as int8 rows and, for the vocabulary head on a CPU, as its own blocks (cpu_kernels).
KEPT_TYPES = frozenset({*_BLOCK_BYTES, "Q8_0"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def decode_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One tensor's raw rows [rows, bytes] -> (q [rows, cols] uint8, d [rows, groups], m or None).

    Per group of 32 weights: ``d`` its step, ``m`` what ``q = 0`` stands for (Q4_1, Q4_K;
    None for Q4_0), so ``w = d * q + m``.
    """
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, _BLOCK_BYTES[kind])
    if kind == "Q4_K":
        return _decode_q4_k(blocks)
    d = _half(blocks, 0)
    m = _half(blocks, 2) if kind == "Q4_1" else None
    nibbles = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [rows, blocks, 32]
    return q.reshape(rows, -1), d, m


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block [rows, blocks, bytes], as float32 [rows, blocks]."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _decode_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [rows, super-blocks, 144] -> (q, d * sc, -(dmin * mn)) per group of 32.

    The 12 scale bytes hold eight 6-bit scales ``sc`` and eight 6-bit mins ``mn`` (llama.cpp's
    ``get_scale_min_k4``): bytes 0-3 give the low 6 bits of sc[0..3], bytes 4-7 those of
    mn[0..3]; sc[4..7] are the low nibbles of bytes 8-11 with the top 2 bits of bytes 0-3
    above them, mn[4..7] the high nibbles of bytes 8-11 with the top 2 bits of bytes 4-7.
    Both products are float32, as gguf-py forms them; negating the min is exact, so
    ``d * q + m`` is the format's ``d * sc * q - dmin * mn`` bit for bit.
    """
    rows, supers, _ = blocks.shape
    d, dmin = _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]  # [rows, supers, 1]
    packed = blocks[..., 4:16].reshape(rows, supers, 3, 4)
    low, high, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], axis=-1)
    scale = (d * sc.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin * mn.astype(np.float32)).reshape(rows, -1)
    # four chunks of 32 bytes: low nibbles are one group of 32 weights, high nibbles the next
    chunks = blocks[..., 16:].reshape(rows, supers, 4, 1, 32)
    q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=3)  # [rows, supers, 4, 2, 32]
    return q.reshape(rows, -1), scale, minimum


def dequantize_like_gguf(q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """The file format's own arithmetic (as gguf-py and transformers' conversion do it).

    Q4_K's ``d * sc * q - dmin * mn`` arrives here as ``d * q + m`` with ``m`` the negated
    product: IEEE subtraction is addition of the negation, so the bits are the same.
    """
    rows = q.shape[0]
    qb = q.reshape(rows, -1, GROUP)
    if m is None:
        values = d[..., None] * (qb.astype(np.int8) - np.int8(8)).astype(np.float32)
    else:
        values = d[..., None] * qb.astype(np.float32) + m[..., None]
    return values.reshape(rows, -1)


def groups_of(q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> Int4Groups:
    """Torch's (q - 8) * scale + zero form: Q4_0 has zero 0, Q4_1 and Q4_K zero m + 8 d."""
    zero = np.zeros_like(d) if m is None else m + 8 * d
    return Int4Groups(torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)),
                      torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(zero))


def read_gguf_weights(gguf: Path, model: Any) -> GgufWeights:
    """The 4-bit weights of ``gguf`` that match ``model``'s (its dense conversion) exactly."""
    arch, tensors = read_tensor_table(gguf)
    processor = processor_for(arch, model.config)
    params = dict(model.named_parameters())
    names = _gguf_names(arch, model.config, params)
    int4: dict[str, Int4Groups] = {}
    out = GgufWeights(int4, {}, {})
    for tensor in tensors:
        name = names.get(tensor.name)
        out.tensors[tensor.name] = (tensor.kind, name)
        if name is None:
            continue
        out.types[name] = tensor.kind
        if tensor.kind not in _BLOCK_BYTES:
            continue
        try:
            q, d, m = decode_blocks(tensor.rows(), tensor.kind)
            q, d = _rows_as_converted(processor, q, tensor.name), _rows_as_converted(processor, d, tensor.name)
            m = None if m is None else _rows_as_converted(processor, m, tensor.name)
        except Exception as exc:  # noqa: BLE001 - an unexpected layout: this weight stays float
            out.rejected[name] = f"{type(exc).__name__}: {exc}"
            continue
        dense = params[name].detach()
        if tuple(dense.shape) != q.shape:
            out.rejected[name] = f"blocks of shape {q.shape} for a weight of {tuple(dense.shape)}"
            continue
        # a bfloat16/float16 model (CUDA) was converted to its dtype from the same values
        values = torch.from_numpy(dequantize_like_gguf(q, d, m)).to(dense.dtype)
        if not torch.equal(values, dense.cpu()):
            out.rejected[name] = "its blocks do not dequantize to the converted weight"
            continue
        int4[name] = groups_of(q, d, m)
    if out.rejected:
        log.warning("gguf_blocks_not_used", count=len(out.rejected),
                    first=next(iter(out.rejected.items())))
    return out


def processor_for(arch: str, config: Any) -> Any:
    """transformers' tensor processor for ``arch``: the row order its conversion gives."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config={
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None)})


def file_tensors(gguf: Path, model: Any) -> dict[str, tuple[str, str | None]]:
    """Every tensor of ``gguf``: GGUF name -> (its type, the model's parameter name or None)."""
    arch, tensors = read_tensor_table(gguf)
    names = _gguf_names(arch, model.config, dict(model.named_parameters()))
    return {t.name: (t.kind, names.get(t.name)) for t in tensors}


def _gguf_names(arch: str, config: Any, params: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, by gguf-py's own name table."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        return {}
    table = get_tensor_name_map(arch_id, int(config.num_hidden_layers))
    names = {}
    for name in params:
        base, _, suffix = name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = name
    return names


def _rows_as_converted(processor: Any, array: np.ndarray, name: str) -> np.ndarray:
    result = processor.process(weights=array, name=name, tensor_key_mapping={}, parsed_parameters={})
    if result.weights.shape != array.shape:
        raise ValueError(f"the conversion reshapes {name}")
    return np.ascontiguousarray(result.weights)


def read_q8_rows(gguf: Path, model: Any, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Q8_0 blocks of the file's tensor that became ``weight`` (the model's parameter,
    e.g. the vocabulary head tied to the embeddings): (q int8 [N, K], d float32 [N, K // 32]),
    or None when that tensor is not Q8_0 or its blocks do not give ``weight`` bit for bit."""
    arch, tensors = read_tensor_table(gguf)
    params = dict(model.named_parameters())
    names = {p for p, t in model.named_parameters(remove_duplicate=False) if t is weight}
    wanted = {g for g, p in _gguf_names(arch, model.config, params).items() if p in names}
    entry = next((t for t in tensors if t.name in wanted and t.kind == "Q8_0"), None)
    if entry is None:
        return None
    rows = entry.rows()
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows.shape[0], -1)
    q_t, d_t = torch.from_numpy(q.copy()), torch.from_numpy(_half(blocks, 0))
    dense = weight.detach()
    if tuple(dense.shape) != tuple(q_t.shape) or not torch.equal(q8_values(q_t, d_t), dense.cpu().float()):
        log.info("gguf_q8_rows_not_used", tensor=entry.name, reason="they do not give the weight bit for bit")
        return None
    return q_t, d_t


def q8_values(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0's values ``d * q`` (q int8 [N, K], d float32 [N, K // 32]) as float32 [N, K]:
    exact, as the product of an 8-bit integer and a float16 always is in float32."""
    return (q.float().view(q.shape[0], -1, GROUP) * d[..., None]).view(q.shape)
