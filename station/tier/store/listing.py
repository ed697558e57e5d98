"""The KV store's listings (a mixin of ``station.tier.store.store.KVStore``): the index
built from the directory's names at open, quarantine, and on a fleet's shared tier the
rescan that learns what the other replicas wrote or removed since."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

from gnosis_daemon.logs import get_logger
from station.core.block_pool import BlockHash
from station.tier.format import (
    BLOCK_DIR, BLOCK_NAME, HASH_BYTES, SESSION_NAME, TMP_SUFFIX, Missing, Quarantined,
    SessionRecord, Unreadable, block_relpath, decode_session, write_atomic,
)

log = get_logger()

QUARANTINE_REASONS = "quarantine.json"  # beside quarantine/: kept file name -> reason
STALE_S = 600.0  # shared tier: another replica's temp file or unnamed block is this old at most


def _size_of(path: Path, st: os.stat_result | None = None) -> int:
    """A quarantined file's bytes (a directory's: its files')."""
    try:
        st = st or path.stat(follow_symlinks=False)
        if not path.is_dir() or path.is_symlink():
            return st.st_size
        return sum(p.stat(follow_symlinks=False).st_size for p in path.rglob("*"))
    except OSError:
        return 0


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _is_tmp(entry: os.DirEntry[str]) -> bool:
    return entry.name.endswith(TMP_SUFFIX) and not entry.is_dir(follow_symlinks=False)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _stale_path(shared: bool, entry: os.DirEntry[str] | Path) -> bool:
    """A temp file (or an unnamed block) that no write in progress can own: any, in a
    private store; one older than ``STALE_S`` in a shared one."""
    if not shared:
        return True
    try:
        mtime = entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return False  # gone meanwhile: nothing to remove
    return time.time() - mtime > STALE_S


