"""Load a GGUF file's model without a float copy of it: weights go from the file's blocks
straight into the form the station keeps them in.

The other path (``loader._convert_gguf``) has transformers dequantize the whole file into a
float32 checkpoint in the model cache, 4 bytes a parameter on disk and in memory before the
4-bit weights are kept again: a 4.4 GB 7B file would need ~29 GB. Here the model is built
empty (parameters on the meta device, buffers real) from the file's config, then:

* what must be float (embeddings, norms, biases, the vocabulary head) is dequantized one
  tensor at a time with gguf-py's arithmetic and transformers' row order (its conversion's
  own steps, so the values are the same bit for bit);
* the decoder's linear weights stay empty: ``weights.apply_weights`` reads each one's 4-bit
  groups from a map of the file (``GgufWeights.int4`` is lazy here: one layer at a time),
  or fills one layer's float values where it needs them (int8 rows of a Q8_0 tensor, a
  type with no kept form) and empties it again once its quantized form is built; what it
  leaves float is filled at the end (``fill_rest``).

The model cache holds the config and the tokenizer, converted once (small), and an untied
embedding table's float32 values, which the model maps (``fill_mapped``: a step reads a few
rows, so only those are resident), so a second start maps the file again and converts
nothing. Families whose conversion only reorders rows (``MAPPED_ARCHS``) are read this way;
the others are converted.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gnosis_daemon.logs import get_logger
from station.model.errors import ModelLoadError
from station.model.gguf_groups import (
    _BLOCK_BYTES,
    GgufWeights,
    _gguf_names,
    _rows_as_converted,
    decode_blocks,
    groups_of,
    processor_for,
)
from station.model.gguf_table import TensorEntry, read_tensor_table
from station.kernels.quantized import Int4Groups

log = get_logger(__name__)

GGUF_LOADS = ("auto", "convert", "map")
# gguf-py architectures whose conversion by transformers only reorders rows (Llama's Q and K)
MAPPED_ARCHS = frozenset({"llama", "qwen2", "qwen3"})
# auto maps a file whose float32 copy would be larger than this, and converts a smaller one
MAP_ABOVE_BYTES = 1 << 30


def wants_map(gguf: Path, mode: str, weights: str) -> bool:
    """Whether ``gguf`` is read by mapping (``gguf_load``: auto, convert or map)."""
    if mode == "convert":
        return False
    arch, tensors = read_tensor_table(gguf)
    if mode == "map":
        if arch not in MAPPED_ARCHS:
            raise ModelLoadError(f"gguf_load=map reads {', '.join(sorted(MAPPED_ARCHS))} files, "
                                 f"not {arch!r}; set gguf_load=convert")
        return True
    float_bytes = sum(4 * int(np.prod(t.shape)) for t in tensors)
    return arch in MAPPED_ARCHS and weights != "float" and float_bytes > MAP_ABOVE_BYTES


@dataclass(slots=True)
class MappedFile:
    """The file behind an empty model: fills its parameters from the file's tensors."""

    path: Path
    entries: dict[str, TensorEntry]  # the model's parameter name -> the file's tensor
    processor: Any  # transformers' TensorProcessor for the file's architecture (row order)
    weights: GgufWeights  # the decoder's 4-bit weights, read a layer at a time
    device: torch.device
    dtype: torch.dtype

    def fill(self, model: nn.Module, name: str) -> None:
        """Dequantize the file's tensor for parameter ``name`` into the model."""
        entry = self.entries.get(name)
        if entry is None:
            raise ModelLoadError(f"the GGUF file {str(self.path)!r} has no tensor for {name}")
        shape = model.get_parameter(name).shape
        trim_heap()  # the last layer's temporaries: keep the load's peak near what is kept
        values = torch.from_numpy(dense_values(entry, self.processor))
        if values.numel() != shape.numel():
            raise ModelLoadError(f"the GGUF tensor {entry.name} has {values.numel()} values, "
                                 f"{name} takes {shape.numel()}")
        _set(model, name, values.reshape(shape).to(self.device, self.dtype))

    def fill_mapped(self, model: nn.Module, name: str, values_file: Path) -> None:
        """``fill``'s values for ``name``, kept as ``values_file`` (float32, written once,
        atomically) and mapped copy-on-write: only the pages a forward reads are resident.
        For an untied embedding table, whose rows a step reads a few at a time: ~500 MB of
        a 7B model's memory that ``fill`` would hold whole."""
        entry = self.entries.get(name)
        if entry is None:
            raise ModelLoadError(f"the GGUF file {str(self.path)!r} has no tensor for {name}")
        shape = tuple(model.get_parameter(name).shape)
        nbytes = 4 * int(np.prod(shape))
        if not values_file.is_file() or values_file.stat().st_size != nbytes:
            values = dense_values(entry, self.processor)
            if values.size * 4 != nbytes:
                raise ModelLoadError(f"the GGUF tensor {entry.name} has {values.size} values, "
                                     f"{name} takes {nbytes // 4}")
            try:
                _write_atomically(values_file, np.ascontiguousarray(values, dtype=np.float32))
            except OSError as exc:  # a read-only or full cache: held in memory, as ``fill`` does
                log.warning("gguf_values_not_cached", name=name, file=str(values_file), error=str(exc))
                _set(model, name, torch.from_numpy(values.reshape(shape)))
                return
            del values
            trim_heap()
        _set(model, name, torch.from_numpy(np.memmap(values_file, dtype=np.float32, mode="c", shape=shape)))

    def empty(self, model: nn.Module, name: str) -> None:
        """Drop parameter ``name``'s values again (its quantized form holds them now)."""
        _set(model, name, torch.empty(model.get_parameter(name).shape, device="meta", dtype=self.dtype))

    @contextmanager
    def placeholders(self, model: nn.Module) -> Iterator[None]:
        """Within this, every empty parameter reads as zeros (one value, broadcast: no
        memory), so the model's own forward runs (``read_attention_kinds``' trace)."""
        empty = [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
        for name in empty:
            shape = model.get_parameter(name).shape
            _set(model, name, torch.zeros((), device=self.device, dtype=self.dtype).expand(shape))
        try:
            yield
        finally:
            for name in empty:
                self.empty(model, name)
            trim_heap()  # the forward's temporaries

    def fill_rest(self, model: nn.Module) -> None:
        """Fill every parameter still empty (what ``weights`` leaves float)."""
        for name, param in list(model.named_parameters()):
            if param.is_meta:
                self.fill(model, name)
        trim_heap()


class _FileGroups(Mapping[str, Int4Groups]):
    """The 4-bit groups of the file's Q4_0/Q4_1/Q4_K tensors, decoded when asked for."""

    def __init__(self, entries: dict[str, TensorEntry], processor: Any) -> None:
        self._entries = entries
        self._processor = processor

    def __getitem__(self, name: str) -> Int4Groups:
        entry = self._entries[name]
        trim_heap()  # the last layer's temporaries: keep the load's peak near what is kept
        q, d, m = _decoded(entry)
        q, d = _rows_as_converted(self._processor, q, entry.name), _rows_as_converted(self._processor, d, entry.name)
        m = None if m is None else _rows_as_converted(self._processor, m, entry.name)
        return groups_of(q, d, m)

    def __contains__(self, name: object) -> bool:  # without decoding (Mapping's would)
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _decoded(entry: TensorEntry) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``decode_blocks`` over a tensor's rows a block of ~4 MB at a time, into one array:
    its temporaries stay a block's, not the tensor's."""
    rows = entry.rows()
    step = max(1, (4 << 20) // rows.shape[1])
    parts = [decode_blocks(rows[at:at + step], entry.kind) for at in range(0, min(step, rows.shape[0]), step)]
    q = np.empty((rows.shape[0], parts[0][0].shape[1]), dtype=np.uint8)
    d = np.empty((rows.shape[0], parts[0][1].shape[1]), dtype=np.float32)
    m = None if parts[0][2] is None else np.empty_like(d)
    for at in range(0, rows.shape[0], step):
        bq, bd, bm = parts.pop() if at == 0 else decode_blocks(rows[at:at + step], entry.kind)
        q[at:at + step], d[at:at + step] = bq, bd
        if m is not None and bm is not None:
            m[at:at + step] = bm
    return q, d, m


def load_mapped(gguf: Path, cache: Path, device: torch.device,
                dtype: torch.dtype) -> tuple[Any, Any, MappedFile]:
    """-> (the model with everything but its decoder linears' weights filled, the tokenizer,
    the file that fills the rest); ``cache``: where the config and tokenizer are kept."""
    from accelerate import init_empty_weights  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM

    from station.model.weights import decoder_linears

    config, tokenizer = _config_and_tokenizer(gguf, cache)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    decoder_weights = {f"{name}.weight" for name, _, _, _ in decoder_linears(model)}
    for module in model.modules():  # buffers (rotary frequencies) are real: move them
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(device)
    arch, tensors = read_tensor_table(gguf)
    processor = processor_for(arch, model.config)
    params = dict(model.named_parameters())
    names = _gguf_names(arch, model.config, params)
    entries = {names[t.name]: t for t in tensors if t.name in names}
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    groups: dict[str, TensorEntry] = {}
    out = GgufWeights(_FileGroups(groups, processor), {}, {})
    for tensor in tensors:
        name = names.get(tensor.name)
        out.tensors[tensor.name] = (tensor.kind, name)
        if name is None:
            continue
        out.types[name] = tensor.kind
        if name in decoder_weights and tensor.kind in _BLOCK_BYTES:
            if tuple(reversed(tensor.shape)) == shapes[name]:
                groups[name] = tensor
            else:
                out.rejected[name] = f"blocks of shape {tuple(reversed(tensor.shape))} for a weight of {shapes[name]}"
    mapped = MappedFile(gguf, entries, processor, out, device, dtype)
    head = model.get_output_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and head is not None
    # a tied head is the embeddings' weight (which it may already share): filled with them
    skip = decoder_weights | ({f"{n}.weight" for n, m in model.named_modules() if m is head} if tied else set())
    embed_weight = model.get_input_embeddings().weight
    embed = next(n for n, p in model.named_parameters() if p is embed_weight)
    for name, _ in list(model.named_parameters(remove_duplicate=False)):
        if name == embed and not tied and device.type == "cpu" and dtype == torch.float32:
            mapped.fill_mapped(model, name, cache / "embeddings.f32")  # a forward reads a few rows
        elif name not in skip:
            mapped.fill(model, name)
    if tied:
        head.weight = model.get_input_embeddings().weight
    trim_heap()
    log.info("gguf_mapped", gguf=str(gguf), tensors=len(tensors), decoder_weights=len(decoder_weights),
             cache=str(cache))
    return model, tokenizer, mapped


def dense_values(entry: TensorEntry, processor: Any) -> np.ndarray:
    """One tensor as float32 [rows, cols], as transformers' conversion makes it: gguf-py's
    dequantization, then the architecture's row order; owned memory, never the file's map."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    try:
        qtype = (GGMLQuantizationType(int(entry.kind[4:])) if entry.kind.startswith("type")
                 else GGMLQuantizationType[entry.kind])
        per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"GGUF tensor {entry.name} has a type gguf-py does not know: {entry.kind}") from exc
    rows = int(np.prod(entry.shape[1:])) if len(entry.shape) > 1 else 1
    raw = np.memmap(entry.path, dtype=np.uint8, mode="r", offset=entry.offset,
                    shape=(rows, entry.shape[0] // per_block * block_bytes))
    try:
        values = np.asarray(quants.dequantize(raw, qtype), dtype=np.float32)
    except NotImplementedError as exc:
        raise ModelLoadError(f"GGUF tensor {entry.name}: {exc}") from exc
    if np.may_share_memory(values, raw):
        values = values.copy()
    # gguf-py's shape for it (a norm or bias is 1-D), which the row order is written for
    values = _rows_as_converted(processor, values.reshape(tuple(reversed(entry.shape))), entry.name)
    return values if values.flags.writeable else values.copy()


def _write_atomically(path: Path, values: np.ndarray) -> None:
    """``values``' bytes as ``path``, whole or not at all (a temp file, then a rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(values.data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _set(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))


def _config_and_tokenizer(gguf: Path, cache: Path) -> tuple[Any, Any]:
    """The file's config and tokenizer: converted once, then read from ``cache``."""
    from transformers import AutoConfig, AutoTokenizer

    from station.model.gguf_convert import gguf_parsed_once

    if (cache / "config.json").is_file():
        log.info("gguf_cache_hit", gguf=str(gguf), cache=str(cache))
        return AutoConfig.from_pretrained(cache), AutoTokenizer.from_pretrained(cache)
    try:
        with gguf_parsed_once():
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, ImportError, NotImplementedError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {str(gguf)!r}: {exc}") from exc
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "gnosis-source.json").write_text(json.dumps({"gguf": str(gguf), "weights": "mapped"}))
        try:
            os.rename(tmp, cache)
        except OSError:
            if not (cache / "config.json").is_file():  # another station wrote it first: as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # read back, so a first start serves what every later one reads
    return AutoConfig.from_pretrained(cache), AutoTokenizer.from_pretrained(cache)


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def trim_heap() -> None:
    """Ask glibc to give the heap freed so far back to the system (nothing elsewhere)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
