"""A GGUF file's tensor table, read lean: names, types, shapes and where each tensor's bytes are.

gguf-py's ``GGUFReader`` builds a numpy view for every element of every metadata array
(a tokenizer's 100k strings), which takes seconds; the station only needs the tensor table
and the architecture, so this walks the header with ``struct`` and maps the data lazily.
Layout (GGUF v2/v3, little-endian): magic, version, tensor count, key/value count, the
key/value pairs, the tensor infos (name, dims, type, offset), then the data, aligned to
``general.alignment`` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
          10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
# (elements per block, bytes per block) for the types whose rows we may read
_BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20),
           "Q4_K": (256, 144), "Q8_0": (32, 34)}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(slots=True)
class TensorEntry:
    name: str
    kind: str  # F32, Q4_1, ... ("type<N>" for one this reader does not name)
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length
    path: Path
    offset: int  # absolute offset of the tensor's bytes in the file

    def rows(self) -> np.ndarray:
        """The raw bytes as [rows, bytes per row] uint8 (a read-only map of the file)."""
        per_block, block_bytes = _BLOCKS[self.kind]
        row_bytes = self.shape[0] // per_block * block_bytes
        rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset,
                         shape=(rows, row_bytes))


class _Short(Exception):
    """The header runs past the bytes read so far."""


def read_tensor_table(path: Path) -> tuple[str, list[TensorEntry]]:
    """-> (general.architecture, the tensors in file order). The header is read a growing
    prefix at a time (1 MiB, then 4 times more), so a load holds no more of it than it is."""
    size, want = path.stat().st_size, 1 << 20
    while True:
        with open(path, "rb") as f:
            data = f.read(min(size, want))
        try:
            return _parse(path, data)
        except (_Short, struct.error):
            if len(data) >= size:
                raise GgufFormatError("the header runs past the end of the file") from None
            want *= 4


def _parse(path: Path, data: bytes) -> tuple[str, list[TensorEntry]]:
    if data[:4] != b"GGUF":
        raise GgufFormatError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise GgufFormatError(f"GGUF version {version} is not supported")
    pos = 24
    meta: dict[str, Any] = {}  # a value's type is its key's
    for _ in range(n_kv):
        key, pos = _string(data, pos)
        (kind,), pos = struct.unpack_from("<I", data, pos), pos + 4
        value, pos = _value(data, pos, kind)
        if key in ("general.architecture", "general.alignment"):
            meta[key] = value
    entries = []
    for _ in range(n_tensors):
        name, pos = _string(data, pos)
        (dims,), pos = struct.unpack_from("<I", data, pos), pos + 4
        shape = struct.unpack_from(f"<{dims}Q", data, pos)
        pos += 8 * dims
        kind, offset = struct.unpack_from("<IQ", data, pos)
        pos += 12
        entries.append((name, _TYPES.get(kind, f"type{kind}"), tuple(shape), offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-pos // align) * align
    arch = str(meta.get("general.architecture", ""))
    return arch, [TensorEntry(n, k, s, path, start + o) for n, k, s, o in entries]


def _string(data: bytes, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, pos)
    end = pos + 8 + length
    if end > len(data):
        raise _Short()
    return data[pos + 8:end].decode("utf-8", "replace"), end


def _value(data: bytes, pos: int, kind: int) -> tuple[object, int]:
    if kind == _STRING:
        return _string(data, pos)
    if kind == _ARRAY:
        elem, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if elem in _SCALARS:  # skipped whole: the station reads no metadata array
            return None, pos + count * struct.calcsize(_SCALARS[elem])
        for _ in range(count):
            _, pos = _value(data, pos, elem)
        return None, pos
    if kind not in _SCALARS:
        raise GgufFormatError(f"unknown metadata type {kind}")
    fmt = _SCALARS[kind]
    return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)
