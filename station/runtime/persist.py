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
is touched (``station.runtime.tier_file.read_tier``); what it finds decides:

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gnosis_daemon.logs import get_logger
from station.runtime.tier_file import (
    KV_FILE,
    MANIFEST,
    Entry,
    Tier,
    TierForeign,
    TierRejected,
    check_layout,
    layout,
    max_manifest_bytes,
    read_manifest,
    read_tier,
)

log = get_logger()

_REASON_CHARS = 300  # reasons go into hello/health and the status file: keep them short
_ENTRY_ERRORS_SHOWN = 3


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


def _short(reason: str) -> str:
    return reason if len(reason) <= _REASON_CHARS else reason[:_REASON_CHARS - 3] + "..."


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


# -- restoring (the only part that touches the pool)
def _select(entries: list[Entry], budget: int, free_blocks: int) -> list[Entry]:
    """The most recently used entries that fit the session budget and the pool, LRU first."""
    chosen: list[Entry] = []
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


def _install(engine: Any, tier: Tier, entries: list[Entry]) -> int:
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
        tier = read_tier(engine, directory)
    except TierForeign as exc:
        log.warning("kv_tier_ignored", reason=str(exc), path=str(directory))
        report.foreign = {"path": str(directory), "reason": _short(str(exc))}
        return
    except TierRejected as exc:
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
    here = layout(engine)
    try:
        manifest = read_manifest(directory, max_manifest_bytes(engine))
        check_layout(manifest, here)
    except TierForeign as exc:
        return "other", exc.fingerprint
    except TierRejected:
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
    manifest = {**layout(engine), "num_blocks": len(block_ids), "kv_sha256": digest,
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
