"""Private Unix sockets and the runtime directory that holds them.

The station's socket and the supervisor's control socket both let whoever connects drive
the daemon, so both are created the same way: inside a 0700 runtime directory, bound under
umask 0o177 so the socket is 0600 from birth. There is no window in which another user
could connect.

Resource handling: ``listen_private`` closes the socket if binding or listening fails and
always restores the umask. ``remove_socket`` removes only the file this process bound.
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


def listen_private(path: Path, backlog: int) -> socket.socket:
    """A non-blocking Unix socket listening at ``path``, mode 0600 from the start."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is born 0600: no window for other users
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, 0o600)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    return sock


def bind_socket(path: Path) -> socket.socket:
    """Listen at ``path`` in a 0700 dir, replacing a stale socket file, refusing other files."""
    prepare_runtime_dir(path.parent)
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
        else:
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    except FileNotFoundError:
        pass
    return listen_private(path, 128)


def remove_socket(path: Path, inode: int) -> None:
    """Remove our socket file, unless a newer process already replaced it."""
    try:
        if path.stat().st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass
