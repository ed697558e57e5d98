"""TTL pins: which KV sessions the budgets must not drop, until when (pure Python).

generate's ``pins`` (``gnosis_daemon.wire.pins``) save prefixes of a prompt as KV sessions
that stay for ``ttl_s`` after their last hit: Anthropic's ``cache_control`` breakpoints and
OpenAI's ``prompt_cache_retention``. A session is *pinned* while this table holds its id
with ``expires_at`` in the future. The table is the one record of that, for both tiers (an
id names one session, in the pool or on disk): the session registry skips a live pin when
it picks a victim for the count budget or for pool room (a durable pin may still move to
the disk tier, ``SessionRegistry.offload_pins``), the disk store skips it under its byte
budget, and a use refreshes ``expires_at`` (``refresh``). At expiry the engine deletes the
session from every tier (``due``, ``station.engine.pinning``).

Each tenant's live pins hold at most ``tenant_bytes`` bytes of KV (``kv_pin_tenant_bytes``):
a pin past it is *downgraded* (``fits`` is False), saved as an ordinary session.

Thread-safety: every call is on the engine thread; ``stats`` reads plain counters only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from station.core.block_pool import BlockHash, KVBlock

DOWNGRADED = "pin_budget"  # the reason a pin past the tenant's bytes reports


def no_block(block_size: int) -> str:
    """The reason a pin whose prefix is shorter than one KV block reports."""
    return f"its prefix holds no whole KV block of {block_size} tokens"


@dataclass(frozen=True, slots=True)
class PinPlan:
    """One of generate's pins as the engine saves it when the prefill ends: the prompt's
    first ``num_tokens`` tokens (whole blocks), or ``reason`` why it cannot be computed
    (``station.serving.pin_prefix`` works it out, on the tokenizer's thread)."""

    session_id: str
    ttl_s: float
    num_tokens: int
    reason: str | None = None


@dataclass(slots=True)
class PinState:
    tenant: str
    ttl_s: float
    expires_at: float  # wall clock (unix) seconds
    num_bytes: int  # the KV bytes the session's blocks hold


class PinTable:
    def __init__(self, clock: Callable[[], float] = time.time, bytes_per_block: int = 0,
                 tenant_bytes: int = 2 * 1024 ** 3) -> None:
        self.clock = clock
        self.bytes_per_block = bytes_per_block
        self.tenant_bytes = tenant_bytes
        self._pins: dict[str, PinState] = {}
        self.pinned_bytes = 0  # of every pin in the table (an int: safe to read anywhere)
        self.num_pins = 0
        self.num_expired = 0
        self.num_downgraded = 0
        # ttl_s -> [live pins, their bytes, expired, downgraded]: ``/metrics`` by TTL class
        self.by_ttl: dict[float, list[int]] = {}
        # At most the earliest expires_at in the table (a drop or a refresh leaves it early:
        # ``due`` then finds nothing and sets it again), so the engine looks only then.
        self.next_at: float | None = None

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._pins

    def get(self, session_id: str) -> PinState | None:
        return self._pins.get(session_id)

    def live(self, session_id: str, now: float | None = None) -> bool:
        """``session_id`` is pinned and its pin has not expired."""
        pin = self._pins.get(session_id)
        return pin is not None and pin.expires_at > (self.clock() if now is None else now)

    def ids(self) -> list[str]:
        return list(self._pins)

    def stats(self) -> dict[str, Any]:
        by_ttl = dict(self.by_ttl)  # one C-level copy: the engine thread may add a class
        return {"kv_pins": self.num_pins, "kv_pinned_bytes": self.pinned_bytes,
                "kv_pins_expired": self.num_expired, "kv_pins_downgraded": self.num_downgraded,
                "kv_pins_by_ttl": {f"{ttl:g}": dict(zip(("pins", "bytes", "expired", "downgraded"), c))
                                   for ttl, c in by_ttl.items()}}

    def _class(self, ttl_s: float) -> list[int]:
        return self.by_ttl.setdefault(ttl_s, [0, 0, 0, 0])

    def downgraded(self, ttl_s: float) -> None:
        """A pin of ``ttl_s`` was saved unpinned: its tenant's bytes were spent."""
        self.num_downgraded += 1
        self._class(ttl_s)[3] += 1

    def bytes_of(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block

    def tenant_pinned_bytes(self, tenant: str, but: str | None = None) -> int:
        """The bytes ``tenant``'s live pins hold, ``but`` that id's (a pin it replaces)."""
        now = self.clock()
        return sum(p.num_bytes for sid, p in self._pins.items()
                   if p.tenant == tenant and sid != but and p.expires_at > now)

    def fits(self, session_id: str, tenant: str, num_blocks: int) -> bool:
        """A pin of ``num_blocks`` blocks under ``session_id`` keeps ``tenant`` within its bytes."""
        return (self.tenant_pinned_bytes(tenant, session_id) + self.bytes_of(num_blocks)
                <= self.tenant_bytes)

    def add(self, session_id: str, tenant: str, ttl_s: float, num_blocks: int,
            expires_at: float | None = None) -> PinState:
        """Pin ``session_id`` for ``ttl_s`` from now (``expires_at``: as a record on disk says)."""
        self.drop(session_id)
        pin = PinState(tenant, ttl_s, self.clock() + ttl_s if expires_at is None else expires_at,
                       self.bytes_of(num_blocks))
        self._pins[session_id] = pin
        self.next_at = pin.expires_at if self.next_at is None else min(self.next_at, pin.expires_at)
        self.num_pins += 1
        self.pinned_bytes += pin.num_bytes
        counts = self._class(ttl_s)
        counts[0] += 1
        counts[1] += pin.num_bytes
        return pin

    def drop(self, session_id: str) -> bool:
        """Forget ``session_id``'s pin (deleted, or saved again unpinned)."""
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        self.num_pins -= 1
        self.pinned_bytes -= pin.num_bytes
        counts = self._class(pin.ttl_s)
        counts[0] -= 1
        counts[1] -= pin.num_bytes
        return True

    def refresh(self, session_id: str) -> float | None:
        """A hit: a live pin's ``expires_at`` moves to now + ``ttl_s``. -> the new
        ``expires_at``, None when the id holds no live pin."""
        pin, now = self._pins.get(session_id), self.clock()
        if pin is None or pin.expires_at <= now:
            return None
        pin.expires_at = now + pin.ttl_s
        return pin.expires_at

    def due(self) -> list[str]:
        """The pins that have expired, dropped from the table and counted: the engine
        deletes their sessions from every tier."""
        now = self.clock()
        expired = [sid for sid, pin in self._pins.items() if pin.expires_at <= now]
        for session_id in expired:
            self._class(self._pins[session_id].ttl_s)[2] += 1
            self.drop(session_id)
        self.num_expired += len(expired)
        self.next_at = min((p.expires_at for p in self._pins.values()), default=None)
        return expired

    def wait_s(self) -> float | None:
        """Seconds until ``due`` may find an expired pin (0: now), None when none is pinned."""
        return None if self.next_at is None else max(0.0, self.next_at - self.clock())



def read_from_pins(table: PinTable, tenant: str, hits: Sequence[KVBlock],
                   hashes_of: Callable[[str], Sequence[BlockHash] | None]) -> tuple[int, list[str]]:
    """How many of a prompt's leading ``hits`` (the cached blocks admission took) hold KV of
    ``tenant``'s live pins, in either tier (``hashes_of``: the block hashes of the session of
    an id; a hash names its whole prefix), and the pins they were read from, each refreshed
    (a hit)."""
    now = table.clock()
    held: set[BlockHash] = set()
    holders: list[tuple[str, BlockHash]] = []
    for session_id in table.ids():
        pin, hashes = table.get(session_id), hashes_of(session_id)
        if pin is not None and pin.tenant == tenant and pin.expires_at > now and hashes:
            held.update(hashes)
            holders.append((session_id, hashes[0]))
    n = 0
    for block in hits:
        if block.block_hash is None or block.block_hash not in held:
            break
        n += 1
    read = {b.block_hash for b in hits[:n]}
    refreshed = [sid for sid, first in holders if first in read]
    for session_id in refreshed:
        table.refresh(session_id)
    return n, refreshed
