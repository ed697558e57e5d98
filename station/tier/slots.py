"""The KV blocks the disk tier's I/O process works on, and how the engine hands them over.

A CPU pool in shared memory is mapped by the I/O process itself (``PoolSlots``: a block's
slot is its id, nothing is copied). A CUDA pool, or a CPU pool with ``kv_host_bytes`` set,
goes through a staging area in shared host memory (``StagingSlots``; pinned on CUDA): the
engine thread copies a write part's blocks out to free slots before handing it over, and a
load part's slots into the pool's blocks after the process filled them. A part is at most
half the area, so a write part and a load part always fit at once.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from station.forward.kv_cache import SharedBlocks

_DEFAULT_STAGING_BYTES = 1024 ** 3  # kv_host_bytes = 0 on CUDA


def tier_slots(engine: Any, settings: Any) -> tuple[SharedBlocks, PoolSlots | StagingSlots]:
    """The KV blocks the I/O process works on: the CPU pool itself when it is shared, else a
    staging area of ``kv_host_bytes`` (pinned host RAM on CUDA) that the engine copies through."""
    cache = engine.kv_cache
    if cache.shared is not None:
        return cache.shared, PoolSlots(cache.num_blocks)
    budget = settings.kv_host_bytes or _DEFAULT_STAGING_BYTES
    area = SharedBlocks(cache.shape, max(2, budget // cache.shape.bytes_per_block),
                        pin=cache.device.type == "cuda")
    return area, StagingSlots(area, cache.kv)


class PoolSlots:
    """The I/O process maps the CPU pool itself: a block's slot is its id, nothing is copied,
    and every read-back reads the disk."""

    host_tier = False

    def __init__(self, num_blocks: int) -> None:
        self.part_blocks = num_blocks

    def room(self) -> int:
        return self.part_blocks

    def stage_out(self, block_ids: list[int], hashes: list[bytes]) -> list[int]:
        return list(block_ids)

    def written(self, slots: list[int], hashes: list[bytes], ok: bool) -> None:
        pass

    def load_part(self, block_ids: list[int], hashes: list[bytes]) -> tuple[list[int], list[int]]:
        """-> (a slot per block, the indexes of the blocks the I/O process must read)."""
        return list(block_ids), list(range(len(block_ids)))

    def loaded(self, slots: list[int], block_ids: list[int], hashes: list[bytes],
               missing: list[int], ok: bool) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


class StagingSlots:
    """Pinned host RAM between a GPU pool and the I/O process, kept as a tier of its own:
    the slots of written and read blocks stay filled, LRU, keyed by the block's file hash
    (content-addressed, so a kept slot is never stale). A read-back takes the blocks it
    finds here with a host-to-device copy and asks the I/O process only for the rest; a
    session found here whole is a ``host`` hit, no file read. A write copies only the
    blocks not kept here already. Slots in flight are neither free nor kept."""

    host_tier = True

    def __init__(self, shared: SharedBlocks, pool: torch.Tensor) -> None:
        self.shared = shared  # the memory the area's tensor views
        self.area, self.pool = shared.tensor, pool  # [L, 2, slots | blocks, bs, H, D]
        self.free = list(range(shared.num_blocks))
        self.kept: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self.part_blocks = max(1, shared.num_blocks // 2)  # a write part and a load part fit at once
        self.block_hits = 0  # blocks a read-back found here
        self.block_misses = 0  # blocks it had to read from disk

    def room(self) -> int:
        return len(self.free) + len(self.kept)

    def _take(self, block_hash: bytes) -> tuple[int, bool]:
        """A slot for ``block_hash``: (its kept slot, True) or (an empty one, False)."""
        slot = self.kept.pop(block_hash, None)
        if slot is not None:
            return slot, True
        if not self.free:  # the least recently used kept block gives its slot
            return self.kept.popitem(last=False)[1], False
        return self.free.pop(), False

    def stage_out(self, block_ids: list[int], hashes: list[bytes]) -> list[int]:
        slots = []
        for block_id, block_hash in zip(block_ids, hashes):
            slot, kept = self._take(block_hash)
            if not kept:
                self.area[:, :, slot].copy_(self.pool[:, :, block_id])
            slots.append(slot)
        return slots

    def written(self, slots: list[int], hashes: list[bytes], ok: bool) -> None:
        self._keep(slots, hashes) if ok else self.free.extend(slots)

    def load_part(self, block_ids: list[int], hashes: list[bytes]) -> tuple[list[int], list[int]]:
        slots, missing = [], []
        for i, block_hash in enumerate(hashes):
            slot, kept = self._take(block_hash)
            slots.append(slot)
            if not kept:
                missing.append(i)
        self.block_hits += len(hashes) - len(missing)
        self.block_misses += len(missing)
        return slots, missing

    def loaded(self, slots: list[int], block_ids: list[int], hashes: list[bytes],
               missing: list[int], ok: bool) -> None:
        if ok:
            for slot, block_id in zip(slots, block_ids):
                # Synchronous: the slot may be handed to the I/O process to fill right after.
                self.pool[:, :, block_id].copy_(self.area[:, :, slot])
            self._keep(slots, hashes)
            return
        bad = set(missing)  # not filled, or filled with what failed a check
        self._keep([s for i, s in enumerate(slots) if i not in bad],
                   [h for i, h in enumerate(hashes) if i not in bad])
        self.free.extend(s for i, s in enumerate(slots) if i in bad)

    def _keep(self, slots: list[int], hashes: list[bytes]) -> None:
        for slot, block_hash in zip(slots, hashes):
            old = self.kept.pop(block_hash, None)
            if old is not None and old != slot:  # the same block twice: keep one copy
                self.free.append(old)
            self.kept[block_hash] = slot

    def stats(self) -> dict[str, Any]:
        block_bytes = self.shared.nbytes // self.shared.num_blocks
        return {"host_budget_bytes": self.shared.nbytes, "host_bytes": len(self.kept) * block_bytes,
                "host_blocks": len(self.kept), "host_pinned": self.shared.pinned,
                "host_block_hits": self.block_hits, "host_block_misses": self.block_misses}
