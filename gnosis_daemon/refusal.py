"""A station that refuses its model: the exit status and the refusal file (torch-free).

The station raises ``station.model.errors.ModelRefused`` at boot when the engine
cannot compute the model exactly (an attention kind it does not implement, a start check
whose paged logits disagree with the model's own forward). That is permanent for this model
and build, so it is told apart from a crash by two things every process can read without
torch:

- the exit status ``REFUSED_EXIT`` (78, sysexits' ``EX_CONFIG``): the supervisor does not
  restart a station that exits with it, and systemd's ``RestartPreventExitStatus=78`` does
  not restart a unit that does;
- the refusal file (``Settings.station_refusal_file``, ``<runtime_dir>/station-refused.json``,
  0600), written atomically just before that exit: the reason the supervisor publishes and
  the host's ``/health`` and 503s name. Shape::

      {"model_type": "mamba", "kind": "state_space", "reason": "...", "message": "...",
       "model": "/models/mamba-130m", "pid": 4243, "at": "2026-12-01T21:24:00Z"}

A station removes the file as soon as it starts (a stale one must never describe a station
that is loading or serving), and the supervisor removes it before every station spawn.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

from gnosis_daemon.atomic_files import write_json

# sysexits' EX_CONFIG: a station that refuses its model exits with it; never restarted.
REFUSED_EXIT = 78
# The fields every reader may rely on (a file missing one is completed with these names).
FIELDS = ("model_type", "kind", "reason", "message", "model", "pid", "at")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_refusal(path: str | os.PathLike[str], refusal: Mapping[str, Any], *, model: str,
                  pid: int | None = None) -> dict[str, Any]:
    """Write the refusal file atomically (temp file in the same directory, fsync, rename;
    the directory is created 0700 when the station got no further than its boot). Returns
    the document written."""
    from gnosis_daemon.unix_sockets import prepare_runtime_dir

    path = Path(path)
    document = {**dict(refusal), "model": model, "pid": os.getpid() if pid is None else pid,
                "at": utc_now()}
    prepare_runtime_dir(path.parent)
    write_json(path, document)
    return document


def read_refusal(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The refusal file's document, or None when there is none (or it is not one: a file
    that cannot be read or parsed says nothing reliable about a refusal)."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or not document.get("reason"):
        return None
    return {key: document.get(key) for key in FIELDS} | document


def clear_refusal(path: str | os.PathLike[str]) -> bool:
    """Remove a refusal file; True when there was one."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def describe(refusal: Mapping[str, Any]) -> str:
    """One line for logs, ``STATUS=`` and error messages."""
    return str(refusal.get("message") or
               f"model type {refusal.get('model_type')!r} refused: {refusal.get('reason')}")
