"""The one preallocated paged KV pool of a model.

``kv``: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K,
1 = V), allocated once at startup; requests never allocate KV. A token's slot is
``block_id * block_size + offset``; the flat views ``[L, 2, num_blocks * block_size, H, D]``
are what attention writes through a slot mapping.

Sizing: CPU uses ``settings.kv_cache_bytes``; CUDA uses ``settings.kv_cache_gpu_fraction``
of the memory still free after the weights are loaded.

Residency: a CPU pool is mapped, not written, at startup (its pages are the kernel's zeros
until written). ``prefault`` writes its pages in on a background thread
(``MADV_POPULATE_WRITE``), in the order the block pool hands blocks out, and keeps
``PREFAULT_AHEAD_BYTES`` of them ready past the highest block handed out so far (``need``,
called each step). Otherwise a prompt would take a page fault every 4 KiB of new K/V inside
the step (3-6% of a miss on the default model here). The pool becomes resident as it is used,
that much ahead.

Shared memory: with the disk tier on a CPU pool, the pool lives in an anonymous shared
memory file (``SharedBlocks``, a memfd) that the tier's I/O process maps too, so it copies
blocks to and from disk without a byte passing through the station's Python (see
``station.tier.disk_tier``). A CUDA pool cannot be shared that way: there the I/O process
maps a staging area of pinned host memory instead, of ``kv_host_bytes``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from station.model.errors import ModelRefused


class KVCacheTooSmall(ValueError):
    """The KV budget does not hold even one block; the message says which setting to raise."""


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config, block_size: int, dtype: torch.dtype) -> KVCacheShape:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = getattr(config, "num_attention_heads", None)
        if not num_heads:
            # A state-space or recurrent model (Mamba, RWKV...): nothing for a KV pool to
            # hold. A refusal, not a crash, so the station is not restarted in a loop.
            raise ModelRefused(str(getattr(config, "model_type", "?")), "non-attention layers",
                               "its config names no attention heads: its layers compute no "
                               "softmax attention (state-space, linear-attention or recurrent "
                               "layers), which the paged engine does not implement")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def dims(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """A pool's tensor shape: [L, 2, num_blocks, block_size, H, D]."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def _blocks_over(buffer: mmap.mmap, shape: KVCacheShape, num_blocks: int) -> torch.Tensor:
    """The pool's tensor over a map of its bytes (the kernel's zeros until written)."""
    return torch.frombuffer(buffer, dtype=torch.uint8).view(shape.dtype).view(shape.dims(num_blocks))


MADV_POPULATE_WRITE = 23  # Linux 5.14+: page tables filled writable, no byte written
PREFAULT_CHUNK_BYTES = 8 << 20  # the pool's bytes one advice turn covers
PREFAULT_AHEAD_BYTES = 64 << 20  # kept ready past the used span (a few thousand tokens' K/V)
PREFAULT_POLL_S = 1.0  # how often an idle prefault thread looks whether its pool is gone


class _Prefault:
    """What ``KVCache.prefault``'s thread and ``KVCache.need`` share: the blocks to have
    ready (``target``) under a condition."""

    def __init__(self, ahead: int) -> None:
        self.cv = threading.Condition()
        self.target = self.ahead = ahead  # the first ``ahead`` blocks at once


