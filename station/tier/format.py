"""The file format of the KV store (``station.tier.store.store``): one self-verifying file
per KV block or session manifest, the atomic write that puts one on disk, and the reader
that trusts nothing in it.

Every file, integers little-endian::

    magic        8 bytes   BLOCK_MAGIC or SESSION_MAGIC (a block never reads as a session)
    version      u16       FORMAT_VERSION
    header_len   u32
    header       header_len bytes: a JSON object, UTF-8
    payload      header["payload_bytes"] bytes: a block's KV tensor, raw, C order
                           (empty for a session manifest)
    checksum     16 bytes: xxh3-128 (xxhash) of every byte before it

Block header: ``fingerprint``, ``block_size``, ``shape``, ``dtype`` (``str(torch.dtype)``),
``block_hash`` (hex; must equal the file's name), ``token_ids``, ``payload_bytes``.
Session header: ``fingerprint``, ``block_size``, ``session_id``, ``tenant``, ``token_ids``,
``block_hashes`` (hex), ``last_used``, ``saved_at``, ``payload_bytes``; a TTL pin's
``expires_at`` (unix seconds) and ``ttl_s`` too (``station.core.pins``), absent otherwise.

No pickle: the header is JSON and the payload raw bytes reinterpreted as the dtype, so a
file can never run code, whoever wrote it. The payload goes through uint8 views both ways,
so bfloat16 (which numpy lacks) round-trips bit for bit like float16 and float32.

torch is imported only where a payload becomes a tensor or a tensor a payload: the tier's
I/O process (``station.tier.io.worker``) moves raw bytes between the files and the pool's shared
blocks and never imports it (two seconds of a station's start, and its memory, saved).

A reader raises ``Quarantined(reason)`` for any file it cannot trust, ``Missing`` when
the file is not there and ``Unreadable`` when the OS fails the read; nothing else comes
out of it for bad bytes. Reasons: ``magic``, ``version``, ``truncated`` (shorter than its
header says), ``checksum``, ``header`` (malformed or self-contradicting, under a valid
checksum), ``fingerprint``, ``block_size``, ``shape``, ``dtype`` (another model or
layout), ``name`` (not what its name says, or not a file of ours), ``tokens`` (a block
holding other tokens than the caller hashed).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import re
import stat
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TypeGuard

import numpy
import xxhash

from station.core.block_pool import BlockHash
from station.tier.dtype import DTypeName, torch_dtype

if TYPE_CHECKING:
    import torch

BLOCK_MAGIC = b"GNKVBLK\x00"
SESSION_MAGIC = b"GNKVSES\x00"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHI")  # magic, version, header length
CHECKSUM_BYTES = 16
HASH_BYTES = 32  # a sha256 digest: what block_pool.hash_block returns
TMP_SUFFIX = ".tmp"
BLOCK_DIR = re.compile(r"[0-9a-f]{2}")
BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.kvb")
SESSION_NAME = re.compile(r"[0-9a-f]{32}\.kvs")


class KVStoreError(Exception):
    """Base of everything the store raises for what is (or is not) on disk."""


class Missing(KVStoreError):
    """The file is not there: never written, evicted, or quarantined meanwhile."""


class Unreadable(KVStoreError):
    """The OS failed the read (EIO, EACCES...): the file is left where it is."""


class Quarantined(KVStoreError):
    """A file that cannot be trusted; ``reason`` is one short word (see the module doc).

    The store moves the file, intact, to ``quarantine/`` and sets ``moved_to``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.moved_to: Path | None = None


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What every file of one store must agree on."""

    fingerprint: str
    block_size: int
    shape: tuple[int, ...]  # one block's KV, e.g. [L, 2, block_size, H, D]
    dtype: torch.dtype | DTypeName  # compared by name: str(torch.float32) == "torch.float32"

    @property
    def payload_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: str
    tenant: str
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size of them
    block_hashes: tuple[BlockHash, ...]
    last_used: float
    saved_at: float
    expires_at: float | None = None  # a TTL pin's: until when no budget evicts it
    ttl_s: float | None = None

    def wire(self) -> list:
        """The record as the I/O process's ``sessions`` and ``discovered`` messages carry it."""
        return [self.session_id, self.tenant, list(self.token_ids), list(self.block_hashes),
                self.last_used, self.expires_at, self.ttl_s]

    @classmethod
    def from_wire(cls, item: Sequence) -> SessionRecord:
        session_id, tenant, tokens, hashes, last_used, expires_at, ttl_s = item
        return cls(session_id, tenant, tuple(tokens), tuple(hashes), last_used, 0.0, expires_at, ttl_s)


