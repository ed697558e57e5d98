"""Files of the KV disk tier (``<state_dir>/kv-tier/<fingerprint[:16]>``, one directory per
model, ``station.tier.store.store``) built and damaged by hand, for the tests of bad,
foreign and crashed tiers.

``write_session_files`` writes one session (its block files, then its manifest) through
``KVStore`` itself, in whatever layout it is given: the tiny model's own (a file the
station accepts), another fingerprint (another model's file), another block size. The
corruption helpers change bytes of a file in place, as a bad disk or a torn copy would.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# The file prefix of kv_store_format: magic (8 bytes), version (u16), header length (u32).
_PREFIX = struct.Struct("<8sHI")


@dataclass(frozen=True)
class Layout:
    """What every file of one tier agrees on (``kv_store_format.KVLayout``'s fields)."""

    fingerprint: str
    block_size: int
    shape: tuple[int, ...]  # one block's KV: [layers, 2, block_size, kv_heads, head_dim]
    dtype: str = "float32"  # a torch dtype's name

    def but(self, **changes) -> Layout:
        """This layout with some fields changed (a block size change also changes the shape)."""
        fields = {**self.__dict__, **changes}
        if "block_size" in changes and "shape" not in changes:
            shape = list(fields["shape"])
            shape[2] = changes["block_size"]
            fields["shape"] = tuple(shape)
        return Layout(**fields)


@dataclass(frozen=True)
class SessionFiles:
    session_id: str
    tenant: str
    token_ids: tuple[int, ...]
    manifest: Path
    blocks: tuple[Path, ...]  # in the session's order


def tier_dir(state_dir: Path, fingerprint: str) -> Path:
    """The disk tier of the model with ``fingerprint`` (hello's ``model.fingerprint``,
    ``model_layout(...).fingerprint``) under a station's state dir (``<runtime_dir>/state``
    by default): the directory ``kv_tier_start.open_tier`` opens, which holds the tier of
    the KV layout that opened it first (``layout.json``; another layout's sits in
    ``layouts/<tag>`` inside it, ``station.tier.store.layouts``)."""
    from station.tier.start import tier_root

    return tier_root(Path(state_dir), fingerprint)


def model_layout(model_dir: Path, block_size: int, fingerprint: str | None = None) -> Layout:
    """The tiny model's layout at ``block_size``, as its station opens the tier. Without
    ``fingerprint`` (hello's ``model.fingerprint``) the model is loaded to compute it."""
    from transformers import AutoConfig

    from station.forward.kv_cache import KVCacheShape

    dtype = "float32"  # the tiny models' dtype on the CPU
    if fingerprint is None:
        from gnosis_daemon.settings import Settings
        from station.model.loader import load_model

        loaded = load_model(Settings(model=str(model_dir),
                                     runtime_dir=str(Path(model_dir).parent / "unused-rt")))
        fingerprint, dtype = loaded.fingerprint, str(loaded.dtype).removeprefix("torch.")
    shape = KVCacheShape.from_config(AutoConfig.from_pretrained(model_dir), block_size, None)
    return Layout(fingerprint, block_size,
                  (shape.num_layers, 2, block_size, shape.num_kv_heads, shape.head_dim), dtype)


def write_session_files(root: Path, layout: Layout, session_id: str, token_ids: Sequence[int],
                        tenant: str = "", tenant_salt: str = "", seed: int = 0,
                        last_used: float = 1.0) -> SessionFiles:
    """Write a session into the tier at ``root``: a block file per full block of
    ``token_ids`` (random KV, named by the chained block hashes the station computes for
    ``tenant``), then its manifest. The files are whole and checksummed: only ``layout``
    decides whether a station accepts them. No station may have ``root`` open meanwhile."""
    import torch

    from station.core.block_pool import block_hashes_for, prefix_extra_keys
    from station.tier.store.store import KVStore
    from station.tier.format import block_relpath, session_name

    bs = layout.block_size
    tokens = [int(t) for t in token_ids][:len(token_ids) // bs * bs]
    extra_keys = prefix_extra_keys(layout.fingerprint, tenant_salt, tenant)
    hashes = block_hashes_for(tokens, bs, extra_keys)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype)
    with KVStore(root, layout.fingerprint, bs, layout.shape, dtype, 1 << 40) as store:
        for i, h in enumerate(hashes):
            store.write_block(h, tokens[i * bs:(i + 1) * bs],
                              torch.randn(layout.shape, generator=gen).to(dtype))
        store.write_session(session_id, tenant, tokens, hashes, last_used)
        store.sync_dirs()
    return SessionFiles(session_id, tenant, tuple(tokens),
                        root / "sessions" / session_name(session_id),
                        tuple(root / "blocks" / block_relpath(h) for h in hashes))


def foreign_manifest(scratch: Path, into: Path, layout: Layout, session_id: str,
                     token_ids: Sequence[int], tenant: str = "") -> Path:
    """A session manifest written by a store of ``layout`` (another model, another block
    size...) in ``scratch``, copied into the tier at ``into``; -> its path there."""
    files = write_session_files(scratch, layout, session_id, token_ids, tenant)
    target = into / "sessions" / files.manifest.name
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copyfile(files.manifest, target)
    target.chmod(0o600)
    return target


def session_files(root: Path, session_id: str) -> SessionFiles:
    """The manifest of ``session_id`` in the tier at ``root`` and the block files it names
    (read from its header, unchecked)."""
    from station.tier.format import block_relpath, session_name

    manifest = root / "sessions" / session_name(session_id)
    header = read_header(manifest)
    assert header["session_id"] == session_id, header
    blocks = tuple(root / "blocks" / block_relpath(bytes.fromhex(h))
                   for h in header["block_hashes"])
    return SessionFiles(session_id, header["tenant"], tuple(header["token_ids"]), manifest, blocks)


def read_header(path: Path) -> dict:
    """A tier file's JSON header, read without any check."""
    data = Path(path).read_bytes()
    _magic, _version, length = _PREFIX.unpack_from(data)
    return json.loads(data[_PREFIX.size:_PREFIX.size + length])


def flip_byte(path: Path, offset: int | None = None, mask: int = 0x40) -> bytes:
    """XOR one byte of ``path`` (default: the middle one, a KV byte of a block file, a
    header byte of a manifest); -> the file's new bytes. The size is unchanged."""
    data = bytearray(Path(path).read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= mask
    Path(path).write_bytes(bytes(data))
    return bytes(data)


def flip_token_digit(path: Path) -> bytes:
    """Change one digit of the first token id in a file's header (still valid JSON: only
    the checksum can tell); -> the file's new bytes."""
    data = Path(path).read_bytes()
    at = data.index(b'"token_ids":[') + len(b'"token_ids":[')
    assert data[at:at + 1].isdigit(), data[at:at + 8]
    return flip_byte(path, at, 0x01)  # '0'<->'1', '2'<->'3', ... '8'<->'9'


def truncate(path: Path, keep: int | None = None) -> bytes:
    """Cut ``path`` to its first ``keep`` bytes (default: half); -> the bytes kept."""
    data = Path(path).read_bytes()
    data = data[:len(data) // 2 if keep is None else keep]
    Path(path).write_bytes(data)
    return data


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes, by relative path."""
    return {str(p.relative_to(path)): p.read_bytes()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}


def quarantined(root: Path) -> dict[str, bytes]:
    """The files in the tier's quarantine/, by their original name (the ``.<UTC time>``
    suffix, and a ``-N`` after it, dropped)."""
    out = {}
    for p in sorted((Path(root) / "quarantine").iterdir()):
        name = p.name.rsplit(".", 1)[0]
        assert name not in out, f"{name} quarantined twice"
        out[name] = p.read_bytes()
    return out
