"""Decode steps as CUDA graphs: one graph per (batch bucket, context bucket), replayed.

On a GPU a decode step of a small or mid-sized model is bound by launches, not arithmetic:
about a dozen kernels a layer, each queued by Python. A CUDA graph records one step's
kernels once and replays them all with one call. A graph replays fixed shapes at fixed
addresses, so a step of B decode rows whose longest context is C positions runs in the
smallest captured bucket of Bp >= B rows and Cp >= C positions:

- **Static inputs.** Each bucket owns one int64 buffer on the device, refilled by one copy
  before each replay. It holds the token ids, positions, each row's new KV slot, context
  lengths and block tables [Bp, Cp / block_size].
- **Padded rows.** Rows past B, and table entries past a row's blocks, point at the pool's
  scratch block (``KVCache(scratch_blocks=1)``, a block the allocator never hands out). A
  padded row writes its K/V there and attends to one position of it. Its logits are dropped.
- **Attention.** Each row's blocks are gathered into [Bp, Cp, Hkv, D], and one attention
  runs under a length mask (and a layer's sliding window, made from the same lengths):
  ``paged_attention.decode_attention``, the runner's eager batched decode, in shapes that
  do not change from step to step.

Graphs are captured lazily, on a bucket's first step, in one memory pool shared by all of
them. A capture that fails (out of memory, most likely) leaves that bucket's static step
uncaptured: the same arithmetic, run eagerly, logged as ``decode_graph_capture_failed`` and
counted in the engine's stats. Which steps run here is the decode plan's rule
(``station.plan``, ``GraphShape``): pure-decode steps within its rows and context
(``covers``); steps with a prompt chunk or a longer context run the forward body.

The same static step runs uncaptured on a CPU (``capture=False``, setting
``decode_graphs=on``). That is how the CPU suite checks its arithmetic, padding and scratch
writes; the ``gpu`` tests capture and replay it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from gnosis_daemon.logs import get_logger
from station.core.sequence import Sequence
from station.forward.attention_kinds import LayerAttention
from station.forward.kv_cache import KVCache
from station.forward.paged_attention import decode_attention, window_mask

log = get_logger(__name__)

FIRST_CONTEXT_BLOCKS = 16  # the smallest context bucket, in blocks (256 positions at 16 a block)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 32 and of 16 past it, ending at ``max_batch``."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 32 else 16)
    return sizes + [max_batch]


def context_buckets(block_size: int, max_context: int) -> list[int]:
    """Context buckets in blocks: 16, 32, 64, ... blocks, the last holding ``max_context``."""
    top = -(-max_context // block_size)
    sizes, n = [], FIRST_CONTEXT_BLOCKS
    while n < top:
        sizes.append(n)
        n *= 2
    return sizes + [top]


def decode_rows(decodes: list[Sequence],
                bs: int) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Each decoding sequence's next row: (tokens, positions, KV slots, block tables up to
    the block of its position); the runner's steps and the graphs' read the same rows."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    for seq in decodes:
        pos = seq.num_computed_tokens
        tokens.append(seq.token_ids[pos])
        positions.append(pos)
        slots.append(seq.blocks[pos // bs].block_id * bs + pos % bs)
        tables.append([b.block_id for b in seq.blocks[:pos // bs + 1]])
    return tokens, positions, slots, tables


def _context(decodes: list[Sequence]) -> int:
    """The longest context a decode step of these rows attends to."""
    return max(seq.num_computed_tokens for seq in decodes) + 1


def _smallest(buckets: list[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass(slots=True)
class StaticDecode:
    """One bucket's inputs (views of ``packed``) and, once captured, its graph and output.
    ``paged_attention_forward`` hands its layers to ``attend`` while this is the context."""

    kv_cache: KVCache
    rows: int
    blocks: int
    packed: torch.Tensor  # [rows * 4 + rows * blocks] int64 on the device
    tokens: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    slots: torch.Tensor = field(init=False)
    lens: torch.Tensor = field(init=False)
    tables: torch.Tensor = field(init=False)  # [rows * blocks], row-major
    masks: dict = field(default_factory=dict)  # window (None: full) -> [rows, 1, 1, blocks * bs] bool
    logits: torch.Tensor | None = None  # the captured step's output
    graph: torch.cuda.CUDAGraph | None = None  # once captured
    static = True  # paged_attention_forward hands this context's layers to ``attend``

    def __post_init__(self) -> None:
        r = self.rows
        self.tokens, self.positions, self.slots, self.lens = (self.packed[i * r:(i + 1) * r] for i in range(4))
        self.tables = self.packed[4 * r:]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, kind: LayerAttention) -> torch.Tensor:
        """query [1, H, rows, D], key/value [1, Hkv, rows, D] -> [1, rows, H, D]."""
        _, num_heads, rows, head_dim = query.shape
        num_kv_heads = key.shape[1]
        k_slots, v_slots, k_pool, v_pool = self.kv_cache.layer_views[module.layer_idx]
        k_slots.index_copy_(0, self.slots, key[0].transpose(0, 1))
        v_slots.index_copy_(0, self.slots, value[0].transpose(0, 1))
        q = query[0].transpose(0, 1).reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
        k = k_pool.index_select(0, self.tables).view(rows, -1, num_kv_heads, head_dim)
        v = v_pool.index_select(0, self.tables).view(rows, -1, num_kv_heads, head_dim)
        if kind.window not in self.masks:  # a window's mask, made once per step
            self.masks[kind.window] = window_mask(self.lens, k.shape[1], kind.window)
        o = decode_attention(q, k, v, kind, self.masks[kind.window])
        return o.reshape(1, rows, num_heads, head_dim)


class DecodeGraphs:
    """Pure-decode steps through per-bucket static steps, captured as CUDA graphs when
    ``capture``. ``forward(tokens, positions)`` -> hidden [1, T, H] runs the decoder with the
    current context set by ``use_context``; ``head(hidden rows)`` -> logits."""

    def __init__(self, kv_cache: KVCache, device: torch.device, forward: Callable, head: Callable,
                 use_context: Callable, max_batch: int, max_context: int, capture: bool) -> None:
        if kv_cache.scratch_block is None:
            raise ValueError("decode graphs need a KV pool with a scratch block")
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.max_context = max_context
        self.batch_sizes = batch_buckets(max_batch)
        self.context_blocks = context_buckets(self.block_size, max_context)
        self.capture = capture
        self._forward, self._head, self._use_context = forward, head, use_context
        self._static: dict[tuple[int, int], StaticDecode] = {}  # graph None: uncaptured
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream: torch.cuda.Stream | None = None  # the side stream of every capture
        self.replays = 0
        self.failed: list[tuple[int, int]] = []

    @property
    def captured(self) -> int:
        return sum(1 for s in self._static.values() if s.graph is not None)

    def bucket(self, rows: int, context: int) -> tuple[int, int] | None:
        if context > self.max_context:
            return None
        bp = _smallest(self.batch_sizes, rows)
        cb = _smallest(self.context_blocks, -(-context // self.block_size))
        return None if bp is None or cb is None else (bp, cb)

    def covers(self, decodes: list[Sequence]) -> bool:
        """A pure-decode step of these rows fits a bucket (the plan's rows and context)."""
        return bool(decodes) and self.bucket(len(decodes), _context(decodes)) is not None

    def run(self, decodes: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] float32 of one pure-decode step that ``covers`` takes."""
        key = self.bucket(len(decodes), _context(decodes))
        if key is None:
            raise ValueError(f"a decode step of {len(decodes)} rows past the static steps' bounds")
        static = self._static[key] if key in self._static else self._build(*key)
        static.packed.copy_(self._packed(*key, decodes))
        if static.graph is not None:
            static.graph.replay()
            logits = static.logits
        else:
            logits = self._step(static)
        self.replays += 1
        return logits[:len(decodes)].to(torch.float32, copy=True)

    def _packed(self, rows: int, blocks: int, decodes: list[Sequence]) -> torch.Tensor:
        """A bucket's inputs on the host, ``StaticDecode.packed``'s layout: ``decodes``' rows,
        then padding rows (token 0 at position 0, its K/V to the scratch block's first slot,
        attending to that one position); table entries past a row's blocks name the scratch
        block. No decodes: every row padding, as a bucket starts."""
        bs, scratch = self.block_size, self.kv_cache.scratch_block
        pad = rows - len(decodes)
        tokens, positions, slots, tables = decode_rows(decodes, bs)
        lens = [pos + 1 for pos in positions]
        flat = [block for table in tables for block in table + [scratch] * (blocks - len(table))]
        return torch.tensor(tokens + [0] * pad + positions + [0] * pad + slots + [scratch * bs] * pad
                            + lens + [1] * pad + flat + [scratch] * (pad * blocks), dtype=torch.long)

    def _step(self, static: StaticDecode) -> torch.Tensor:
        static.masks = {}  # each layer's window mask, made from ``lens`` within the step
        with self._use_context(static):
            hidden = self._forward(static.tokens[None], static.positions[None])
        return self._head(hidden[0])

    def _build(self, rows: int, blocks: int) -> StaticDecode:
        """The bucket's static step; captured as a graph when ``capture`` (a capture that
        fails leaves it uncaptured). Its buffers start as padding (every write to the
        scratch block), so warm-up and capture touch no real K/V."""
        static = StaticDecode(self.kv_cache, rows, blocks, self._packed(rows, blocks, []).to(self.device))
        self._static[(rows, blocks)] = static
        if self.capture:
            try:
                self._capture(static)
            except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
                log.warning("decode_graph_capture_failed", rows=rows, blocks=blocks, error=str(exc)[:200])
                self.failed.append((rows, blocks))
                static.graph = static.logits = None
                return static
            log.info("decode_graph_captured", rows=rows, context=blocks * self.block_size,
                     graphs=self.captured)
        return static

    def _capture(self, static: StaticDecode) -> None:
        """Two warm-up runs, then the capture, all on one side stream kept for every bucket:
        per-stream state (cuBLAS workspaces) is made before a capture, not in it, and the
        shared memory pool is reused as torch asks (the same stream for each capture)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        main, side = torch.cuda.current_stream(self.device), self._stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(static)
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            static.logits = self._step(static)
        main.wait_stream(side)
        static.graph = graph

    def stats(self) -> dict[str, int]:
        return {"decode_graphs_captured": self.captured, "decode_graph_replays": self.replays,
                "decode_graph_capture_failures": len(self.failed)}