def check_hash(block_hash: bytes) -> None:
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes (a sha256 digest)")


def block_relpath(block_hash: bytes) -> str:
    check_hash(block_hash)
    name = block_hash.hex()
    return f"{name[:2]}/{name}.kvb"  # 256 fan-out dirs: no directory grows huge


def session_name(session_id: str) -> str:
    """The manifest's name: a digest, so file names never reveal session ids."""
    raw = session_id.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()[:32] + ".kvs"


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[int | float]:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_tokens(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(_is_int(t) and t >= 0 for t in value)


# -- writing
def _pack(magic: bytes, header: dict[str, Any], payload: Any) -> list[Any]:
    """The file's pieces in order, checksum last (``payload``: a 1-D uint8 buffer)."""
    payload = memoryview(payload).cast("B")
    header = {**header, "payload_bytes": payload.nbytes}
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    prefix = _PREFIX.pack(magic, FORMAT_VERSION, len(raw))
    digest = xxhash.xxh3_128()
    for piece in (prefix, raw, payload):
        digest.update(piece)
    return [prefix, raw, payload, digest.digest()]


def encode_block(layout: KVLayout, block_hash: BlockHash, token_ids: Sequence[int],
                 tensor: torch.Tensor | numpy.ndarray) -> list[Any]:
    """``tensor``: the block's KV, a CPU tensor of the layout's shape and dtype, or its raw
    bytes as they lie in memory (a uint8 array of ``payload_bytes``)."""
    if isinstance(tensor, numpy.ndarray):
        if tensor.dtype != numpy.uint8 or tensor.size != layout.payload_bytes:
            raise ValueError(f"a block's raw bytes are {layout.payload_bytes} uint8, "
                             f"not {tensor.size} {tensor.dtype}")
        raw = numpy.ascontiguousarray(tensor).reshape(-1)
    else:
        raw = _tensor_bytes(layout, tensor)
    header = {"fingerprint": layout.fingerprint, "block_size": layout.block_size,
              "shape": list(layout.shape), "dtype": str(layout.dtype),
              "block_hash": block_hash.hex(), "token_ids": list(token_ids)}
    return _pack(BLOCK_MAGIC, header, raw)


def _tensor_bytes(layout: KVLayout, tensor: Any) -> numpy.ndarray:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a block is a torch.Tensor, not a {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"a block is written from the CPU, not from {tensor.device}")
    if tuple(tensor.shape) != layout.shape or str(tensor.dtype) != str(layout.dtype):
        raise ValueError(f"a block is {list(layout.shape)} {layout.dtype}, "
                         f"not {list(tensor.shape)} {tensor.dtype}")
    # uint8 view, not numpy's dtype: numpy has no bfloat16.
    return tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy()


def encode_session(layout: KVLayout, record: SessionRecord) -> list[Any]:
    header = {"fingerprint": layout.fingerprint, "block_size": layout.block_size,
              "session_id": record.session_id, "tenant": record.tenant,
              "token_ids": list(record.token_ids),
              "block_hashes": [h.hex() for h in record.block_hashes],
              "last_used": record.last_used, "saved_at": record.saved_at}
    header |= {"expires_at": record.expires_at, "ttl_s": record.ttl_s} if record.ttl_s is not None else {}
    return _pack(SESSION_MAGIC, header, b"")


def write_atomic(path: Path, pieces: Sequence[Any]) -> int:
    """Write ``path`` whole or not at all; returns its size.

    The bytes go to a fresh temp name in the same directory (0600 from birth), are
    fsynced, and only then renamed over ``path``: a reader, or a restart after SIGKILL,
    sees the old file, or none, or the new one complete, never a part of it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    size = 0
    try:
        with os.fdopen(fd, "wb") as fh:
            for piece in pieces:
                size += fh.write(piece)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


def fsync_dir(path: Path) -> None:
    """Make the names created, replaced or removed in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading
def _read_exact(fh: io.RawIOBase, buf: memoryview) -> None:
    pos = 0
    while pos < buf.nbytes:
        n = fh.readinto(buf[pos:])
        if not n:  # shorter than fstat said: it shrank under us
            raise Quarantined("truncated", "the file ended early")
        pos += n


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a header may hold")


def _parse_header(raw: bytes) -> dict[str, Any] | None:
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return header if isinstance(header, dict) else None


def _read_checked(fh: io.RawIOBase, magic: bytes) -> tuple[dict[str, Any], numpy.ndarray, int]:
    info = os.fstat(fh.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise Quarantined("name", "not a regular file")
    size = info.st_size
    if size < _PREFIX.size + CHECKSUM_BYTES:
        raise Quarantined("truncated", f"{size} bytes")
    prefix = bytearray(_PREFIX.size)
    _read_exact(fh, memoryview(prefix))
    got_magic, version, header_len = _PREFIX.unpack(prefix)
    if got_magic != magic:
        raise Quarantined("magic")
    if version != FORMAT_VERSION:
        raise Quarantined("version", f"format {version}; this station reads {FORMAT_VERSION}")
    payload_len = size - _PREFIX.size - header_len - CHECKSUM_BYTES
    if payload_len < 0:
        raise Quarantined("truncated", f"{size} bytes for a {header_len}-byte header")
    raw = bytearray(header_len)
    _read_exact(fh, memoryview(raw))
    # Parsed before the checksum is checked only to tell a cut file from a flipped byte.
    header = _parse_header(bytes(raw))
    declared = header.get("payload_bytes") if header is not None else None
    if _is_int(declared) and payload_len < declared:
        raise Quarantined("truncated", f"{payload_len} payload bytes of {declared}")
    # Read in place: numpy's allocation is aligned for any dtype, and a tensor is a view of it.
    payload = numpy.empty(payload_len, dtype=numpy.uint8)
    _read_exact(fh, payload.data)
    stored = bytearray(CHECKSUM_BYTES)
    _read_exact(fh, memoryview(stored))
    digest = xxhash.xxh3_128()
    for piece in (prefix, raw, payload.data):
        digest.update(piece)
    if digest.digest() != stored:
        raise Quarantined("checksum")
    if header is None:
        raise Quarantined("header", "not a JSON object")
    if declared != payload_len:
        raise Quarantined("header", f"payload_bytes {declared!r}, the file holds {payload_len}")
    return header, payload, size


def _read(path: Path, magic: bytes) -> tuple[dict[str, Any], numpy.ndarray, int]:
    """The verified header, payload (uint8) and file size of ``path``."""
    try:
        # O_NOFOLLOW: a link planted in the store is never followed out of it.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise Missing(path.name) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Quarantined("name", "a symbolic link") from None
        raise Unreadable(f"{path.name}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "rb", buffering=0) as fh:
            return _read_checked(fh, magic)
    except OSError as exc:
        raise Unreadable(f"{path.name}: {exc.strerror or exc}") from None


def _check_layout(header: dict[str, Any], layout: KVLayout) -> None:
    fingerprint, block_size = header.get("fingerprint"), header.get("block_size")
    if not isinstance(fingerprint, str) or not _is_int(block_size):
        raise Quarantined("header", "'fingerprint' or 'block_size' missing or mistyped")
    if fingerprint != layout.fingerprint:
        raise Quarantined("fingerprint", f"{fingerprint[:12]} (here {layout.fingerprint[:12]})")
    if block_size != layout.block_size:
        raise Quarantined("block_size", f"{block_size} (here {layout.block_size})")


def decode_block(path: Path, layout: KVLayout, block_hash: BlockHash, raw: bool = False,
                 ) -> tuple[tuple[int, ...], torch.Tensor | numpy.ndarray, int]:
    """The verified token ids, KV tensor and file size of the block file at ``path``;
    ``raw``: the KV as its bytes (a uint8 array of ``payload_bytes``), torch not needed."""
    header, payload, size = _read(path, BLOCK_MAGIC)
    _check_layout(header, layout)
    shape, dtype = header.get("shape"), header.get("dtype")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise Quarantined("header", "'shape' is not a list of integers")
    if tuple(shape) != layout.shape:
        raise Quarantined("shape", f"{shape} (here {list(layout.shape)})")
    if dtype != str(layout.dtype):
        raise Quarantined("dtype", f"{dtype!r} (here {layout.dtype})")
    if payload.size != layout.payload_bytes:
        raise Quarantined("header", f"{payload.size} payload bytes, the shape needs "
                          f"{layout.payload_bytes}")
    if header.get("block_hash") != block_hash.hex():
        raise Quarantined("name", "its header names another block hash")
    tokens = header.get("token_ids")
    if not _is_tokens(tokens) or len(tokens) != layout.block_size:
        raise Quarantined("header", f"'token_ids' is not {layout.block_size} token ids")
    if raw:
        return tuple(tokens), payload, size
    import torch

    tensor = torch.from_numpy(payload).view(torch_dtype(layout.dtype)).reshape(layout.shape)
    return tuple(tokens), tensor, size


def decode_session(path: Path, layout: KVLayout) -> tuple[SessionRecord, int]:
    """The verified record and file size of the session manifest at ``path``."""
    header, payload, size = _read(path, SESSION_MAGIC)
    _check_layout(header, layout)
    sid, tenant = header.get("session_id"), header.get("tenant")
    tokens, hashes = header.get("token_ids"), header.get("block_hashes")
    last_used, saved_at = header.get("last_used"), header.get("saved_at")
    if not isinstance(sid, str) or not sid or not isinstance(tenant, str):
        raise Quarantined("header", "'session_id' or 'tenant' missing or mistyped")
    if not _is_tokens(tokens):
        raise Quarantined("header", "'token_ids' is not a list of token ids")
    if not isinstance(hashes, list) or not all(
            isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes):
        raise Quarantined("header", "'block_hashes' is not a list of sha256 hex digests")
    if len(tokens) != len(hashes) * layout.block_size:
        raise Quarantined("header", f"{len(tokens)} tokens for {len(hashes)} blocks")
    if not _is_number(last_used) or not _is_number(saved_at):
        raise Quarantined("header", "'last_used' or 'saved_at' is not a finite number")
    expires_at, ttl_s = header.get("expires_at"), header.get("ttl_s")
    if not (expires_at is ttl_s is None or (_is_number(expires_at) and _is_number(ttl_s))):
        raise Quarantined("header", "'expires_at' and 'ttl_s' are not both finite numbers")
    if payload.size:
        raise Quarantined("header", "a session manifest carries no payload")
    if session_name(sid) != path.name:
        raise Quarantined("name", "its header names another session")
    pin = (float(expires_at), float(ttl_s)) if _is_number(expires_at) and _is_number(ttl_s) else ()
    record = SessionRecord(sid, tenant, tuple(tokens),
                           tuple(BlockHash(bytes.fromhex(h)) for h in hashes),
                           float(last_used), float(saved_at), *pin)
    return record, size
