"""The CPU KV pool's pages written in ahead of the step (``KVCache.prefault``): a span of
blocks ahead of the ones handed out made resident, then more as ``need`` asks, up to the
whole pool, in the shared (memfd) and the private map alike, and no byte changed: K/V
already written stays, the rest stays zero."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import pytest
import torch

from station.forward.kv_cache import KVCache, KVCacheShape

SHAPE = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)


def _resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(resident, all) pages under the tensor's bytes, by mincore."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() - tensor.data_ptr() % page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = (end - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def _ready_blocks(cache: KVCache) -> int:
    """Blocks whose pages are all resident in every (layer, K/V) plane, counted from 0."""
    def ready(block: int) -> bool:
        counts = [_resident_pages(cache.kv[layer, kv, block]) for layer in range(SHAPE.num_layers)
                  for kv in range(2)]
        return all(resident == pages for resident, pages in counts)

    n = 0
    while n < cache.kv.shape[2] and ready(n):
        n += 1
    return n


def _wait_for(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("shared", [False, True], ids=["private", "memfd"])
def test_prefault_keeps_blocks_ready_ahead_of_use_without_changing_a_byte(shared):
    cache = KVCache(SHAPE, 40, torch.device("cpu"), shared=shared, scratch_blocks=1)
    resident, pages = _resident_pages(cache.kv)
    assert resident < pages // 4  # mapped, not written: the kernel's zeros
    written = torch.randn(SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim).to(SHAPE.dtype)
    cache.kv[1, 0, 30] = written  # a block K/V was written into before the thread reached it
    got: list[dict] = []
    finished = threading.Event()
    ahead = 8  # blocks
    thread = cache.prefault(lambda fields: (got.append(fields), finished.set()),
                            ahead_bytes=ahead * SHAPE.bytes_per_block)
    assert thread is not None
    assert _wait_for(lambda: _ready_blocks(cache) >= ahead)
    time.sleep(0.2)
    assert _ready_blocks(cache) < 12 and not finished.is_set()  # no further until asked
    cache.need(20)  # blocks below 20 handed out: ready up to 28
    assert _wait_for(lambda: _ready_blocks(cache) >= 28)
    cache.need(40)
    assert finished.wait(30)
    assert got == [{"ok": True, "blocks": 41, "seconds": got[0]["seconds"]}]
    assert _resident_pages(cache.kv) == (pages, pages)
    assert torch.equal(cache.kv[1, 0, 30], written)
    cache.kv[1, 0, 30] = 0
    assert not cache.kv.view(torch.int16).any()  # the advice wrote nothing
