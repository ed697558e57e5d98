"""The CPU KV pool's pages written in ahead of the step (``KVCache.prefault``): every page
of the pool resident once its thread is done, in the shared (memfd) and the private map
alike, and no byte changed: K/V already written stays, the rest stays zero."""

from __future__ import annotations

import ctypes
import mmap
import threading

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


@pytest.mark.parametrize("shared", [False, True], ids=["private", "memfd"])
def test_prefault_makes_the_pool_resident_without_changing_a_byte(shared):
    cache = KVCache(SHAPE, 40, torch.device("cpu"), shared=shared, scratch_blocks=1)
    resident, pages = _resident_pages(cache.kv)
    assert resident < pages // 4  # mapped, not written: the kernel's zeros
    written = torch.randn(SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim).to(SHAPE.dtype)
    cache.kv[1, 0, 7] = written  # a block K/V was written into before the thread ran
    got: list[dict] = []
    finished = threading.Event()
    thread = cache.prefault(lambda fields: (got.append(fields), finished.set()))
    assert thread is not None and finished.wait(30)
    assert got == [{"ok": True, "blocks": 41, "seconds": got[0]["seconds"]}]
    assert _resident_pages(cache.kv) == (pages, pages)
    assert torch.equal(cache.kv[1, 0, 7], written)
    cache.kv[1, 0, 7] = 0
    assert not cache.kv.view(torch.int16).any()  # the advice wrote nothing