def _prefault_thread(cache_ref: weakref.ref[KVCache], state: _Prefault,
              done: Callable[[dict[str, Any]], None]) -> None:
    """``KVCache.prefault``'s thread: blocks [0, target) in id order, a chunk's range in every
    (layer, K/V) plane at a time; ends once every block is ready, when the pool is gone, or
    when the kernel lacks the advice."""
    # At the station's own priority, not SCHED_IDLE: each advice holds the process's mmap
    # lock, and a thread that only runs on an idle core could hold it, preempted, while the
    # engine thread waits to map memory (an inversion with no bound on a busy host).
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    cache = cache_ref()
    if cache is None:
        return
    total, planes = cache.kv.shape[2], cache.kv.shape[0] * cache.kv.shape[1]
    plane_block = cache.kv[0, 0, 0].numel() * cache.kv.element_size()  # one block of one plane
    step = max(1, PREFAULT_CHUNK_BYTES // (plane_block * planes))
    del cache
    ready, busy_s = 0, 0.0
    while ready < total:
        with state.cv:
            if state.target <= ready:
                state.cv.wait(PREFAULT_POLL_S)
            end = min(state.target, total, ready + step)
        cache = cache_ref()  # held across the chunk: its map stays while advised
        if cache is None:
            return
        if end > ready:
            start, base = time.monotonic(), cache.kv.data_ptr()
            for plane in range(planes):
                lo = base + (plane * total + ready) * plane_block
                hi = base + (plane * total + end) * plane_block
                if madvise(lo - lo % page, hi - lo + lo % page, MADV_POPULATE_WRITE) != 0:
                    done({"ok": False, "error": os.strerror(ctypes.get_errno()), "blocks_ready": ready})
                    return
            busy_s += time.monotonic() - start
            ready = end
        del cache
    done({"ok": True, "blocks": total, "seconds": round(busy_s, 3)})


def num_blocks_for(shape: KVCacheShape, settings, device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * settings.kv_cache_gpu_fraction)
        knob = "kv_cache_gpu_fraction"
    else:
        budget = settings.kv_cache_bytes
        knob = "kv_cache_bytes"
    num_blocks = budget // shape.bytes_per_block
    if num_blocks < 1:
        raise KVCacheTooSmall(
            f"KV budget of {budget} bytes holds no block of {shape.bytes_per_block} bytes "
            f"(block_size={shape.block_size}); raise setting {knob!r}"
        )
    return num_blocks


class SharedBlocks:
    """``num_blocks`` KV blocks ([L, 2, num_blocks, block_size, H, D], zeros) in a memfd that
    another process can map (``fd``, passed over a Unix socket); ``pin`` registers them with
    CUDA as pinned host memory (a staging area's fast, asynchronous copies)."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, pin: bool = False) -> None:
        self.num_blocks = num_blocks
        self.nbytes = num_blocks * shape.bytes_per_block
        self.fd = os.memfd_create("gnosis-kv-blocks", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)  # reads as zeros until written
        self._map = mmap.mmap(self.fd, self.nbytes)
        self.tensor = _blocks_over(self._map, shape, num_blocks)
        self.pinned = False
        if pin and torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self.pinned = int(err) == 0

    def layout(self) -> dict[str, int]:
        """What the other process needs to map the blocks (``station.tier.io.worker``)."""
        return {"num_blocks": self.num_blocks, "nbytes": self.nbytes}


class KVCache:
    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device,
                 shared: bool = False, scratch_blocks: int = 0) -> None:
        self.shape = shape
        self.num_blocks = num_blocks  # the blocks the allocator hands out
        self.block_size = shape.block_size
        self.device = device
        # ``scratch_blocks``: blocks past ``num_blocks`` that no sequence ever owns; the padded
        # rows of a decode graph write there (``station.forward.decode_graphs``).
        self.scratch_block = num_blocks if scratch_blocks else None
        self._prefault: _Prefault | None = None  # prefault's thread's state, once started
        total = num_blocks + scratch_blocks
        # ``shared`` (a CPU pool only): the blocks in shared memory, for the tier's I/O process.
        self.shared = SharedBlocks(shape, total) if shared and device.type == "cpu" else None
        # Zeros, not empty: padded gathers read unused slots under a -inf mask, and
        # 0 * NaN garbage would still poison the weighted sum.
        self._private: mmap.mmap | None = None
        if self.shared is not None:
            self.kv = self.shared.tensor
        elif device.type == "cpu":
            # An anonymous private map: the kernel's zero pages, each touched on first write.
            # torch.zeros writes every byte at start (0.15 s a 512 MiB pool here) and makes
            # all of it resident before one token is stored.
            self._private = mmap.mmap(-1, total * shape.bytes_per_block,
                                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.kv = _blocks_over(self._private, shape, total)
        else:
            self.kv = torch.zeros(shape.dims(total), dtype=shape.dtype, device=device)
        # [L, 2, blocks * block_size, H, D]: slot-addressed views for writes.
        self.flat = self.kv.view(shape.num_layers, 2, total * shape.block_size,
                                 shape.num_kv_heads, shape.head_dim)
        # Per layer (K slots, V slots, K blocks, V blocks): the views attention takes every
        # step, made once (each is a few torch calls a layer a token otherwise).
        self.layer_views = [(self.flat[i, 0], self.flat[i, 1], self.kv[i, 0], self.kv[i, 1])
                            for i in range(shape.num_layers)]

    def prefault(self, done: Callable[[dict[str, Any]], None],
                 ahead_bytes: int = PREFAULT_AHEAD_BYTES) -> threading.Thread | None:
        """Write in a CPU pool's pages on a background thread (the module's "Residency"),
        ``ahead_bytes`` of blocks at once and then as ``need`` asks; ``done`` gets what it
        did once every block is ready. A CUDA pool: nothing (None). The thread holds the pool
        only while it advises a chunk, so a dropped pool is freed."""
        if self.device.type != "cpu":
            return None
        ahead = max(1, ahead_bytes // self.shape.bytes_per_block)
        self._prefault = _Prefault(ahead)
        thread = threading.Thread(target=_prefault_thread, args=(weakref.ref(self), self._prefault, done),
                                  name="kv-prefault", daemon=True)
        thread.start()
        return thread

    def need(self, high_water: int) -> None:
        """Blocks below ``high_water`` have been handed out: have ``ahead`` more ready
        (cheap when nothing changes: the engine calls it every step)."""
        state = self._prefault
        if state is not None and high_water + state.ahead > state.target:
            with state.cv:
                state.target = high_water + state.ahead
                state.cv.notify()

    @property
    def bytes_total(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K and V, every layer, into block ``dst`` (the KV cache
        manager's copy hook: a fork's own copy of its parent's partial block)."""
        self.kv[:, :, dst].copy_(self.kv[:, :, src])
