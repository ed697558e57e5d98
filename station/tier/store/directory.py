"""Where a KV store's files are: its layout's directory in the model's tier, the three
directories under it, and the lock that says which store has it open.

``root`` is the layout's directory (``station.tier.store.layouts.layout_root``): the model
directory itself for the layout that claimed it, else ``layouts/<tag>`` in it. A private
store takes the lock exclusively, a fleet's shared one shares it (so a private store still
cannot open a shared root, nor the reverse). A root deleted while the store has it open is
made again by ``recreate``, the lock taken anew on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from station.core.block_pool import BlockHash
from station.tier.format import KVLayout, KVStoreError, block_relpath, session_name
from station.tier.store.layouts import layout_root


class StoreBusy(KVStoreError):
    """Another store (another station process) has this root open."""


class StoreDirectory:
    """The store's root and lock; ``root`` moves only in ``recreate``."""

    def __init__(self, model_dir: Path, layout: KVLayout, shared: bool) -> None:
        self.model_dir, self.layout, self.shared = model_dir, layout, shared
        self.root, self.other_layouts = layout_root(model_dir, layout)
        self._lock_fd: int | None = None

    @property
    def blocks(self) -> Path:
        return self.root / "blocks"

    @property
    def sessions(self) -> Path:
        return self.root / "sessions"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def block_path(self, block_hash: BlockHash) -> Path:
        return self.blocks / block_relpath(block_hash)  # checks the hash

    def session_path(self, session_id: str) -> Path:
        return self.sessions / session_name(session_id)

    def lock(self) -> None:
        """Take the root (0700, made if missing); ``StoreBusy`` if another store has it."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        fd = self._flock()
        if fd is None:
            raise StoreBusy(f"{self.root} is open in another store"
                            + (" (a private one)" if self.shared else ""))
        self._lock_fd = fd

    def _flock(self) -> int | None:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # Two private stores on one root would delete each other's temp files at open;
            # shared stores spare the fresh ones, and share the lock.
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def close(self) -> None:
        """Release the root (the kernel does it too when the process dies)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def gone(self) -> bool:
        """A tier directory is not there (a volume that fails to answer is not gone)."""
        for d in (self.blocks, self.sessions):
            try:
                os.stat(d)
            except FileNotFoundError:
                return True
            except OSError:
                return False
        return False

    def recreate(self) -> None:
        """Make the root and its directories again, and take the lock on the new root (kept
        on the old one if another store took the new root first)."""
        self.root, self.other_layouts = layout_root(self.model_dir, self.layout)
        for d in (self.blocks, self.sessions, self.quarantine):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = self._flock()
        if fd is not None:
            self.close()
            self._lock_fd = fd


def unlink_if_present(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
