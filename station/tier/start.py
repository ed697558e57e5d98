"""The disk tier at the station's start, and how it is reported.

``open_tier`` opens ``<state_dir>/kv-tier/<model>`` in the tier's I/O process and puts it
behind the engine's pool (``station.tier.disk_tier.DiskTier``); ``tier_report`` is the ``kv_tier`` object of
``hello``, ``health`` and ``stats``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gnosis_daemon.logs import get_logger
from station.core.block_pool import block_hashes_for, hash_block
from station.core.disk_sessions import DiskSession
from station.tier.io.process import KVIOProcess, TierOpenFailed
from station.tier.slots import tier_slots

log = get_logger(__name__)


def tier_root(state_dir: Path, fingerprint: str, shared_dir: str = "") -> Path:
    """``<state_dir>/kv-tier/<first 16 hex of the model fingerprint>``, or
    ``<shared_dir>/<first 16 hex>`` for a tier a fleet shares: the model's directory, in
    which the store finds its KV layout's (``station.tier.store.layouts``; the report's ``path``)."""
    if shared_dir:
        return Path(shared_dir) / fingerprint[:16]
    return state_dir / "kv-tier" / fingerprint[:16]


RISE_SHARE = 0.25  # of kv_write_behind_s: a save younger than that is written at kv_io_nice
_BUSY_WAIT_S = 10.0  # a station that just died may leave its I/O process finishing a job


def open_tier(engine: Any, settings: Any, io: KVIOProcess | None = None) -> dict[str, Any]:
    """Open ``<state_dir>/kv-tier`` in the I/O process (``io``, started here if not given)
    and put it behind the engine's pool (before the engine runs). Never raises for what is
    on disk: bad files are quarantined by the store; a store that cannot be opened at all
    leaves the station without a disk tier, and the report (``hello``'s ``kv_tier``) says why."""

    # One directory per model: another model's tier is never read, evicted or deleted, and
    # switching models back finds it whole. Files of another model found in this one (copied
    # in by hand) are quarantined on read like any other bad file.
    shared = bool(settings.kv_shared_dir)
    root = tier_root(settings.effective_state_dir, engine.loaded.fingerprint, settings.kv_shared_dir)
    report: dict[str, Any] = {"path": str(root), "enabled": bool(settings.kv_persistence),
                              "shared": shared, "error": None}
    legacy = settings.effective_state_dir / "kv-sessions"
    if legacy.exists():  # the clean-stop-only tier of earlier versions: kept, not read
        report["legacy"] = str(legacy)
    if not settings.kv_persistence:
        if io is not None:
            io.abandon()
        return report
    shape = engine.kv_cache.shape
    block_shape = (shape.num_layers, 2, shape.block_size, shape.num_kv_heads, shape.head_dim)
    try:
        io = io or KVIOProcess(settings.log_level, settings.log_format, settings.kv_io_nice)
        area, slots = tier_slots(engine, settings)
        records, stats = io.open(root, engine.loaded.fingerprint, shape.block_size, block_shape,
                                 shape.dtype, settings.kv_disk_bytes, area, _BUSY_WAIT_S,
                                 shared_scan_s=settings.kv_shared_scan_s if shared else None,
                                 yields=writer_yields(settings, engine.kv_cache.device),
                                 rise_s=rise_s(settings),
                                 quarantine_budget=settings.kv_quarantine_bytes,
                                 tenant_share=settings.kv_session_tenant_share)
    except Exception as exc:  # an unusable directory, or no process: serve without the tier
        log.exception("kv_tier_open_failed", path=str(root))
        report["error"] = str(exc) if isinstance(exc, TierOpenFailed) else f"{type(exc).__name__}: {exc}"
        if io is not None:
            io.abandon()
        return report
    sessions = [s for s in (disk_session(engine.kv, r) for r in records) if s is not None]
    for record in records:  # a pin keeps its expiry across a restart (expired ones are gone)
        if record.expires_at is not None and record.ttl_s is not None:
            engine.kv.pins.add(record.session_id, record.tenant, record.ttl_s,
                               len(record.block_hashes), expires_at=record.expires_at)
    engine.attach_disk_tier(io, stats, slots, sessions)
    # This layout's directory; another layout's tier beside it is set aside, never touched.
    report.update(path=stats.get("root", str(root)), layout=stats.get("layout"),
                  other_layouts=stats.get("other_layouts", []))
    report.update(start_sessions=len(sessions), start_bytes=stats["bytes"],
                  start_quarantined=stats["quarantined_total"],
                  start_incomplete=stats["incomplete_sessions"])
    return report


def rise_s(settings: Any) -> float:
    """How long after a save its blocks are written at ``kv_io_nice``; later ones are written
    at the station's priority. A quarter of the write-behind bound: the rest is left for the
    write itself, whose fsyncs alone take a good part of the bound beside a saturating decode
    (docs/engine.md, "The writer's priority rises")."""
    return settings.kv_write_behind_s * RISE_SHARE


def writer_yields(settings: Any, device: Any) -> bool:
    """Whether the writer waits for decode steps to pause (until its priority rises,
    ``rise_s``) before it writes a block beside them: where decode runs on the CPU (its
    threads take every core) at ``kv_io_nice = 19``; never on a GPU, whose decode leaves the
    cores idle, or at a higher priority."""
    return settings.kv_io_nice == 19 and device.type == "cpu"


def disk_session(kv: Any, record: Any) -> DiskSession | None:
    """The disk index's entry for a manifest's ``record`` (None: it names no block)."""
    if not record.block_hashes:
        return None
    bs = kv.block_size
    extra = kv.extra_keys(record.tenant)
    # Files are named by the hashes of the run that wrote them; the tenant salt may have
    # changed since (or, on a shared tier, another replica with another salt wrote it), so
    # check the first and re-key the rest only when it differs.
    first = hash_block(None, record.token_ids[:bs], extra)
    hashes = (record.block_hashes if first == record.block_hashes[0]
              else tuple(block_hashes_for(record.token_ids, bs, extra)))
    return DiskSession(record.session_id, record.tenant, tuple(record.token_ids), tuple(hashes),
                       tuple(record.block_hashes), record.last_used)


def tier_report(start: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """``hello``/``health``/``stats``'s ``kv_tier``: what the start found (``start``, from
    ``open_tier``) and the tiers' fill now (``stats``: the engine's)."""
    report = dict(start)
    report.update(
        pool_sessions=stats.get("kv_sessions"), pool_session_budget=stats.get("kv_session_budget"),
        pool_pinned_blocks=stats.get("pinned_blocks"), pool_blocks=stats.get("blocks_total"))
    if "disk_bytes" in stats:
        report.update(
            disk_sessions=stats.get("disk_sessions"),  # every session the disk holds
            disk_only_sessions=stats.get("kv_disk_sessions"),  # of them: not in the pool
            disk_bytes=stats.get("disk_bytes"),
            disk_budget_bytes=stats.get("disk_budget_bytes"), disk_blocks=stats.get("disk_blocks"),
            quarantined=stats.get("disk_quarantined_total"),
            quarantine_reasons=stats.get("disk_quarantined"),
            # what quarantine/ keeps now (earlier runs' files too), and what its budget deleted
            quarantine_kept=stats.get("disk_quarantine_kept"),
            quarantine_kept_reasons=stats.get("disk_quarantine_kept_reasons"),
            quarantine_kept_bytes=stats.get("disk_quarantine_kept_bytes"),
            quarantine_budget_bytes=stats.get("disk_quarantine_budget_bytes"),
            quarantine_deleted=stats.get("disk_quarantine_deleted"),
            evicted_over_share=stats.get("disk_evicted_over_share"),
            disk_full=stats.get("disk_disk_full"), disk_full_evicted=stats.get("disk_disk_full_evicted"),
            root_lost=stats.get("disk_lost"), root_lost_sessions=stats.get("disk_lost_sessions"),
            write_error=stats.get("disk_last_error"), write_error_at=stats.get("disk_last_error_at"),
            offloaded=stats.get("kv_sessions_offloaded"), lost=stats.get("kv_sessions_lost"),
            write_behind_lag_ms_p99=stats.get("write_behind_lag_ms_p99"),
            write_behind_queued=stats.get("write_behind_queued"), io_down=stats.get("kv_io_down"))
    if "host_bytes" in stats:  # the host-RAM tier in front of the disk (a staging area)
        report.update(host_bytes=stats["host_bytes"], host_budget_bytes=stats.get("host_budget_bytes"),
                      host_pinned=stats.get("host_pinned"))
    return report
