"""Reading and checking one disk tier (``station.runtime.persist``): its manifest, its ``kv.pt``
and every session entry, all before anything touches the engine's pool.

``read_tier`` raises ``TierRejected`` for anything unreadable, malformed, truncated or
disagreeing with itself, and ``TierForeign`` for a well-formed tier of another format,
model fingerprint, dtype, block size or KV shape; a refused session entry is reported in
``Tier.errors`` while the valid ones are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from station.core.block_pool import block_hashes_for

FORMAT = 1
MANIFEST = "manifest.json"
KV_FILE = "kv.pt"
_MANIFEST_SLACK_BYTES = 64 * 1024 * 1024
_KV_FILE_SLACK_BYTES = 1024 * 1024  # torch.save's zip records and alignment around the data

class TierRejected(Exception):
    """The tier cannot be restored; the message says why (no tenant data in it)."""


class TierForeign(Exception):
    """The tier was written by another model, layout or format; the message says which."""

    def __init__(self, reason: str, fingerprint: str | None) -> None:
        super().__init__(reason)
        self.fingerprint = fingerprint


@dataclass
class Entry:
    session_id: str
    tenant: str
    token_ids: list[int]
    blocks: list[int]  # indices into kv.pt's block dimension


@dataclass
class Tier:
    kv: torch.Tensor  # [L, 2, num_blocks, bs, H, D] on the CPU (memory-mapped)
    entries: list[Entry]  # the valid ones, least recently used first
    errors: list[str]  # one per refused entry


def layout(engine: Any) -> dict[str, Any]:
    kv = engine.kv_cache.kv  # [L, 2, num_blocks, bs, H, D]
    return {"format": FORMAT, "fingerprint": engine.loaded.fingerprint,
            "block_size": engine.block_size, "dtype": str(kv.dtype),
            "kv_shape": [kv.shape[0], kv.shape[1], *kv.shape[3:]]}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _regular_file(path: Path, what: str) -> int:
    """The size of ``path``; rejects a missing file, a link, a directory, a device."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise TierRejected(f"{what} is missing") from None
    except OSError as exc:
        raise TierRejected(f"{what} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise TierRejected(f"{what} is not a regular file")
    return info.st_size


def read_manifest(directory: Path, max_bytes: int) -> dict[str, Any]:
    try:
        info = os.stat(directory)  # a symlinked tier directory is followed
    except OSError as exc:
        raise TierRejected(f"the tier cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise TierRejected("the tier is not a directory")
    size = _regular_file(directory / MANIFEST, MANIFEST)
    if size > max_bytes:
        raise TierRejected(f"{MANIFEST} is {size} bytes, more than the {max_bytes} this "
                           "station's settings can fill")
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except OSError as exc:
        raise TierRejected(f"{MANIFEST} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise TierRejected(f"{MANIFEST} is not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise TierRejected(f"{MANIFEST} is not a JSON object")
    return manifest


def check_layout(manifest: dict[str, Any], here: dict[str, Any]) -> None:
    """Raise ``TierRejected`` for a malformed header, ``TierForeign`` for another layout."""
    fmt = manifest.get("format")
    if not _is_int(fmt):
        raise TierRejected(f"{MANIFEST}: 'format' is missing or not an integer")
    fingerprint = manifest.get("fingerprint")
    fingerprint = fingerprint if isinstance(fingerprint, str) else None
    if fmt != FORMAT:  # a later version's layout: its other fields may mean other things
        raise TierForeign(f"written in tier format {fmt}; this station reads format {FORMAT}",
                           fingerprint)
    types = {"fingerprint": str, "block_size": int, "dtype": str, "kv_shape": list}
    for key, kind in types.items():
        value = manifest.get(key)
        if not isinstance(value, kind) or (kind is int and not _is_int(value)):
            raise TierRejected(f"{MANIFEST}: {key!r} is missing or not a {kind.__name__}")
    shape = manifest["kv_shape"]
    if len(shape) != 5 or not all(_is_int(d) and d > 0 for d in shape):
        raise TierRejected(f"{MANIFEST}: 'kv_shape' is not 5 positive integers")
    differ = []
    for key in ("fingerprint", "dtype", "block_size", "kv_shape"):
        if manifest[key] != here[key]:
            theirs, ours = manifest[key], here[key]
            if key == "fingerprint":
                theirs, ours = theirs[:12], ours[:12]
            differ.append(f"{key} {theirs} (here {ours})")
    if differ:
        raise TierForeign("written by another model or KV layout: " + ", ".join(differ),
                           fingerprint)


def _load_kv(directory: Path, manifest: dict[str, Any], here: dict[str, Any],
             bytes_per_block: int) -> torch.Tensor:
    num_blocks = manifest.get("num_blocks")
    if num_blocks is not None and not (_is_int(num_blocks) and num_blocks >= 0):
        raise TierRejected(f"{MANIFEST}: 'num_blocks' is not a non-negative integer")
    digest = manifest.get("kv_sha256")
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise TierRejected(f"{MANIFEST}: 'kv_sha256' is not a sha256 hex digest")
    path = directory / KV_FILE
    size = _regular_file(path, KV_FILE)
    if num_blocks is not None and size > num_blocks * bytes_per_block + _KV_FILE_SLACK_BYTES:
        raise TierRejected(f"{KV_FILE} is {size} bytes, too large for {num_blocks} blocks")
    try:
        if digest is not None:
            with open(path, "rb") as fh:
                actual = hashlib.file_digest(fh, "sha256").hexdigest()
            if actual != digest:
                raise TierRejected(f"{KV_FILE} does not match the manifest's sha256 "
                                   "(truncated or changed after it was written)")
        # weights_only: a tier file can never run code; mmap: only the blocks restored are read.
        kv = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except TierRejected:
        raise
    except Exception as exc:  # torch raises many types for a torn or foreign file
        raise TierRejected(f"{KV_FILE} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not isinstance(kv, torch.Tensor):
        raise TierRejected(f"{KV_FILE} holds a {type(kv).__name__}, not a tensor")
    if str(kv.dtype) != here["dtype"]:
        raise TierRejected(f"{KV_FILE} holds {kv.dtype}, the manifest says {here['dtype']}")
    shape = list(kv.shape)
    if num_blocks is None and len(shape) == 6:  # a tier written before 'num_blocks' existed
        num_blocks = shape[2]
    num_layers, two, *per_block = here["kv_shape"]
    expected = [num_layers, two, num_blocks, *per_block]
    if shape != expected:
        raise TierRejected(f"{KV_FILE} has shape {shape}, the manifest needs {expected}")
    return kv


def _entry_error(item: Any, num_blocks: int, block_size: int, vocab_size: int) -> str | None:
    """Why one session entry cannot be restored (never its id or tokens), or None."""
    if not isinstance(item, dict):
        return "not an object"
    session_id, tenant = item.get("session_id"), item.get("tenant")
    tokens, blocks = item.get("token_ids"), item.get("blocks")
    if not isinstance(session_id, str) or not session_id:
        return "'session_id' is not a non-empty string"
    if not isinstance(tenant, str):
        return "'tenant' is not a string"
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in tokens):
        return f"'token_ids' is not a list of token ids in [0, {vocab_size})"
    if not isinstance(blocks, list) or not all(_is_int(b) for b in blocks):
        return "'blocks' is not a list of integers"
    for b in blocks:
        if not 0 <= b < num_blocks:
            return f"block index {b} outside [0, {num_blocks})"
    if len(tokens) != len(blocks) * block_size:
        return f"{len(tokens)} tokens for {len(blocks)} blocks of {block_size}"
    return None


def _check_entries(raw: list[Any], num_blocks: int, block_size: int, vocab_size: int,
                   ) -> tuple[list[Entry], list[str]]:
    """The valid session entries, and one reason per refused one."""
    entries: list[Entry] = []
    errors: list[str] = []
    seen: set[str] = set()
    # The prefix each block holds, claimed by the first entry that uses it: a block's KV
    # depends on every token before it, so two entries may share a block only when they
    # agree on the whole prefix up to its end.
    claimed: dict[int, bytes] = {}
    for n, item in enumerate(raw):
        error = _entry_error(item, num_blocks, block_size, vocab_size)
        if error is None and item["session_id"] in seen:
            error = "'session_id' repeats an earlier entry's"
        if error is None:
            prefixes = block_hashes_for(item["token_ids"], block_size, ())
            if any(claimed.get(b, p) != p for b, p in zip(item["blocks"], prefixes)):
                error = "a block it shares with an earlier entry holds another prefix"
        if error is not None:
            errors.append(f"session entry {n}: {error}")
            continue
        claimed.update(zip(item["blocks"], prefixes))
        seen.add(item["session_id"])
        entries.append(Entry(item["session_id"], item["tenant"], item["token_ids"], item["blocks"]))
    return entries, errors


def max_manifest_bytes(engine: Any) -> int:
    """The largest manifest these settings can write (a token id takes at most 8 bytes)."""
    return (_MANIFEST_SLACK_BYTES
            + engine.settings.kv_session_budget * engine.max_model_len * 8)


def read_tier(engine: Any, directory: Path) -> Tier:
    here = layout(engine)
    manifest = read_manifest(directory, max_manifest_bytes(engine))
    check_layout(manifest, here)
    if not isinstance(manifest.get("sessions"), list):
        raise TierRejected(f"{MANIFEST}: 'sessions' is missing or not a list")
    bytes_per_block = engine.kv_cache.shape.bytes_per_block
    kv = _load_kv(directory, manifest, here, bytes_per_block)
    entries, errors = _check_entries(manifest["sessions"], kv.shape[2], engine.block_size,
                                     engine.loaded.vocab_size)
    return Tier(kv, entries, errors)
