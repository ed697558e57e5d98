"""The KV store's listing: the index built from the directory's names at open, and on a
fleet's shared tier the rescan that learns what the other replicas wrote or removed since.

Opening lists the directories and stats block files, never reads one: start time grows
with the number of files, not their bytes. Session manifests are small and read whole. A
block is first verified when the store's ``read_block`` loads it. A ``*.tmp`` is a write
cut short: never trusted, never read, deleted. A manifest that names a block that is gone
drops its session as *incomplete*: the manifest is deleted (its bytes are sound, its KV is
not all there, so quarantining it would prove nothing) and counted.

On a **shared** tier a temp file or a block no manifest names is another replica's write in
progress unless it is older than ``STALE_S``, so only then is it removed; blocks a manifest
names that the start's listing missed are looked for on disk before the manifest is judged
incomplete (and an incomplete one is left to the replica that wrote it); and ``rescan``
reads the manifests the other replicas wrote, replaced or removed since the last look.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Sequence

from gnosis_daemon.logs import get_logger
from station.core.block_pool import BlockHash
from station.tier.format import (
    BLOCK_DIR, BLOCK_NAME, HASH_BYTES, SESSION_NAME, TMP_SUFFIX, KVLayout, Missing,
    Quarantined, SessionRecord, Unreadable, decode_session,
)
from station.tier.store.directory import StoreDirectory, unlink_if_present
from station.tier.store.index import StoreIndex
from station.tier.store.quarantine import Quarantine

log = get_logger()

STALE_S = 600.0  # shared tier: another replica's temp file or unnamed block is this old at most


def _is_tmp(entry: os.DirEntry[str]) -> bool:
    return entry.name.endswith(TMP_SUFFIX) and not entry.is_dir(follow_symlinks=False)


class StoreListing:
    """What the store last saw of each manifest, and the scans that compare the directory
    with it. Every change holds ``mutate``, the store's lock for changes on disk."""

    def __init__(self, directory: StoreDirectory, layout: KVLayout, index: StoreIndex,
                 quarantine: Quarantine, mutate: threading.RLock) -> None:
        self.directory, self.layout, self.index = directory, layout, index
        self.quarantine, self._mutate = quarantine, mutate
        # Manifest file name -> ((inode, mtime_ns), session id) as last read or written
        # here: what ``rescan`` compares the directory with. Every write is a rename, so a
        # replaced manifest has a new inode even where mtimes are coarse (NFS).
        self._seen: dict[str, tuple[tuple[int, int], str]] = {}

    # -- what the store's own writes and deletes changed
    def saw(self, path: Path, session_id: str) -> None:
        """The manifest at ``path`` is the store's own write: no news for ``rescan``."""
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            self._seen[path.name] = ((st.st_ino, st.st_mtime_ns), session_id)

    def forget(self, session_id: str) -> None:
        self._seen.pop(self.directory.session_path(session_id).name, None)

    def forget_missing(self) -> list[str]:
        """The sessions and blocks whose files are gone (their directory was deleted) leave
        the index -> the ids of those sessions."""
        lost = [sid for sid in self.index.session_ids()
                if not self.directory.session_path(sid).exists()]
        for sid in lost:
            self.index.remove_session(sid)
            self.forget(sid)
        for h in self.index.block_hashes():
            if not self.directory.block_path(h).exists():
                self.index.forget_block(h)
        return lost

    # -- opening
    def open(self) -> None:
        started = time.monotonic()
        d = self.directory
        for top in (d.blocks, d.sessions, d.quarantine):
            with contextlib.suppress(FileExistsError):
                top.mkdir(mode=0o700)
                self.index.mark_dirty(d.root)
        self.quarantine.list_kept()
        # Each listing is taken whole before its entries are removed or moved.
        with os.scandir(d.blocks) as it:
            subdirs = sorted(it, key=lambda e: e.name)
        for sub in subdirs:
            if sub.is_dir(follow_symlinks=False) and BLOCK_DIR.fullmatch(sub.name):
                with os.scandir(sub.path) as it:
                    entries = list(it)
                for entry in entries:
                    self._index_block(sub.name, entry)
            else:
                self.quarantine.keep(Path(sub.path), Quarantined("name", "not a block directory"))
        with os.scandir(d.sessions) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            self._index_session(entry)
        stats = self.index.stats()
        log.info("kv_store_opened", root=str(d.root), blocks=stats["blocks"],
                 sessions=stats["sessions"], bytes=stats["bytes"],
                 quarantined=stats["quarantined_total"],
                 incomplete=stats["incomplete_sessions"], tmp_removed=stats["tmp_removed"],
                 ms=round((time.monotonic() - started) * 1000, 1))

    def stale(self, entry: os.DirEntry[str] | Path) -> bool:
        """A temp file (or an unnamed block) that no write in progress can own: any, in a
        private store; one older than ``STALE_S`` in a shared one."""
        if not self.directory.shared:
            return True
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return False  # gone meanwhile: nothing to remove
        return time.time() - mtime > STALE_S

    def _remove_tmp(self, entry: os.DirEntry[str]) -> None:
        if self.stale(entry):  # a write cut short: never trusted, never read
            unlink_if_present(Path(entry.path))
            self.index.count(tmp_removed=1)

    def _index_block(self, subdir: str, entry: os.DirEntry[str]) -> None:
        """Index one file under blocks/ by its name alone: its bytes are checked at read."""
        if _is_tmp(entry):
            self._remove_tmp(entry)
        elif (BLOCK_NAME.fullmatch(entry.name) and entry.name.startswith(subdir)
              and entry.is_file(follow_symlinks=False)):
            self.index.add_block(BlockHash(bytes.fromhex(entry.name[:2 * HASH_BYTES])),
                                 entry.stat(follow_symlinks=False).st_size)
        else:
            self.quarantine.keep(Path(entry.path), Quarantined("name", "not a block file name"))

    def _index_session(self, entry: os.DirEntry[str]) -> None:
        if _is_tmp(entry):
            self._remove_tmp(entry)
        elif not SESSION_NAME.fullmatch(entry.name):
            self.quarantine.keep(Path(entry.path), Quarantined("name", "not a session file name"))
        else:
            self._read_manifest(entry)

    def _read_manifest(self, entry: os.DirEntry[str]) -> SessionRecord | None:
        """Index the session of one manifest -> its record (None: bad, gone or incomplete)."""
        path = Path(entry.path)
        try:
            st = entry.stat(follow_symlinks=False)
            mtime = (st.st_ino, st.st_mtime_ns)
            record, size = decode_session(path, self.layout)
        except Quarantined as exc:
            self.quarantine.keep(path, exc)
            return None
        except FileNotFoundError:
            return None  # another replica removed it meanwhile
        except (Missing, Unreadable) as exc:
            log.warning("kv_store_session_unreadable", file=entry.name, error=str(exc))
            return None
        self._seen[entry.name] = (mtime, record.session_id)
        if self.directory.shared:  # blocks written after the start's listing of blocks/
            self._find_blocks(record.block_hashes)
        if self.index.count_missing(record.block_hashes):
            # Sound bytes naming KV that is not all there: useless, and no bad file. (A
            # shared tier's is left to the replica that wrote it.)
            if not self.directory.shared:
                unlink_if_present(path)
                self._seen.pop(entry.name, None)
                self.index.mark_dirty(self.directory.sessions)
            self.index.count(incomplete_sessions=1)
            return None
        self.index.put_session(record, size)
        return record

    def _find_blocks(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            if not self.index.has_block(h):
                with contextlib.suppress(FileNotFoundError):
                    size = self.directory.block_path(h).stat().st_size
                    self.index.add_block(h, size)

    # -- a shared tier's look at what the other replicas did
    def rescan(self) -> tuple[list[SessionRecord], list[str]]:
        """Read the manifests written or replaced since the last look, and forget the sessions
        whose manifests are gone (a shared tier: the other replicas' saves, evictions and
        deletes) -> (sessions added or replaced, session ids removed)."""
        added: list[SessionRecord] = []
        removed: list[str] = []
        with self._mutate:
            with os.scandir(self.directory.sessions) as it:
                entries = {e.name: e for e in it if SESSION_NAME.fullmatch(e.name)}
            for name, entry in entries.items():
                try:
                    st = entry.stat(follow_symlinks=False)
                    mtime = (st.st_ino, st.st_mtime_ns)
                except FileNotFoundError:
                    continue
                seen = self._seen.get(name)
                if seen is not None and seen[0] == mtime:
                    continue
                record = self._read_manifest(entry)
                if record is not None:
                    added.append(record)
                elif seen is not None and self.index.has_session(seen[1]):
                    self.index.remove_session(seen[1])  # replaced by one that is no good
                    removed.append(seen[1])
            for name in [n for n in self._seen if n not in entries]:
                _mtime, session_id = self._seen.pop(name)
                if self.index.has_session(session_id):
                    for h in self.index.remove_session(session_id):
                        if not os.path.lexists(self.directory.block_path(h)):
                            self.index.forget_block(h)
                    removed.append(session_id)
        return added, removed
