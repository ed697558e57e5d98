"""TTL pins and per-tenant session control on the engine thread: generate's ``pins`` saved
when its prefill ends, the expiry sweep, and ``kv_session.list`` / ``kv_session.delete``.

The pin table (``station.core.pins``) says which sessions are pinned until when; this is
where the engine acts on it, with the parts it is handed (the KV cache manager, the disk
tier), never the engine:

* ``save_pins``: each pin's prefix (``station.serving.pin_prefix`` counted its tokens) is
  saved as a session of the request's tenant, pinned for ``ttl_s``, or as an ordinary
  session when the tenant's pinned bytes would pass ``kv_pin_tenant_bytes`` (reason
  ``pin_budget``). Its report says how many of those tokens this request read from a live
  pin of the tenant (``Sequence.num_pin_read_tokens``, counted at admission).
* ``expire``: pins past ``expires_at`` leave every tier (the pool, the disk index, their
  files: the tier deletes a session's manifest and the blocks no other session names).
* ``list_sessions`` / ``delete_sessions``: a tenant's view and control of its sessions;
  ``forget`` also drops the deleted sessions' blocks from the prefix cache, so the same
  prompt again is a miss (but for blocks another session or a running sequence holds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gnosis_daemon.logs import get_logger
from gnosis_daemon.wire import PinReport
from station.core.disk_sessions import DiskSession
from station.core.kv_manager import KVCacheManager
from station.core.pins import DOWNGRADED, PinPlan, no_block
from station.core.sequence import Sequence
from station.core.sessions import KVSession

if TYPE_CHECKING:
    from station.tier.disk_tier import DiskTier

log = get_logger(__name__)


def save_pins(kv: KVCacheManager, seq: Sequence, plans: tuple[PinPlan, ...]) -> tuple[PinReport, ...]:
    """Save each pin of a generate whose prefill just ended; -> the prefill event's reports."""
    return tuple(_save(kv, seq, plan) for plan in plans)


