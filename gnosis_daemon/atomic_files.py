"""A JSON document written so that a reader never sees half of it: a temp file in the same
directory, fsynced, given its mode, then renamed over the old one (status files, the
station's refusal, the start check's record)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike[str], document: Any, mode: int = 0o600) -> None:
    """Replace ``path`` with ``document`` atomically (temp file + fsync + os.replace)."""
    path = Path(path)
    data = json.dumps(document, indent=2, sort_keys=True, default=str).encode() + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
