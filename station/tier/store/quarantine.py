"""The KV store's quarantine: files that failed a check, moved aside byte for byte and kept
under a budget of their own (the oldest deleted first, counted).

Layout under the store's root::

    quarantine/<original name>.<UTC time>   files that failed a check, moved intact
    quarantine.json                          why each file in quarantine/ is there

A damaged file is kept, never deleted by the store's other work: it is evidence.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

from gnosis_daemon.logs import get_logger
from station.tier.format import Quarantined, write_atomic
from station.tier.store.directory import StoreDirectory
from station.tier.store.index import StoreIndex

log = get_logger()

QUARANTINE_REASONS = "quarantine.json"  # beside quarantine/: kept file name -> reason


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


class Quarantine:
    """The files kept in quarantine/ (path -> bytes and why), oldest first. Every change
    holds ``mutate``, the store's lock for changes on disk."""

    def __init__(self, directory: StoreDirectory, index: StoreIndex, budget_bytes: int,
                 mutate: threading.RLock) -> None:
        self.directory, self.index, self.budget_bytes = directory, index, budget_bytes
        self._mutate = mutate
        self._kept: dict[Path, tuple[int, str]] = {}

    def list_kept(self) -> None:
        """The files an earlier run quarantined, oldest first (a rename sets the ctime)."""
        kept = []
        with os.scandir(self.directory.quarantine) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    kept.append((st.st_ctime_ns, Path(entry.path), _size_of(Path(entry.path), st)))
        reasons = self._read_reasons()
        self._kept = {path: (size, reasons.get(path.name, "earlier")) for _t, path, size in sorted(kept)}
        if self._trim():  # a smaller budget than the last run's
            self._save_reasons()

    def keep(self, path: Path, exc: Quarantined) -> Quarantined:
        """Move ``path`` intact to quarantine/ and count it; returns ``exc``."""
        with self._mutate:
            base = self.directory.quarantine / f"{path.name}.{_utc_stamp()}"
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
            self.index.mark_dirty(path.parent, self.directory.quarantine)
            self._trim()
            if exc.moved_to is not None:
                self._save_reasons()
        log.warning("kv_store_quarantined", file=path.name, reason=exc.reason,
                    detail=exc.detail, moved_to=str(exc.moved_to) if exc.moved_to else None)
        return exc

    def forget_gone(self) -> None:
        """Drop the kept files that are no longer there (their directory was deleted)."""
        self._kept = {p: v for p, v in self._kept.items() if os.path.lexists(p)}

    def stats(self) -> dict[str, object]:
        kept = list(self._kept.values())  # one step under the GIL: the loader may quarantine
        reasons: dict[str, int] = {}
        for _size, reason in kept:
            reasons[reason] = reasons.get(reason, 0) + 1
        return {"quarantine_kept": len(kept), "quarantine_kept_reasons": reasons,
                "quarantine_kept_bytes": sum(size for size, _r in kept),
                "quarantine_budget_bytes": self.budget_bytes}

    def _read_reasons(self) -> dict[str, str]:
        """``quarantine.json``: why each kept file was quarantined, as the runs that did it
        wrote (a file it does not name is ``earlier``)."""
        try:
            raw = json.loads((self.directory.root / QUARANTINE_REASONS).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(raw, dict):
            return {}
        return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}

    def _save_reasons(self) -> None:
        data = json.dumps({p.name: r for p, (_size, r) in self._kept.items()}, sort_keys=True)
        try:
            write_atomic(self.directory.root / QUARANTINE_REASONS, [data.encode()])
        except OSError as exc:  # the reasons are a courtesy: the files are what is kept
            log.warning("kv_store_quarantine_reasons_unsaved", error=str(exc))

    def _trim(self) -> bool:
        """Past the budget, delete the oldest quarantined files (counted); -> whether any went."""
        trimmed = False
        while self._kept and sum(size for size, _r in self._kept.values()) > self.budget_bytes:
            path, (size, reason) = next(iter(self._kept.items()))
            del self._kept[path]
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else os.unlink(path)
            self.index.count(quarantine_deleted=1)
            self.index.mark_dirty(self.directory.quarantine)
            log.warning("kv_store_quarantine_deleted", file=path.name, bytes=size, reason=reason,
                        budget_bytes=self.budget_bytes)
            trimmed = True
        return trimmed