def _save(kv: KVCacheManager, seq: Sequence, plan: PinPlan) -> PinReport:
    def report(num_tokens: int, pinned: bool, reason: str | None) -> PinReport:
        pin = kv.pins.get(plan.session_id) if pinned else None
        return PinReport(session_id=plan.session_id, num_tokens=num_tokens,
                         read_tokens=min(seq.num_pin_read_tokens, num_tokens),
                         ttl_s=plan.ttl_s, expires_at=pin.expires_at if pin else None,
                         pinned=pin is not None, reason=reason)

    if plan.reason is not None or plan.num_tokens < kv.block_size:
        return report(0, False, plan.reason or no_block(kv.block_size))
    fits = kv.pins.fits(plan.session_id, seq.tenant, plan.num_tokens // kv.block_size)
    try:
        num = kv.pin_sequence(plan.session_id, seq, plan.num_tokens,
                              plan.ttl_s if fits else None)
    except Exception as exc:  # a failed save is reported, the request carries on
        log.exception("kv_pin_save_failed", session_id=plan.session_id)
        return report(0, False, f"{type(exc).__name__}: {exc}")
    if not fits:
        kv.pins.downgraded(plan.ttl_s)
        log.info("kv_pin_downgraded", session_id=plan.session_id, tenant=seq.tenant,
                 tokens=num, limit_bytes=kv.pins.tenant_bytes)
        return report(num, False, DOWNGRADED)
    return report(num, True, None)


def expire(kv: KVCacheManager, tier: DiskTier | None) -> list[str]:
    """Delete every session whose pin has expired, from every tier; -> their ids."""
    expired = kv.pins.due()
    for session_id in expired:
        kv.unpin(session_id)
        if tier is not None:
            tier.delete(session_id)
    if expired:
        log.info("kv_pins_expired", sessions=len(expired))
    return expired


def list_sessions(kv: KVCacheManager, include_tokens: bool = False,
                  tenant: str | None = None) -> dict[str, Any]:
    """``kv_session.list``: the pool's sessions, then the disk's, most recently used first
    (``tenant``: only that tenant's)."""
    pool = reversed(kv.sessions.sessions())
    disk = sorted(kv.disk.sessions(), key=lambda d: -d.last_used)
    listed = []
    for tier, tier_sessions in (("pool", pool), ("disk", disk)):
        for s in tier_sessions:
            if tenant is not None and s.tenant != tenant:
                continue
            listed.append(_entry(kv, s, tier, include_tokens))
    return {"sessions": listed, "budget": kv.sessions.budget,
            "pinned_blocks": kv.sessions.pinned_blocks}


def _entry(kv: KVCacheManager, s: KVSession | DiskSession, tier: str,
           include_tokens: bool) -> dict[str, Any]:
    pin = kv.pins.get(s.session_id)
    live = kv.pins.live(s.session_id)
    num_blocks = len(s.block_hashes) if isinstance(s, DiskSession) else len(s.blocks)
    item: dict[str, Any] = {
        "session_id": s.session_id, "tenant": s.tenant, "num_tokens": s.num_tokens,
        "last_used": s.last_used, "tier": tier,
        "durable": isinstance(s, DiskSession) or s.durable,
        "expires_at": pin.expires_at if pin and live else None,
        "ttl_s": pin.ttl_s if pin and live else None, "pinned": live,
        "bytes": kv.pins.bytes_of(num_blocks)}
    if include_tokens:
        item["tokens"] = list(s.token_ids)
    return item


def delete_sessions(kv: KVCacheManager, tier: DiskTier | None, session_id: str | None,
                    tenant: str | None = None, forget: bool = False,
                    every: bool = False) -> dict[str, Any]:
    """``kv_session.delete``: one session (``tenant``: only if it is that tenant's), or with
    ``every`` all of ``tenant``'s; their files go too. ``forget``: their blocks leave the
    prefix cache where nothing else holds them. -> ``{"deleted": bool}``, or the count with
    ``every``."""
    if every:
        assert tenant is not None  # the parser requires it
        ids = [s.session_id for s in kv.sessions.sessions() if s.tenant == tenant]
        ids += [d.session_id for d in kv.disk.sessions() if d.tenant == tenant]
    else:
        assert session_id is not None
        owner = _owner(kv, session_id)
        ids = [session_id] if owner is not None and tenant in (None, owner) else []
    deleted = 0
    for sid in dict.fromkeys(ids):
        resident = kv.sessions.get(sid)
        on_disk = kv.disk.get(sid)
        if not kv.unpin(sid):
            continue
        deleted += 1
        if tier is not None:
            tier.delete(sid)  # its manifest, after any write queued for it
        if forget:
            _forget(kv, resident, on_disk)
    if every:
        return {"deleted": deleted}
    return {"deleted": deleted > 0}


def _owner(kv: KVCacheManager, session_id: str) -> str | None:
    session = kv.sessions.get(session_id) or kv.disk.get(session_id)
    return session.tenant if session is not None else None


def _forget(kv: KVCacheManager, resident: KVSession | None, on_disk: DiskSession | None) -> None:
    """Drop a deleted session's blocks, and the tails filed after them, from the prefix
    cache (those no sequence or other session holds). A disk session's blocks may still be
    cached in the pool from before it was evicted: found by its hashes."""
    pool = kv.pool
    hashes = resident.block_hashes if resident is not None else (
        on_disk.block_hashes if on_disk is not None else ())
    blocks = list(resident.blocks) if resident is not None else []
    blocks += [b for h in hashes if (b := pool.cached_block_hash_to_block.get(h)) is not None
               and b not in blocks]
    pool.forget(blocks, hashes, kv.extra_keys(resident.tenant if resident is not None
                                              else on_disk.tenant if on_disk is not None else ""))
