"""Stored ``/v1/responses``: each response's text record, on disk, per tenant.

A record is what a follow-up's ``previous_response_id`` needs to rebuild the conversation
as chat messages (its input messages, instructions, output text, the previous response's
id), plus its tenant, creation time and the KV session its conversation was saved under.
The KV itself lives in the station (a session the disk tier writes behind); the record is
the text, so a host restart, a station restart or an evicted session still leaves a chain
that can be rebuilt (a miss then, never a wrong answer).

Records live under ``<state_dir>/responses/<digest of the tenant>/<response id>.json``,
each written atomically (``gnosis_daemon.atomic_files``: a reader never sees half of one).
Per tenant they are bounded (``responses_max_per_tenant``: the least recently used, by file
mtime, which a read refreshes, are deleted past it) and expire ``responses_ttl_s`` after
they were created. Another tenant's id reads as missing: the directory is the tenant's.
The calls do blocking file I/O; the API runs them in a worker thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gnosis_daemon.atomic_files import write_json

# resp_ and hex: what this host makes (``new_id``); anything else is never a file name here.
_ID = re.compile(r"resp_[0-9a-f]{32,64}")
RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    """One stored response (its JSON file's fields)."""

    id: str
    tenant: str
    created_at: int  # unix seconds
    model: str
    instructions: str | None
    input: list[dict[str, Any]]  # this turn's input as chat messages ({role, content})
    output_text: str
    previous_response_id: str | None
    session_id: str | None  # the KV session of prompt + output (None: not saved)
    status: str = "completed"
    usage: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    extra: dict[str, Any] | None = None  # the answer's other fields, echoed by GET

    def to_json(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: Any) -> ResponseRecord | None:
        """The record of a file's document; None for one this version cannot read."""
        if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION:
            return None
        fields = {k: v for k, v in doc.items() if k != "version"}
        try:
            return cls(**fields)
        except TypeError:
            return None


def new_id() -> str:
    return "resp_" + os.urandom(24).hex()


def valid_id(response_id: str) -> bool:
    return _ID.fullmatch(response_id) is not None


def _tenant_dir(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


class ResponseStore:
    """The records of every tenant under ``root`` (``<state_dir>/responses``)."""

    def __init__(self, root: Path, max_per_tenant: int, ttl_s: float) -> None:
        assert max_per_tenant > 0 and ttl_s > 0
        self.root = root
        self.max_per_tenant = max_per_tenant
        self.ttl_s = ttl_s

    def path(self, tenant: str, response_id: str) -> Path:
        assert valid_id(response_id), response_id
        return self.root / _tenant_dir(tenant) / f"{response_id}.json"

    def put(self, record: ResponseRecord) -> list[ResponseRecord]:
        """Store ``record``; returns the records this deleted (expired, or past the bound)
        so the caller can drop their KV sessions too."""
        directory = self.root / _tenant_dir(record.tenant)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json(self.path(record.tenant, record.id), record.to_json())
        return self._trim(record.tenant, directory, keep=record.id)

    def get(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """The tenant's record, None when missing, expired or another tenant's. A read is a
        use: it keeps the record from the LRU bound."""
        if not valid_id(response_id):
            return None
        path = self.path(tenant, response_id)
        record = self._read(path)
        if record is None or record.tenant != tenant:
            return None
        if self._expired(record):
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)
        except FileNotFoundError:  # deleted meanwhile
            return None
        return record

    def chain(self, tenant: str, response_id: str) -> list[ResponseRecord] | None:
        """The records from the first turn to ``response_id``, oldest first; None when
        ``response_id`` is missing. A link that is gone ends the chain there (the
        conversation as far back as is still kept)."""
        last = self.get(tenant, response_id)
        if last is None:
            return None
        records, seen = [last], {last.id}
        while records[-1].previous_response_id and len(records) <= self.max_per_tenant:
            before = self.get(tenant, records[-1].previous_response_id)
            if before is None or before.id in seen:
                break
            records.append(before)
            seen.add(before.id)
        return records[::-1]

    def delete(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """Delete the tenant's record; it is returned (None when there was none)."""
        record = self.get(tenant, response_id)
        if record is not None:
            self.path(tenant, response_id).unlink(missing_ok=True)
        return record

    def count(self, tenant: str) -> int:
        directory = self.root / _tenant_dir(tenant)
        return len(list(directory.glob("resp_*.json"))) if directory.is_dir() else 0

    def _read(self, path: Path) -> ResponseRecord | None:
        try:
            return ResponseRecord.from_json(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None

    def _expired(self, record: ResponseRecord) -> bool:
        return time.time() - record.created_at > self.ttl_s

    def _trim(self, tenant: str, directory: Path, keep: str) -> list[ResponseRecord]:
        """Delete the tenant's records untouched for ``ttl_s`` (so expired: a record is
        never used after it expires), then its least recently used past the bound. An
        expired record used since is found by ``get``."""
        entries = []
        for path in directory.glob("resp_*.json"):
            try:
                entries.append((path.stat().st_mtime, path))
            except FileNotFoundError:
                continue
        entries.sort()
        dropped = []
        over = len(entries) - self.max_per_tenant
        stale = time.time() - self.ttl_s
        for mtime, path in entries:
            if over <= 0 and mtime >= stale:
                break  # the rest are newer
            if path.stem == keep:
                continue
            record = self._read(path)
            path.unlink(missing_ok=True)
            over -= 1
            if record is not None and record.tenant == tenant:
                dropped.append(record)
        return dropped
