"""The KV store under pressure: which session its budget evicts, a full filesystem, and a
tier directory deleted under it (the store, ``station.tier.store.store``, acts on them).

**Which session goes** (``choose_victim``). The disk keeps the pool's rule between tenants
(``kv_session_tenant_share``, ``station.core.sessions``): a tenant is *over its share* when
its manifests and the distinct blocks they name take more than ``share * budget`` bytes.
The victim is the writing tenant's own least recently used session when that tenant is
over its share; else the least recently used session of any tenant over its share; only
when none is over, the least recently used session of all. So one tenant's flood of new
sessions evicts its own, and a tenant under its share never loses a session on disk to a
tenant over it. A live TTL pin (a manifest's ``expires_at`` still ahead) is never a victim: it leaves the
disk when it expires (the engine deletes it).

**A full filesystem** (``ENOSPC``, or ``EDQUOT``: ``FULL_ERRNOS``) is budget pressure the
budget did not foresee: the write's least recently used victim (by the same rule) is
evicted and the write tried again, until it fits or nothing is left to evict
(``DiskFull``). Each failed attempt is counted (``disk_full``), as is each session evicted
for it (``disk_full_evicted``); the last one is ``last_error``.

**A tier directory deleted while the store has it open** (by hand, a cleanup job, a volume
remounted empty) is recreated at the next write or within ``ROOT_CHECK_S``: the sessions
whose manifests are gone leave the index (``lost_sessions``, the station is told which) and
the lock is taken again on the new directory.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from station.tier.format import KVStoreError
from station.tier.store.index import StoreIndex

ROOT_CHECK_S = 2.0  # an idle writer looks for its directories this often
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(KVStoreError):
    """The filesystem is full and the store has nothing left to evict for this write."""


@dataclass(frozen=True, slots=True)
class Victim:
    session_id: str
    over_share: bool  # its tenant was over its share


def choose_victim(index: StoreIndex, tenant: str | None, share: float, budget: int,
                  keep: str | None = None, now: float = 0.0) -> Victim | None:
    """The session to evict next for ``tenant``'s write (None: the store holds none but
    ``keep`` and the pins live at ``now``), by the rule in the module docstring, each
    tenant's share ``share * budget``."""
    records = [r for r in index.sessions_lru() if r.session_id != keep
               and (r.expires_at is None or r.expires_at <= now)]
    if not records:
        return None
    limit = share * budget
    over = {t for t, n in index.tenant_bytes().items() if n > limit}
    if tenant in over:
        mine = next((r for r in records if r.tenant == tenant), None)
        if mine is not None:
            return Victim(mine.session_id, True)
    for record in records:
        if record.tenant in over:
            return Victim(record.session_id, True)
    return Victim(records[0].session_id, False)
