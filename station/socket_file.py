"""The station's socket file: a private runtime directory, a socket that is 0600 from birth.

Resource handling: the runtime directory is forced to mode 0700 and the socket is bound
under umask 0o177, so there is no window in which another user could connect. A stale
socket left by a dead station is replaced; anything else at that path is refused.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path


def prepare_runtime_dir(path: Path) -> None:
    """Create the runtime dir as 0700 (and force 0700 on one we own that already exists)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"runtime dir {path} belongs to uid {info.st_uid}, not us")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def bind_socket(path: Path) -> socket.socket:
    """Bind a listening Unix socket at ``path`` as 0600 (a stale file is removed first)."""
    prepare_runtime_dir(path.parent)
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
        else:
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is born 0600: no window for other users
    try:
        sock.bind(os.fspath(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def remove_socket(path: Path, inode: int) -> None:
    """Remove our socket file, unless a newer station already replaced it."""
    try:
        if path.stat().st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass
