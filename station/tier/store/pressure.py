"""The KV store under pressure (a mixin of ``station.tier.store.store.KVStore``): which
session its budget evicts, a full filesystem, and a tier directory deleted under it.

**Which session goes.** The disk keeps the pool's rule between tenants
(``kv_session_tenant_share``, ``station.core.sessions``): a tenant is *over its share* when
its manifests and the distinct blocks they name take more than ``share * budget`` bytes.
The victim is the writing tenant's own least recently used session when that tenant is
over its share; else the least recently used session of any tenant over its share; only
when none is over, the least recently used session of all. So one tenant's flood of new
sessions evicts its own, and a tenant under its share never loses a session on disk to a
tenant over it.

**A full filesystem** (``ENOSPC``, or ``EDQUOT``) is budget pressure the budget did not
foresee: the write's least recently used victim (by the same rule) is evicted and the write
tried again, until it fits or nothing is left to evict (``DiskFull``). Each failed attempt is
counted (``disk_full``), as is each session evicted for it (``disk_full_evicted``); the last
one is ``last_error``.

**A tier directory deleted while the store has it open** (by hand, a cleanup job, a volume
remounted empty) is recreated at the next write or within ``ROOT_CHECK_S``: the sessions
whose manifests are gone leave the index (``lost_sessions``, the station is told which) and
the lock is taken again on the new directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from pathlib import Path
from typing import Any, Sequence

from gnosis_daemon.logs import get_logger
from station.tier.format import KVStoreError, block_relpath, session_name, write_atomic
from station.tier.store.layouts import LAYOUT_FILE, layout_root

log = get_logger()

ROOT_CHECK_S = 2.0  # an idle writer looks for its directories this often
_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(KVStoreError):
    """The filesystem is full and the store has nothing left to evict for this write."""


class StorePressure:
    """Needs the store's ``index``, directories, ``disk_budget_bytes``, ``tenant_share``,
    ``_drop_session``, ``_mutate`` and ``_lock_fd`` (see ``KVStore``)."""

    # -- the share
    def _victim(self, tenant: str | None, keep: str | None = None,
                budget: int | None = None) -> tuple[str, bool] | None:
        """The session to evict next and whether its tenant was over its share."""
        records = [r for r in self.index.sessions_lru() if r.session_id != keep]
        if not records:
            return None
        limit = self.tenant_share * (self.disk_budget_bytes if budget is None else budget)
        owned = self.index.tenant_bytes()
        over = {t for t, n in owned.items() if n > limit}
        if tenant in over:
            mine = next((r for r in records if r.tenant == tenant), None)
            if mine is not None:
                return mine.session_id, True
        for record in records:
            if record.tenant in over:
                return record.session_id, True
        return records[0].session_id, False

    def _evict_one(self, tenant: str | None, keep: str | None = None,
                   budget: int | None = None) -> tuple[str, list[Any]] | None:
        choice = self._victim(tenant, keep, budget)
        if choice is None:
            return None
        session_id, over = choice
        blocks = self._drop_session(session_id)
        self.index.count(evicted_over_share=int(over))
        self._evicted_now.append(session_id)
        return session_id, blocks

    def take_evicted(self) -> list[str]:
        """Sessions evicted since the last call (the budget, a full disk), oldest first."""
        with self._mutate:
            evicted, self._evicted_now = self._evicted_now, []
            return evicted

    # -- a full filesystem, a deleted directory
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
                if exc.errno not in _FULL:
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
            if not self._gone():
                return False
            self.root, self.other_layouts = layout_root(self.model_dir, self.layout)
            for d in (self.blocks_dir, self.sessions_dir, self.quarantine_dir):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._relock()
            lost = [sid for sid in self.index.session_ids()
                    if not (self.sessions_dir / session_name(sid)).exists()]
            for sid in lost:
                self.index.remove_session(sid)
                self._seen.pop(session_name(sid), None)
            for h in self.index.block_hashes():
                if not (self.blocks_dir / block_relpath(h)).exists():
                    self.index.forget_block(h)
            self._forget_quarantine_gone()
            self.index.count(lost=1, lost_sessions=len(lost))
            self._lost_now.extend(lost)
            self.index.take_dirty()
            self.index.mark_dirty(self.root, self.root.parent)
            self.last_error = f"the tier's directory was gone: recreated, {len(lost)} session(s) lost"
            self.last_error_at = time.time()
            log.error("kv_store_root_recreated", root=str(self.root), lost_sessions=len(lost),
                      marker=(self.model_dir / LAYOUT_FILE).exists())
            return True

    def _gone(self) -> bool:
        """A tier directory is not there (a volume that fails to answer is not gone)."""
        for d in (self.blocks_dir, self.sessions_dir):
            try:
                os.stat(d)
            except FileNotFoundError:
                return True
            except OSError:
                return False
        return False

    def take_lost(self) -> list[str]:
        """Sessions whose files were found gone since the last call."""
        with self._mutate:
            lost, self._lost_now = self._lost_now, []
            return lost

    def _relock(self) -> None:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:  # another store took the new directory first: keep ours
            os.close(fd)
            return
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd = fd
