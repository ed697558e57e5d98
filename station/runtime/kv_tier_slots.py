"""The KV blocks the disk tier's I/O process works on, and how the engine hands them over.

A CPU pool in shared memory is mapped by the I/O process itself (``PoolSlots``: a block's
slot is its id, nothing is copied). A CUDA pool, or a CPU pool with ``kv_host_bytes`` set,
goes through a staging area in shared host memory (``StagingSlots``; pinned on CUDA): the
engine thread copies a write part's blocks out to free slots before handing it over, and a
load part's slots into the pool's blocks after the process filled them. A part is at most
half the area, so a write part and a load part always fit at once.
"""

from __future__ import annotations

from typing import Any

import torch

from station.runtime.kv_cache import SharedBlocks

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
    """The I/O process maps the CPU pool itself: a block's slot is its id, nothing is copied."""

    def __init__(self, num_blocks: int) -> None:
        self.part_blocks = num_blocks

    def stage_out(self, block_ids: list[int]) -> list[int]:
        return list(block_ids)

    def stage_in(self, slots: list[int], block_ids: list[int]) -> None:
        pass

    def take(self, block_ids: list[int]) -> list[int]:
        """Slots for a load part into ``block_ids``."""
        return list(block_ids)

    def room(self) -> int:
        return self.part_blocks

    def release(self, slots: list[int]) -> None:
        pass


class StagingSlots:
    """A staging area between the pool (a GPU's) and the I/O process: the engine thread
    copies blocks out to free slots before a write part and in from them after a load part."""

    def __init__(self, shared: SharedBlocks, pool: torch.Tensor) -> None:
        self.shared = shared  # the memory the area's tensor views
        self.area, self.pool = shared.tensor, pool  # [L, 2, slots | blocks, bs, H, D]
        self.free = list(range(shared.num_blocks))
        self.part_blocks = max(1, shared.num_blocks // 2)  # a write part and a load part fit at once

    def room(self) -> int:
        return len(self.free)

    def stage_out(self, block_ids: list[int]) -> list[int]:
        slots = [self.free.pop() for _ in block_ids]
        for slot, block_id in zip(slots, block_ids):
            self.area[:, :, slot].copy_(self.pool[:, :, block_id])
        return slots

    def take(self, block_ids: list[int]) -> list[int]:
        return [self.free.pop() for _ in block_ids]

    def stage_in(self, slots: list[int], block_ids: list[int]) -> None:
        for slot, block_id in zip(slots, block_ids):
            self.pool[:, :, block_id].copy_(self.area[:, :, slot], non_blocking=True)

    def release(self, slots: list[int]) -> None:
        self.free.extend(slots)
