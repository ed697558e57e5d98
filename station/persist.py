"""The KV-session disk tier: sessions are written when the station stops and restored
when it starts, so liquid memory survives a station restart (an upgrade, a crash-free
redeploy, ``gnosis-daemon restart station``).

Layout: ``<state_dir>/kv-sessions/manifest.json`` (the layout, ``num_blocks``, the sha256
of ``kv.pt``, and the sessions: id, tenant, tokens, block refs) and ``kv.pt`` (the
sessions' distinct blocks, ``[L, 2, num_blocks, block_size, kv_heads, head_dim]``). The
directory is created 0700 and both files 0600 from birth: they hold every tenant's prompt
tokens. A tier is written into a temporary directory and swapped in by rename, so a crash
mid-write leaves the previous tier whole.

Nothing on disk can stop the station. At start the whole tier is validated before the pool
is touched (``_read_tier``); what it finds decides:

* no tier: nothing restored;
* a tier whose manifest is well formed but names another format, model fingerprint,
  dtype, block size or KV shape is **foreign**: left where it is, untouched and unread
  past its manifest (loading KV of another model would silently corrupt outputs), and
  reported;
* a tier that cannot be read, or whose manifest or ``kv.pt`` is malformed, truncated or
  disagrees with itself, is **rejected**: renamed, intact, to
  ``kv-sessions.rejected-<UTC time>`` beside it (``-1``, ``-2``... if that name is taken),
  and nothing of it is restored;
* a tier of ours in which only some session entries are bad: the good entries are
  restored, and the tier is still renamed aside as rejected, intact (the restored
  sessions are written again at the next clean stop).

At a clean stop the sessions are written over the tier only when the tier there is ours
(same layout, or none). Any other tier found there (a foreign one, or one that appeared
unreadable) is first renamed, intact, to ``kv-sessions.foreign-<fingerprint prefix>-<UTC
time>`` (``kv-sessions.rejected-<UTC time>`` when it has no readable fingerprint); with no
session to write, such a tier is left in place, and only a tier of ours is removed (its
sessions all expired or were deleted, and must not come back).

Both functions run while the engine thread is stopped (before ``run_here``, after
``shutdown``), so they touch the pool and the registry without locks. A SIGKILLed station
writes nothing: its sessions are lost, and the last clean stop's tier (if any) is what the
next start restores.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gnosis_daemon.logs import get_logger
from station.core.block_pool import block_hashes_for

log = get_logger()

FORMAT = 1
MANIFEST = "manifest.json"
KV_FILE = "kv.pt"
_REASON_CHARS = 300  # reasons go into hello/health and the status file: keep them short
_ENTRY_ERRORS_SHOWN = 3
_MANIFEST_SLACK_BYTES = 64 * 1024 * 1024
_KV_FILE_SLACK_BYTES = 1024 * 1024  # torch.save's zip records and alignment around the data


class _TierRejected(Exception):
    """The tier cannot be restored; the message says why (no tenant data in it)."""


class _TierForeign(Exception):
    """The tier was written by another model, layout or format; the message says which."""

    def __init__(self, reason: str, fingerprint: str | None) -> None:
        super().__init__(reason)
        self.fingerprint = fingerprint


@dataclass
class TierReport:
    """What the start found in the disk tier: ``hello``/``health`` publish ``as_dict()``."""

    path: str
    enabled: bool = True
    restored_sessions: int = 0
    restored_blocks: int = 0
    skipped_sessions: int = 0  # valid, but past the session budget or the pool
    bad_sessions: int = 0  # session entries refused (their tier is rejected)
    rejections: list[dict[str, str]] = field(default_factory=list)  # {"path", "reason"}
    foreign: dict[str, str] | None = None  # {"path", "reason"}: left in place
    rejected_on_disk: int = 0  # kv-sessions.rejected-* beside the tier, this start's included
    foreign_on_disk: int = 0  # kv-sessions.foreign-* beside the tier

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "enabled": self.enabled,
                "restored_sessions": self.restored_sessions,
                "restored_blocks": self.restored_blocks,
                "skipped_sessions": self.skipped_sessions, "bad_sessions": self.bad_sessions,
                "rejected": len(self.rejections),
                "rejections": [dict(r) for r in self.rejections],
                "foreign": dict(self.foreign) if self.foreign else None,
                "rejected_on_disk": self.rejected_on_disk,
                "foreign_on_disk": self.foreign_on_disk}


@dataclass
class _Entry:
    session_id: str
    tenant: str
    token_ids: list[int]
    blocks: list[int]  # indices into kv.pt's block dimension


@dataclass
class _Tier:
    kv: torch.Tensor  # [L, 2, num_blocks, bs, H, D] on the CPU (memory-mapped)
    entries: list[_Entry]  # the valid ones, least recently used first
    errors: list[str]  # one per refused entry


def _layout(engine: Any) -> dict[str, Any]:
    kv = engine.kv_cache.kv  # [L, 2, num_blocks, bs, H, D]
    return {"format": FORMAT, "fingerprint": engine.loaded.fingerprint,
            "block_size": engine.block_size, "dtype": str(kv.dtype),
            "kv_shape": [kv.shape[0], kv.shape[1], *kv.shape[3:]]}


def _short(reason: str) -> str:
    return reason if len(reason) <= _REASON_CHARS else reason[:_REASON_CHARS - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _aside_path(directory: Path, kind: str) -> Path:
    """A free name beside ``directory``: ``<name>.<kind>-<UTC time>``, ``-1``... if taken."""
    base = f"{directory.name}.{kind}-{_utc_stamp()}"
    candidate, n = directory.with_name(base), 0
    # os.rename replaces an empty directory of the target name: never pick an existing one.
    while os.path.lexists(candidate):
        n += 1
        candidate = directory.with_name(f"{base}-{n}")
    return candidate


def _move_aside(directory: Path, kind: str) -> Path:
    target = _aside_path(directory, kind)
    os.rename(directory, target)  # a rename: the bytes, modes and times stay as they were
    return target


def _count_aside(directory: Path) -> tuple[int, int]:
    try:
        names = os.listdir(directory.parent)
    except OSError:
        return 0, 0
    rejected = sum(n.startswith(f"{directory.name}.rejected-") for n in names)
    foreign = sum(n.startswith(f"{directory.name}.foreign-") for n in names)
    return rejected, foreign


# -- reading and validating (nothing here touches the engine's pool)
def _regular_file(path: Path, what: str) -> int:
    """The size of ``path``; rejects a missing file, a link, a directory, a device."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise _TierRejected(f"{what} is missing") from None
    except OSError as exc:
        raise _TierRejected(f"{what} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise _TierRejected(f"{what} is not a regular file")
    return info.st_size


def _read_manifest(directory: Path, max_bytes: int) -> dict[str, Any]:
    try:
        info = os.stat(directory)  # a symlinked tier directory is followed
    except OSError as exc:
        raise _TierRejected(f"the tier cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise _TierRejected("the tier is not a directory")
    size = _regular_file(directory / MANIFEST, MANIFEST)
    if size > max_bytes:
        raise _TierRejected(f"{MANIFEST} is {size} bytes, more than the {max_bytes} this "
                           "station's settings can fill")
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except OSError as exc:
        raise _TierRejected(f"{MANIFEST} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _TierRejected(f"{MANIFEST} is not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise _TierRejected(f"{MANIFEST} is not a JSON object")
    return manifest


def _check_layout(manifest: dict[str, Any], here: dict[str, Any]) -> None:
    """Raise ``_TierRejected`` for a malformed header, ``_TierForeign`` for another layout."""
    fmt = manifest.get("format")
    if not _is_int(fmt):
        raise _TierRejected(f"{MANIFEST}: 'format' is missing or not an integer")
    fingerprint = manifest.get("fingerprint")
    fingerprint = fingerprint if isinstance(fingerprint, str) else None
    if fmt != FORMAT:  # a later version's layout: its other fields may mean other things
        raise _TierForeign(f"written in tier format {fmt}; this station reads format {FORMAT}",
                           fingerprint)
    types = {"fingerprint": str, "block_size": int, "dtype": str, "kv_shape": list}
    for key, kind in types.items():
        value = manifest.get(key)
        if not isinstance(value, kind) or (kind is int and not _is_int(value)):
            raise _TierRejected(f"{MANIFEST}: {key!r} is missing or not a {kind.__name__}")
    shape = manifest["kv_shape"]
    if len(shape) != 5 or not all(_is_int(d) and d > 0 for d in shape):
        raise _TierRejected(f"{MANIFEST}: 'kv_shape' is not 5 positive integers")
    differ = []
    for key in ("fingerprint", "dtype", "block_size", "kv_shape"):
        if manifest[key] != here[key]:
            theirs, ours = manifest[key], here[key]
            if key == "fingerprint":
                theirs, ours = theirs[:12], ours[:12]
            differ.append(f"{key} {theirs} (here {ours})")
    if differ:
        raise _TierForeign("written by another model or KV layout: " + ", ".join(differ),
                           fingerprint)


def _load_kv(directory: Path, manifest: dict[str, Any], here: dict[str, Any],
             bytes_per_block: int) -> torch.Tensor:
    num_blocks = manifest.get("num_blocks")
    if num_blocks is not None and not (_is_int(num_blocks) and num_blocks >= 0):
        raise _TierRejected(f"{MANIFEST}: 'num_blocks' is not a non-negative integer")
    digest = manifest.get("kv_sha256")
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise _TierRejected(f"{MANIFEST}: 'kv_sha256' is not a sha256 hex digest")
    path = directory / KV_FILE
    size = _regular_file(path, KV_FILE)
    if num_blocks is not None and size > num_blocks * bytes_per_block + _KV_FILE_SLACK_BYTES:
        raise _TierRejected(f"{KV_FILE} is {size} bytes, too large for {num_blocks} blocks")
    try:
        if digest is not None:
            with open(path, "rb") as fh:
                actual = hashlib.file_digest(fh, "sha256").hexdigest()
            if actual != digest:
                raise _TierRejected(f"{KV_FILE} does not match the manifest's sha256 "
                                   "(truncated or changed after it was written)")
        # weights_only: a tier file can never run code; mmap: only the blocks restored are read.
        kv = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except _TierRejected:
        raise
    except Exception as exc:  # torch raises many types for a torn or foreign file
        raise _TierRejected(f"{KV_FILE} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not isinstance(kv, torch.Tensor):
        raise _TierRejected(f"{KV_FILE} holds a {type(kv).__name__}, not a tensor")
    if str(kv.dtype) != here["dtype"]:
        raise _TierRejected(f"{KV_FILE} holds {kv.dtype}, the manifest says {here['dtype']}")
    shape = list(kv.shape)
    if num_blocks is None and len(shape) == 6:  # a tier written before 'num_blocks' existed
        num_blocks = shape[2]
    num_layers, two, *per_block = here["kv_shape"]
    expected = [num_layers, two, num_blocks, *per_block]
    if shape != expected:
        raise _TierRejected(f"{KV_FILE} has shape {shape}, the manifest needs {expected}")
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
                   ) -> tuple[list[_Entry], list[str]]:
    """The valid session entries, and one reason per refused one."""
    entries: list[_Entry] = []
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
        entries.append(_Entry(item["session_id"], item["tenant"], item["token_ids"], item["blocks"]))
    return entries, errors


def _max_manifest_bytes(engine: Any) -> int:
    """The largest manifest these settings can write (a token id takes at most 8 bytes)."""
    return (_MANIFEST_SLACK_BYTES
            + engine.settings.kv_session_budget * engine.max_model_len * 8)


def _read_tier(engine: Any, directory: Path) -> _Tier:
    here = _layout(engine)
    manifest = _read_manifest(directory, _max_manifest_bytes(engine))
    _check_layout(manifest, here)
    if not isinstance(manifest.get("sessions"), list):
        raise _TierRejected(f"{MANIFEST}: 'sessions' is missing or not a list")
    bytes_per_block = engine.kv_cache.shape.bytes_per_block
    kv = _load_kv(directory, manifest, here, bytes_per_block)
    entries, errors = _check_entries(manifest["sessions"], kv.shape[2], engine.block_size,
                                     engine.loaded.vocab_size)
    return _Tier(kv, entries, errors)


# -- restoring (the only part that touches the pool)
def _select(entries: list[_Entry], budget: int, free_blocks: int) -> list[_Entry]:
    """The most recently used entries that fit the session budget and the pool, LRU first."""
    chosen: list[_Entry] = []
    blocks: set[int] = set()
    for entry in reversed(entries):  # most recent first
        if len(chosen) == budget:
            break
        more = blocks.union(entry.blocks)
        if len(more) > free_blocks:
            continue
        blocks = more
        chosen.append(entry)
    chosen.reverse()
    return chosen


def _install(engine: Any, tier: _Tier, entries: list[_Entry]) -> int:
    """Copy the entries' blocks into fresh pool blocks and pin them as sessions."""
    kv = engine.kv
    used = sorted({b for entry in entries for b in entry.blocks})
    if not used and not entries:
        return 0
    blocks = kv.allocate_blocks(len(used))
    try:
        slot = {index: block for index, block in zip(used, blocks)}
        if used:
            src = tier.kv.index_select(2, torch.tensor(used, dtype=torch.long))
            dst = torch.tensor([b.block_id for b in blocks], dtype=torch.long,
                               device=engine.kv_cache.kv.device)
            engine.kv_cache.kv.index_copy_(2, dst, src.to(engine.kv_cache.kv.device))
        for entry in entries:
            kv.restore_session(entry.session_id, entry.tenant, entry.token_ids,
                               [slot[i] for i in entry.blocks])
    except BaseException:
        # Leave the pool as it was at boot: no session, no cached hash, every block free.
        kv.sessions.clear()
        kv.free_blocks(blocks)
        kv.clear()
        raise
    kv.free_blocks(blocks)  # drop the allocation's reference: the sessions' pins hold the blocks
    return len(used)


def _reject(directory: Path, reason: str, report: TierReport) -> None:
    reason = _short(reason)
    try:
        moved = _move_aside(directory, "rejected")
    except OSError as exc:
        log.error("kv_tier_rejected", reason=reason, path=str(directory),
                  error=f"could not move it aside: {exc}")
        report.rejections.append({"path": str(directory),
                                  "reason": _short(f"{reason} (not moved aside: {exc.strerror or exc})")})
        return
    log.warning("kv_tier_rejected", reason=reason, path=str(directory), moved_to=str(moved))
    report.rejections.append({"path": str(moved), "reason": reason})


def restore_sessions(engine: Any, directory: Path) -> TierReport:
    """Restore the tier in ``directory`` as pinned sessions; never raises for what is on disk."""
    report = TierReport(str(directory))
    try:
        _restore(engine, directory, report)
    except Exception as exc:  # a bug or a device error must not stop the boot either
        log.exception("kv_tier_restore_failed", path=str(directory))
        # _install leaves the pool as it was when it fails; count what is really there.
        report.restored_sessions = len(engine.kv.sessions)
        report.restored_blocks = engine.kv.sessions.pinned_blocks
        if os.path.lexists(directory):
            _reject(directory, f"restore failed: {type(exc).__name__}: {exc}", report)
    report.rejected_on_disk, report.foreign_on_disk = _count_aside(directory)
    return report


def _restore(engine: Any, directory: Path, report: TierReport) -> None:
    if not os.path.lexists(directory):
        return
    try:
        tier = _read_tier(engine, directory)
    except _TierForeign as exc:
        log.warning("kv_tier_ignored", reason=str(exc), path=str(directory))
        report.foreign = {"path": str(directory), "reason": _short(str(exc))}
        return
    except _TierRejected as exc:
        _reject(directory, str(exc), report)
        return
    chosen = _select(tier.entries, engine.kv.sessions.budget, engine.kv.pool.num_free_blocks)
    report.restored_blocks = _install(engine, tier, chosen)
    report.restored_sessions = len(chosen)
    report.skipped_sessions = len(tier.entries) - len(chosen)
    report.bad_sessions = len(tier.errors)
    del tier.kv  # drop the memory map before the files move
    log.info("kv_sessions_restored", sessions=len(chosen), blocks=report.restored_blocks,
             skipped=report.skipped_sessions, path=str(directory))
    if report.skipped_sessions:
        log.warning("kv_sessions_not_restored", sessions=report.skipped_sessions,
                    reason="past the session budget or the KV pool", path=str(directory))
    if tier.errors:
        shown = "; ".join(tier.errors[:_ENTRY_ERRORS_SHOWN])
        more = len(tier.errors) - _ENTRY_ERRORS_SHOWN
        _reject(directory, f"{len(tier.errors)} of {len(tier.errors) + len(tier.entries)} "
                f"session entries refused: {shown}" + (f"; {more} more" if more > 0 else ""),
                report)


# -- saving
def _create(path: Path) -> BinaryIO:
    """A new file, 0600 from birth (never a window in which others could read it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "wb")


def _existing_kind(engine: Any, directory: Path) -> tuple[str, str | None]:
    """``("none" | "ours" | "other", fingerprint)`` for what sits at ``directory`` now."""
    if not os.path.lexists(directory):
        return "none", None
    here = _layout(engine)
    try:
        manifest = _read_manifest(directory, _max_manifest_bytes(engine))
        _check_layout(manifest, here)
    except _TierForeign as exc:
        return "other", exc.fingerprint
    except _TierRejected:
        return "other", None
    return "ours", here["fingerprint"]


def _keep_aside(directory: Path, fingerprint: str | None) -> Path:
    if fingerprint is not None:
        tag = re.sub(r"[^0-9A-Za-z]", "", fingerprint)[:12] or "unknown"
        moved = _move_aside(directory, f"foreign-{tag}")
    else:
        moved = _move_aside(directory, "rejected")
    log.warning("kv_tier_kept", path=str(directory), moved_to=str(moved),
                reason="another model's or an unreadable tier is never overwritten")
    return moved


def save_sessions(engine: Any, directory: Path) -> int:
    """Write every KV session to ``directory``; returns how many were written.

    Raises ``OSError`` when the tier cannot be written (the previous one stays whole)."""
    sessions = engine.kv.sessions.sessions()  # least recently used first: restored in order
    kind, fingerprint = _existing_kind(engine, directory)
    if not sessions:
        if kind == "ours":  # its sessions expired or were deleted: they must not come back
            shutil.rmtree(directory)
        return 0
    block_ids: list[int] = []
    index: dict[int, int] = {}  # sessions of one conversation share blocks: store each once
    entries = []
    for session in sessions:
        refs = []
        for block in session.blocks:
            if block.block_id not in index:
                index[block.block_id] = len(block_ids)
                block_ids.append(block.block_id)
            refs.append(index[block.block_id])
        entries.append({"session_id": session.session_id, "tenant": session.tenant,
                        "token_ids": list(session.token_ids), "blocks": refs})
    ids = torch.tensor(block_ids, dtype=torch.long, device=engine.kv_cache.kv.device)
    kv = engine.kv_cache.kv.index_select(2, ids).cpu()
    directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = directory.with_name(directory.name + ".tmp")
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)  # our own unfinished write, never a tier
    tmp.mkdir(mode=0o700)
    with _create(tmp / KV_FILE) as fh:
        torch.save(kv, fh)
    with open(tmp / KV_FILE, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    manifest = {**_layout(engine), "num_blocks": len(block_ids), "kv_sha256": digest,
                "sessions": entries}
    with _create(tmp / MANIFEST) as fh:
        fh.write(json.dumps(manifest).encode())
    shutil.rmtree(old, ignore_errors=True)
    if kind == "other":
        _keep_aside(directory, fingerprint)
    elif kind == "ours":
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
    log.info("kv_sessions_saved", sessions=len(entries), blocks=len(block_ids), path=str(directory))
    return len(entries)
