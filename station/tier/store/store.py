"""The KV store: liquid memory's disk tier, whose sessions survive SIGKILL and outgrow the
KV pool. One class, ``KVStore``, with three parts that own their own state: where its files
are and its lock (``directory``), the listing that builds and rescans its index from the
directory's names (``listing``), and the quarantine (``quarantine``).

Layout under ``root`` (directories 0700, files 0600: they hold every tenant's tokens)::

    blocks/<2 hex>/<block hash hex>.kvb   one KV block, named by its chained block hash
    sessions/<sha256(session id)[:32]>.kvs  one session manifest
    quarantine/, quarantine.json             files that failed a check (``quarantine``)
    lock                                     flock'd while a store has the root open

``root`` is the store's KV layout's directory in the model's (``layouts``); another
layout's files are never opened. A block this store never wrote nor read is checked before
it is deleted (a damaged one is quarantined instead). Eviction, a full filesystem and a
deleted directory: ``pressure``. A fleet's **shared** tier (``shared=True``: a
read-write-many volume every replica's store opens) shares the lock, spares the other
replicas' fresh files and rescans their manifests (``listing``). Eviction judges by what
this store's index knows: a block it removes may be named by a manifest another replica
writes at that moment, and that session is then dropped as incomplete at the next look (a
miss, never a wrong answer: every read is checked).

A block's name is its ``block_pool.hash_block`` chain hash, which covers every token
before it, the model fingerprint and the tenant (through the extra keys): sessions that
share a prefix share its block files, stored once. Each file carries its own layout and a
xxh3-128 checksum (``station.tier.format``); no pickle anywhere.

Crash safety. Every file is written to a temp name in its own directory, fsynced, then
``os.replace``d over its final name. ``os.replace`` is atomic, so at every instant a final
name holds a complete, fsynced file or nothing: a SIGKILL at any point leaves the old
state or the new, plus perhaps a ``*.tmp`` that the next open deletes unread. Files never
change after the rename. Blocks go before the manifest that names them, and
``write_session`` fsyncs the block directories first, so even after a power loss a durable
manifest names durable blocks. Should a manifest name a block that is gone anyway (a power
loss that undid an eviction's unlink of the manifest but not of its blocks, a file removed
by hand, a block quarantined at read), the open drops that session as *incomplete*.
Eviction deletes the manifest before the blocks, so a crash midway leaves orphan blocks,
which the next ``evict_to_budget`` collects. And whatever the disk holds, every read checks
every field (a flipped bit, a cut file, another model's file): a torn or foreign file is
never trusted, only quarantined and counted.

Threads: one writer thread (``write_*``, ``delete_session``, ``touch_session``,
``evict_to_budget``, ``sync_dirs``), one loader thread (``read_block``) and the engine
thread (``has_block``, ``count_present``, ``stats``...). The in-memory index
(``index.StoreIndex``) locks only around dict work, never across I/O, so the engine's
queries never wait on the disk. ``_mutate`` serialises every change on disk (writes,
deletes, eviction, the loader's quarantines), so index and files change together. Blocks
written since the last ``write_session`` are *pending*: eviction spares them although no
manifest names them yet.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from gnosis_daemon.logs import get_logger
from station.core.block_pool import BlockHash
from station.tier.format import (
    KVLayout, KVStoreError, Missing, Quarantined, SessionRecord, Unreadable, block_relpath,
    check_hash, decode_block, encode_block, encode_session, fsync_dir, write_atomic,
)
from station.tier.store.directory import StoreBusy, StoreDirectory, unlink_if_present
from station.tier.store.index import StoreIndex
from station.tier.store.layouts import LAYOUT_FILE, tag_of
from station.tier.store.listing import STALE_S, StoreListing
from station.tier.store.pressure import FULL_ERRNOS, DiskFull, choose_victim
from station.tier.store.quarantine import Quarantine

if TYPE_CHECKING:
    import numpy
    import torch

    from station.tier.dtype import DTypeName

__all__ = ["DiskFull", "Evicted", "KVStore", "KVStoreError", "Missing", "Quarantined", "SessionRecord",
           "STALE_S", "StoreBusy", "Unreadable"]

log = get_logger()


@dataclass(frozen=True, slots=True)
class Evicted:
    sessions: tuple[str, ...]  # least recently used first
    blocks: tuple[BlockHash, ...]
    bytes: int


class KVStore:
    """One KV layout's tier on disk (the module docstring says how it is kept)."""

    def __init__(self, root: str | os.PathLike[str], fingerprint: str, block_size: int,
                 block_shape: tuple[int, ...], dtype: torch.dtype | DTypeName, disk_budget_bytes: int,
                 clock: Callable[[], float] = time.time, shared: bool = False,
                 quarantine_budget_bytes: int = 1 << 30, tenant_share: float = 1.0) -> None:
        shape = tuple(int(d) for d in block_shape)
        if block_size < 1 or not shape or min(shape) < 1 or disk_budget_bytes < 0 \
                or quarantine_budget_bytes < 0 or not 0 < tenant_share <= 1:
            raise ValueError("block_size and every block dimension must be positive, the "
                             "budgets not negative, and the tenant share in (0, 1]")
        self.layout = KVLayout(fingerprint, block_size, shape, dtype)
        self.disk_budget_bytes = disk_budget_bytes
        self.tenant_share = tenant_share
        self.clock = clock
        self.index = StoreIndex()
        self._mutate = threading.RLock()  # held by every change on disk (see module doc)
        # the model's tier is ``root``; the store's own root is its layout's, in it
        self.directory = StoreDirectory(Path(root), self.layout, shared)
        self.quarantine = Quarantine(self.directory, self.index, quarantine_budget_bytes,
                                     self._mutate)
        self.listing = StoreListing(self.directory, self.layout, self.index, self.quarantine,
                                    self._mutate)
        self._verified: set[BlockHash] = set()  # blocks written or read whole by this store
        self._evicted_now: list[str] = []  # see take_evicted
        self._lost_now: list[str] = []  # see take_lost
        self.last_error: str | None = None  # the last write error (a full disk, a lost root)
        self.last_error_at: float | None = None
        self.directory.lock()
        try:
            self.listing.open()
        except BaseException:
            self.close()
            raise

    @property
    def root(self) -> Path:
        return self.directory.root

    @property
    def other_layouts(self) -> list[str]:
        return self.directory.other_layouts

    @property
    def blocks_dir(self) -> Path:
        return self.directory.blocks

    @property
    def sessions_dir(self) -> Path:
        return self.directory.sessions

    def close(self) -> None:
        """Release the root (the kernel does it too when the process dies)."""
        self.directory.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- index queries (any thread; they never touch the disk)
    def has_block(self, block_hash: BlockHash) -> bool:
        return self.index.has_block(block_hash)

    def count_present(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` have a block file (a prefix match on disk)."""
        return self.index.count_present(block_hashes)

    def has_session(self, session_id: str) -> bool:
        return self.index.has_session(session_id)

    def load_sessions(self) -> list[SessionRecord]:
        """Every session the store holds, verified at open, least recently used first."""
        return self.index.sessions_lru()

    def stats(self) -> dict[str, object]:
        return {**self.index.stats(), **self.quarantine.stats(), "budget_bytes": self.disk_budget_bytes,
                "root": str(self.root), "layout": tag_of(self.layout),
                "other_layouts": self.other_layouts, "last_error": self.last_error,
                "last_error_at": self.last_error_at}

    def rescan(self) -> tuple[list[SessionRecord], list[str]]:
        """A shared tier's look at the other replicas' manifests (``StoreListing.rescan``)."""
        return self.listing.rescan()

    # -- reading (the loader thread)
    def read_block(self, block_hash: BlockHash, expected_token_ids: Sequence[int],
                   raw: bool = False) -> torch.Tensor | numpy.ndarray:
        """The block's KV (CPU, ``block_shape``/``dtype``; ``raw``: its bytes, a uint8
        array), every field verified.

        Raises ``Quarantined`` (the file is moved aside and counted), ``Missing`` or
        ``Unreadable``, all ``KVStoreError``s."""
        path = self.directory.block_path(block_hash)
        try:
            tokens, tensor, size = decode_block(path, self.layout, block_hash, raw)
            if tokens != tuple(expected_token_ids):
                # sha256 chains make this a wrong file, not a collision
                raise Quarantined("tokens", "the block holds other tokens than its hash's")
        except Quarantined as exc:
            with self._mutate:
                self.quarantine.keep(path, exc)
                self.index.forget_block(block_hash)
            raise
        except Missing:
            with self._mutate:
                if not os.path.lexists(path):  # removed behind our back: stop offering it
                    self.index.forget_block(block_hash)
            raise
        self.index.count(reads=1, bytes_read=size)
        self._verified.add(block_hash)
        return tensor

    # -- writing (the writer thread)
    def write_block(self, block_hash: BlockHash, token_ids: Sequence[int],
                    tensor: torch.Tensor | numpy.ndarray, tenant: str | None = None,
                    session_id: str | None = None) -> bool:
        """Store one block (a CPU tensor of ``block_shape``/``dtype``, or its raw bytes as a
        uint8 array); False if present.

        Either way the block is pending (spared by eviction) until the next
        ``write_session``. ``tenant``/``session_id``: whose save it is, should a full
        filesystem make room (``pressure``)."""
        path = self.directory.block_path(block_hash)
        tokens = [int(t) for t in token_ids]
        if len(tokens) != self.layout.block_size:
            raise ValueError(f"a block holds {self.layout.block_size} tokens, not {len(tokens)}")
        with self._mutate:
            if self.index.pend(block_hash):
                return False
            try:
                pieces = encode_block(self.layout, block_hash, tokens, tensor)
                size = self._write_file(path, pieces, tenant, session_id)
            except BaseException:
                self.index.unpend(block_hash)
                raise
            self.index.add_block(block_hash, size)
            self._verified.add(block_hash)
            self.index.mark_dirty(self.blocks_dir / block_relpath(block_hash).split("/")[0])
            self.index.count(writes=1, bytes_written=size)
        return True

    def write_session(self, session_id: str, tenant: str, token_ids: Sequence[int],
                      block_hashes: Sequence[BlockHash], last_used: float,
                      expires_at: float | None = None, ttl_s: float | None = None) -> None:
        """Write (or replace) a session's manifest; its blocks must be in the store.
        ``expires_at`` / ``ttl_s``: a TTL pin's, kept by the manifest."""
        if not isinstance(session_id, str) or not session_id or not isinstance(tenant, str):
            raise ValueError("a session needs a non-empty string id and a string tenant")
        hashes = tuple(block_hashes)
        for h in hashes:
            check_hash(h)
        tokens = tuple(int(t) for t in token_ids)
        if len(tokens) != len(hashes) * self.layout.block_size:
            raise ValueError(f"{len(tokens)} tokens for {len(hashes)} full blocks")
        record = SessionRecord(session_id, tenant, tokens, hashes, float(last_used),
                               float(self.clock()), expires_at, ttl_s)
        with self._mutate:
            missing = self.index.count_missing(hashes)
            if missing:
                raise ValueError(f"{missing} of the session's blocks are not in the store")
            self.sync_dirs()  # the blocks' names are durable before a manifest names them
            self._put_session(record)
            self.index.clear_pending()  # the writer's batch is named: eviction may judge it

    def _put_session(self, record: SessionRecord) -> None:
        path = self.directory.session_path(record.session_id)
        size = self._write_file(path, encode_session(self.layout, record), record.tenant,
                                record.session_id)
        # our own write, no news for rescan (its path now: the root may have been recreated)
        self.listing.saw(self.directory.session_path(record.session_id), record.session_id)
        self.index.put_session(record, size)
        self.index.mark_dirty(self.sessions_dir)
        self.index.count(writes=1, bytes_written=size)

    def touch_session(self, session_id: str, last_used: float,
                      expires_at: float | None = None) -> bool:
        """Record a use (rewrites the small manifest), and a pin's refreshed ``expires_at``;
        False if there is no such session."""
        with self._mutate:
            record = self.index.session(session_id)
            if record is None:
                return False
            expires = record.expires_at if expires_at is None or record.ttl_s is None else expires_at
            self._put_session(SessionRecord(record.session_id, record.tenant, record.token_ids,
                                            record.block_hashes, float(last_used),
                                            record.saved_at, expires, record.ttl_s))
        return True

    def drop_expired(self) -> list[str]:
        """Delete every session whose TTL pin has expired (the tier's open: a pin that ran
        out while the station was down); -> their ids."""
        now = self.clock()
        with self._mutate:
            expired = [r.session_id for r in self.index.sessions_lru()
                       if r.expires_at is not None and r.expires_at <= now]
            for session_id in expired:
                self._drop_session(session_id)
        return expired

    def delete_session(self, session_id: str) -> bool:
        """Remove a session and every block no other session names (tenant data goes)."""
        with self._mutate:
            if not self.index.has_session(session_id):
                return False
            self._drop_session(session_id)
        return True

    def _drop_session(self, session_id: str) -> list[BlockHash]:
        # The manifest goes first: a crash after it leaves orphans, never a dangling name.
        unlink_if_present(self.directory.session_path(session_id))
        self.listing.forget(session_id)
        self.index.mark_dirty(self.sessions_dir)
        return self._remove_blocks(self.index.remove_session(session_id))

    def _remove_blocks(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        removed = []
        for h in hashes:
            if not self.index.removable(h):  # named again, or pending
                continue
            path = self.directory.block_path(h)
            if h not in self._verified and self._damaged(path, h):
                continue  # quarantined, intact: a damaged file is kept, never deleted
            unlink_if_present(path)
            self.index.forget_block(h)
            self._verified.discard(h)
            self.index.mark_dirty(path.parent)
            removed.append(h)
        return removed

    def _damaged(self, path: Path, block_hash: BlockHash) -> bool:
        """Check a block this store never wrote nor read before it is deleted: a damaged one
        is quarantined (and forgotten) instead, so damage is kept and counted, never erased."""
        try:
            decode_block(path, self.layout, block_hash, raw=True)
        except Quarantined as exc:
            self.quarantine.keep(path, exc)
            self.index.forget_block(block_hash)
            return True
        except KVStoreError:  # gone, or unreadable: nothing to keep from here
            return False
        return False

    def evict_to_budget(self, tenant: str | None = None) -> Evicted:
        """Delete orphan blocks, then sessions (and the blocks only they named) until the
        store fits ``disk_budget_bytes``: least recently used first, the over-share tenant's
        first (``tenant``: the writer's; ``pressure``). A block a remaining session
        names, or a pending one, is never removed. ``sessions``: every session evicted since
        the last call, a full disk's too."""
        with self._mutate:
            before = self.index.bytes
            orphans = self.index.orphans()
            if self.directory.shared:  # a fresh one is another replica's, its manifest on the way
                orphans = [h for h in orphans if self.listing.stale(self.directory.block_path(h))]
            blocks = self._remove_blocks(orphans)
            n = 0
            while self.index.bytes > self.disk_budget_bytes:
                evicted = self._evict_one(tenant)
                if evicted is None:
                    break
                blocks += evicted[1]
                n += 1
            sessions = self.take_evicted()
            freed = before - self.index.bytes
            self.index.count(evicted_sessions=n, evicted_blocks=len(blocks))
        if sessions or blocks:
            log.info("kv_store_evicted", sessions=len(sessions), blocks=len(blocks), bytes=freed)
        return Evicted(tuple(sessions), tuple(blocks), freed)

    def sync_dirs(self) -> None:
        """fsync every directory whose names changed since the last call (once per batch)."""
        dirty = self.index.take_dirty()
        try:
            for d in sorted(dirty, key=lambda p: len(p.parts), reverse=True):  # deepest first
                fsync_dir(d)
        except BaseException:
            self.index.mark_dirty(*dirty)
            raise

    # -- pressure (``pressure``): the budget's victims, a full filesystem, a deleted root
    def _evict_one(self, tenant: str | None, keep: str | None = None,
                   budget: int | None = None) -> tuple[str, list[BlockHash]] | None:
        victim = choose_victim(self.index, tenant, self.tenant_share,
                               self.disk_budget_bytes if budget is None else budget, keep,
                               self.clock())
        if victim is None:
            return None
        blocks = self._drop_session(victim.session_id)
        self.index.count(evicted_over_share=int(victim.over_share))
        self._evicted_now.append(victim.session_id)
        return victim.session_id, blocks

    def take_evicted(self) -> list[str]:
        """Sessions evicted since the last call (the budget, a full disk), oldest first."""
        with self._mutate:
            evicted, self._evicted_now = self._evicted_now, []
            return evicted

    def _write_file(self, path: Path, pieces: Sequence[Any], tenant: str | None = None,
                    keep: str | None = None) -> int:
        """``write_atomic`` (its directory made if missing), with room made on ENOSPC."""
        recreated = False
        while True:
            try:
                if path.parent.parent == self.blocks_dir and not path.parent.is_dir():
                    with contextlib.suppress(FileExistsError):  # a block's fan-out directory
                        path.parent.mkdir(mode=0o700)
                        self.index.mark_dirty(self.blocks_dir)
                return write_atomic(path, pieces)
            except FileNotFoundError:
                old_root = self.root
                if recreated or not self.check_root():
                    raise
                recreated = True
                path = self.root / path.relative_to(old_root)
            except OSError as exc:
                if exc.errno not in FULL_ERRNOS:
                    raise
                self.index.count(disk_full=1)
                self.last_error = f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror} " \
                                  f"(writing {path.name}, {self.index.bytes} bytes in the tier)"
                self.last_error_at = time.time()
                # The filesystem holds no more than the tier has now: shares are of that.
                evicted = self._evict_one(tenant, keep, min(self.disk_budget_bytes, self.index.bytes))
                log.warning("kv_store_disk_full", file=path.name, tier_bytes=self.index.bytes,
                            evicted=evicted[0] if evicted else None)
                if evicted is None:
                    raise DiskFull(f"the filesystem is full and the tier has no session left "
                                   f"to evict: {exc.strerror}") from None
                self.index.count(disk_full_evicted=1)

    def check_root(self) -> bool:
        """Recreate the tier's directories if they are gone; True if they were. The sessions
        whose manifests went with them leave the index (``take_lost``)."""
        with self._mutate:
            if not self.directory.gone():
                return False
            self.directory.recreate()
            lost = self.listing.forget_missing()
            self.quarantine.forget_gone()
            self.index.count(lost=1, lost_sessions=len(lost))
            self._lost_now.extend(lost)
            self.index.take_dirty()
            self.index.mark_dirty(self.root, self.root.parent)
            self.last_error = f"the tier's directory was gone: recreated, {len(lost)} session(s) lost"
            self.last_error_at = time.time()
            log.error("kv_store_root_recreated", root=str(self.root), lost_sessions=len(lost),
                      marker=(self.directory.model_dir / LAYOUT_FILE).exists())
            return True

    def take_lost(self) -> list[str]:
        """Sessions whose files were found gone since the last call."""
        with self._mutate:
            lost, self._lost_now = self._lost_now, []
            return lost