class StoreListing:
    """Needs the store's ``root`` directories, ``layout``, ``index``, ``shared``, ``_seen``
    and ``_mutate`` (see ``KVStore``)."""

    def _open(self) -> None:
        started = time.monotonic()
        for d in (self.blocks_dir, self.sessions_dir, self.quarantine_dir):
            with contextlib.suppress(FileExistsError):
                d.mkdir(mode=0o700)
                self.index.mark_dirty(self.root)
        self._list_quarantine()
        # Each listing is taken whole before its entries are removed or moved.
        with os.scandir(self.blocks_dir) as it:
            subdirs = sorted(it, key=lambda e: e.name)
        for sub in subdirs:
            if sub.is_dir(follow_symlinks=False) and BLOCK_DIR.fullmatch(sub.name):
                with os.scandir(sub.path) as it:
                    entries = list(it)
                for entry in entries:
                    self._index_block(sub.name, entry)
            else:
                self._quarantine(Path(sub.path), Quarantined("name", "not a block directory"))
        with os.scandir(self.sessions_dir) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            self._index_session(entry)
        stats = self.index.stats()
        log.info("kv_store_opened", root=str(self.root), blocks=stats["blocks"],
                 sessions=stats["sessions"], bytes=stats["bytes"],
                 quarantined=stats["quarantined_total"],
                 incomplete=stats["incomplete_sessions"], tmp_removed=stats["tmp_removed"],
                 ms=round((time.monotonic() - started) * 1000, 1))

    def _stale(self, entry: os.DirEntry[str] | Path) -> bool:
        return _stale_path(self.shared, entry)

    def _remove_tmp(self, entry: os.DirEntry[str]) -> None:
        if self._stale(entry):  # a write cut short: never trusted, never read
            _unlink(Path(entry.path))
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
            self._quarantine(Path(entry.path), Quarantined("name", "not a block file name"))

    def _index_session(self, entry: os.DirEntry[str]) -> None:
        path = Path(entry.path)
        if _is_tmp(entry):
            self._remove_tmp(entry)
            return
        if not SESSION_NAME.fullmatch(entry.name):
            self._quarantine(path, Quarantined("name", "not a session file name"))
            return
        self._read_manifest(entry)

    def _read_manifest(self, entry: os.DirEntry[str]) -> SessionRecord | None:
        """Index the session of one manifest -> its record (None: bad, gone or incomplete)."""
        path = Path(entry.path)
        try:
            st = entry.stat(follow_symlinks=False)
            mtime = (st.st_ino, st.st_mtime_ns)
            record, size = decode_session(path, self.layout)
        except Quarantined as exc:
            self._quarantine(path, exc)
            return None
        except FileNotFoundError:
            return None  # another replica removed it meanwhile
        except (Missing, Unreadable) as exc:
            log.warning("kv_store_session_unreadable", file=entry.name, error=str(exc))
            return None
        self._seen[entry.name] = (mtime, record.session_id)
        if self.shared:  # blocks written after the start's listing of blocks/
            self._find_blocks(record.block_hashes)
        if self.index.count_missing(record.block_hashes):
            # Sound bytes naming KV that is not all there: useless, and no bad file. (A
            # shared tier's is left to the replica that wrote it.)
            if not self.shared:
                _unlink(path)
                self._seen.pop(entry.name, None)
                self.index.mark_dirty(self.sessions_dir)
            self.index.count(incomplete_sessions=1)
            return None
        self.index.put_session(record, size)
        return record

    def _find_blocks(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            if not self.index.has_block(h):
                with contextlib.suppress(FileNotFoundError):
                    size = (self.blocks_dir / block_relpath(h)).stat().st_size
                    self.index.add_block(h, size)

    def rescan(self) -> tuple[list[SessionRecord], list[str]]:
        """Read the manifests written or replaced since the last look, and forget the sessions
        whose manifests are gone (a shared tier: the other replicas' saves, evictions and
        deletes) -> (sessions added or replaced, session ids removed)."""
        added: list[SessionRecord] = []
        removed: list[str] = []
        with self._mutate:
            with os.scandir(self.sessions_dir) as it:
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
                        if not os.path.lexists(self.blocks_dir / block_relpath(h)):
                            self.index.forget_block(h)
                    removed.append(session_id)
        return added, removed

    # -- quarantine: damaged files kept intact, under a budget of their own
    def _list_quarantine(self) -> None:
        """The files an earlier run quarantined, oldest first (a rename sets the ctime)."""
        kept = []
        with os.scandir(self.quarantine_dir) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    kept.append((st.st_ctime_ns, Path(entry.path), _size_of(Path(entry.path), st)))
        reasons = self._read_reasons()
        self._kept = {path: (size, reasons.get(path.name, "earlier")) for _t, path, size in sorted(kept)}
        if self._trim_quarantine():  # a smaller budget than the last run's
            self._save_reasons()

    def _read_reasons(self) -> dict[str, str]:
        """``quarantine.json``: why each kept file was quarantined, as the runs that did it
        wrote (a file it does not name is ``earlier``)."""
        try:
            raw = json.loads((self.root / QUARANTINE_REASONS).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(raw, dict):
            return {}
        return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}

    def _save_reasons(self) -> None:
        data = json.dumps({p.name: r for p, (_size, r) in self._kept.items()}, sort_keys=True)
        try:
            write_atomic(self.root / QUARANTINE_REASONS, [data.encode()])
        except OSError as exc:  # the reasons are a courtesy: the files are what is kept
            log.warning("kv_store_quarantine_reasons_unsaved", error=str(exc))

    def _forget_quarantine_gone(self) -> None:
        self._kept = {p: v for p, v in self._kept.items() if os.path.lexists(p)}

    def quarantine_stats(self) -> dict[str, object]:
        kept = list(self._kept.values())  # one step under the GIL: the loader may quarantine
        reasons: dict[str, int] = {}
        for _size, reason in kept:
            reasons[reason] = reasons.get(reason, 0) + 1
        return {"quarantine_kept": len(kept), "quarantine_kept_reasons": reasons,
                "quarantine_kept_bytes": sum(size for size, _r in kept),
                "quarantine_budget_bytes": self.quarantine_budget_bytes}

    def _trim_quarantine(self) -> bool:
        """Past ``quarantine_budget_bytes``, delete the oldest quarantined files (counted);
        -> whether any went."""
        trimmed = False
        while self._kept and sum(size for size, _r in self._kept.values()) > self.quarantine_budget_bytes:
            path, (size, reason) = next(iter(self._kept.items()))
            del self._kept[path]
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else os.unlink(path)
            self.index.count(quarantine_deleted=1)
            self.index.mark_dirty(self.quarantine_dir)
            log.warning("kv_store_quarantine_deleted", file=path.name, bytes=size, reason=reason,
                        budget_bytes=self.quarantine_budget_bytes)
            trimmed = True
        return trimmed

    def _quarantine(self, path: Path, exc: Quarantined) -> Quarantined:
        """Move ``path`` intact to quarantine/ and count it; returns ``exc``."""
        with self._mutate:
            base = self.quarantine_dir / f"{path.name}.{_utc_stamp()}"
            target, n = base, 0
            while os.path.lexists(target):  # os.rename would replace it silently
                n += 1
                target = base.with_name(f"{base.name}-{n}")
            try:
                os.rename(path, target)
                exc.moved_to = target
                self._kept[target] = (_size_of(target), exc.reason)
            except FileNotFoundError:
                pass  # evicted meanwhile: nothing left to keep
            except OSError as err:
                log.error("kv_store_quarantine_failed", file=path.name, error=str(err))
            self.index.count_quarantined(exc.reason)
            self.index.mark_dirty(path.parent, self.quarantine_dir)
            self._trim_quarantine()
            if exc.moved_to is not None:
                self._save_reasons()
        log.warning("kv_store_quarantined", file=path.name, reason=exc.reason,
                    detail=exc.detail, moved_to=str(exc.moved_to) if exc.moved_to else None)
        return exc
