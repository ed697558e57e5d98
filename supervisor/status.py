"""The published status file and ``gnosis-daemon status``.

The supervisor writes ``settings.status_file`` (``status.json`` in the 0700 runtime dir) on
every state change and periodically. Writes are atomic: a temp file in the same directory,
fsync'd, then ``os.replace``, so a reader sees the old document or the new one, never half.

Shape (``status --json`` prints it as is)::

    {"version": 1, "updated_at": <unix time>,
     "supervisor": {"pid", "state": starting|running|degraded|refused|stopping|stopped|fatal,
                    "started_at", "ready", "fatal", "refused": {...} | null},
     "children": {"station": {"state", "pid", "restarts", "fast_failures", "uptime_s",
                              "started_at", "backoff_remaining_s", "last_exit",
                              "capabilities": {flag: true}, "health": {...},
                              "kv_tier": {...} | null, "refused": {...} | null},
                  "host":    {... "capabilities": {"liquid_memory", ...}, "health": {...}}}}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from gnosis_daemon.atomic_files import write_json

STATUS_VERSION = 1


class StatusUnavailable(Exception):
    """No status to show: the message says why (no file, unreadable, supervisor gone)."""


def write_status(path: str | os.PathLike[str], document: dict[str, Any]) -> None:
    """Replace ``path`` with ``document`` atomically (temp file + fsync + os.replace)."""
    write_json(path, document)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and looks like a gnosis-daemon process (pid reuse guard)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user (e.g. the service user)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc here: the signal check is all we have
    return b"gnosis" in cmdline


def read_status(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise StatusUnavailable(
            f"no status file at {path}: the supervisor is not running with this runtime dir "
            f"(start it with `gnosis-daemon run`, or pass the same --runtime-dir)") from None
    except PermissionError:
        raise StatusUnavailable(f"cannot read {path}: run as the service user") from None
    except (OSError, ValueError) as exc:
        raise StatusUnavailable(f"cannot read status file {path}: {exc}") from None
    if not isinstance(document, dict) or "supervisor" not in document:
        raise StatusUnavailable(f"status file {path} is not a gnosis-daemon status document")
    return document


def load_live_status(path: str | os.PathLike[str]) -> dict[str, Any]:
    document = read_status(path)
    sup = document.get("supervisor") or {}
    pid = sup.get("pid")
    if not isinstance(pid, int) or not pid_alive(pid):
        raise StatusUnavailable(
            f"the supervisor is not running (pid {pid} in {path} is gone; last state "
            f"{sup.get('state')!r}, written {_ago(document.get('updated_at'))})")
    return document


def _ago(when: Any) -> str:
    if not isinstance(when, (int, float)):
        return "at an unknown time"
    return f"{max(0.0, time.time() - when):.0f} s ago"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def _flags(child: dict[str, Any]) -> str:
    caps = child.get("capabilities") or {}
    if not caps:
        return "-"
    parts = []
    for key, value in sorted(caps.items()):
        if value is True:
            parts.append(key)
        elif value is False:
            parts.append(f"{key}=off")
        elif value not in (None, ""):
            parts.append(f"{key}={value}")
    return ",".join(parts) or "-"


def render(document: dict[str, Any]) -> str:
    sup = document.get("supervisor") or {}
    lines = [f"supervisor pid {sup.get('pid')}  state {sup.get('state')}  "
             f"updated {_ago(document.get('updated_at'))}"]
    header = ("CHILD", "STATE", "PID", "RESTARTS", "UPTIME_S", "LAST EXIT", "CAPABILITIES")
    rows = [header]
    children = document.get("children") or {}
    order = [n for n in ("station", "host") if n in children] + sorted(
        n for n in children if n not in ("station", "host"))
    for name in order:
        child = children[name]
        last = child.get("last_exit") or None
        if last:
            how = (f"signal {last.get('signal_name') or last.get('signal')}"
                   if last.get("signal") is not None else f"code {last.get('code')}")
            if last.get("reason"):
                how += f" ({last['reason']})"
            how += f" {_ago(last.get('at'))}"
        else:
            how = "-"
        rows.append((name, _fmt(child.get("state")), _fmt(child.get("pid")),
                     _fmt(child.get("restarts")), _fmt(child.get("uptime_s")), how, _flags(child)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    lines.extend(_refusal_lines(sup.get("refused")))
    lines.extend(_kv_tier_lines((children.get("station") or {}).get("kv_tier")))
    return "\n".join(lines)


def _refusal_lines(refusal: Any) -> list[str]:
    """A station that refuses its model, loudly: it is not restarted until someone acts."""
    if not isinstance(refusal, dict):
        return []
    reason = refusal.get("message") or refusal.get("reason")
    lines = [f"STATION REFUSED ITS MODEL (not restarted): {reason}"]
    detail = [f"{key} {refusal[key]}" for key in ("model", "model_type", "kind", "at")
              if refusal.get(key)]
    if detail:
        lines.append("  " + ", ".join(detail))
    lines.append("  serve another model (--model) or a build that implements it, then restart "
                 "the daemon (or `gnosis-daemon restart station`)")
    return lines


def _kv_tier_lines(tier: Any) -> list[str]:
    """The KV tiers' fill (the pool, the disk), and loudly what needs an operator: files
    quarantined, a disk tier that could not be opened, an old tier left unread."""
    if not isinstance(tier, dict):
        return []
    pool = (f"pool {_fmt(tier.get('pool_sessions'))} sessions "
            f"({_fmt(tier.get('pool_pinned_blocks'))} of {_fmt(tier.get('pool_blocks'))} blocks pinned)")
    lines = []
    if tier.get("enabled") is False:
        lines.append(f"kv tiers: {pool}; disk off (kv_persistence = false)")
        if tier.get("legacy"):
            lines.append(f"  an earlier version's tier is kept, not read: {tier['legacy']}")
        return lines
    if tier.get("error"):
        lines.append(f"kv tiers: {pool}; DISK TIER UNAVAILABLE at {tier.get('path')}: {tier['error']}")
    else:
        lag = tier.get("write_behind_lag_ms_p99")
        host = (f"host {_size(tier['host_bytes'])} of {_size(tier.get('host_budget_bytes'))}"
                f"{' pinned' if tier.get('host_pinned') else ''}; " if "host_bytes" in tier else "")
        lines.append(
            f"kv tiers: {pool}; {host}disk {_fmt(tier.get('disk_sessions'))} sessions, "
            f"{_size(tier.get('disk_bytes'))} of {_size(tier.get('disk_budget_bytes'))} "
            f"at {tier.get('path')}, write-behind lag p99 "
            f"{'-' if lag is None else f'{lag:.0f} ms'}")
    if tier.get("io_down"):
        lines.append(f"  DISK TIER DOWN: {tier['io_down']} (sessions live in the pool only; "
                     f"restart the station to bring it back)")
    reasons = tier.get("quarantine_reasons")
    if tier.get("quarantined"):
        detail = ", ".join(f"{k} {v}" for k, v in sorted((reasons or {}).items()))
        lines.append(f"  QUARANTINED {tier['quarantined']} file(s) ({detail}): kept intact in "
                     f"{tier.get('path')}/quarantine; inspect, then delete them")
    if tier.get("quarantine_kept") or tier.get("quarantine_deleted"):
        why = ", ".join(f"{k} {v}" for k, v in sorted((tier.get("quarantine_kept_reasons") or {}).items()))
        lines.append(f"  quarantine keeps {tier.get('quarantine_kept') or 0} file(s) ({why or '-'}), "
                     f"{_size(tier.get('quarantine_kept_bytes'))} of "
                     f"{_size(tier.get('quarantine_budget_bytes'))}; "
                     f"{tier.get('quarantine_deleted') or 0} deleted past its budget")
    if tier.get("disk_full"):
        lines.append(f"  DISK FULL {tier['disk_full']} time(s): {tier.get('disk_full_evicted') or 0} "
                     f"session(s) evicted to make room; free space or lower kv_disk_bytes")
    if tier.get("root_lost"):
        lines.append(f"  TIER DIRECTORY DELETED {tier['root_lost']} time(s) while serving: recreated, "
                     f"{tier.get('root_lost_sessions') or 0} session(s) lost")
    if tier.get("write_error"):
        lines.append(f"  last disk error: {tier['write_error']}")
    if tier.get("other_layouts"):
        lines.append(f"  set aside, untouched (another kv_block_size or KV layout): "
                     f"{', '.join(tier['other_layouts'])}")
    if tier.get("lost"):
        lines.append(f"  {tier['lost']} session(s) evicted before the write-behind reached disk")
    if tier.get("legacy"):
        lines.append(f"  an earlier version's tier is kept, not read: {tier['legacy']}")
    return lines


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def show(settings: Any, as_json: bool = False, out: TextIO | None = None) -> int:
    """``gnosis-daemon status``: 0 and the status, or 1 and why there is none."""
    out = out or sys.stdout
    try:
        document = load_live_status(settings.status_file)
    except StatusUnavailable as exc:
        print(f"gnosis-daemon: {exc}", file=sys.stderr)
        return 1
    if as_json:
        out.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
    else:
        out.write(render(document) + "\n")
    return 0
