"""The logits at the end of a prompt, kept with the cached block that ends it (pure Python:
the rows are opaque here).

Token-granular reuse (``station.core.tails``) takes every prompt token's KV but the last from
the cache: the last one is computed again because its logits are what the first token is
sampled from. Those logits were computed already, by the request that left the block: its
prompt's last prefill row. ``PromptEnds`` keeps that row, per cached block (full or
partial) the prompt ends inside, so the same prompt sent again computes no row at all:
admission copies the block, takes every token of the prompt, and the step samples the kept
row. That row is what computing the token again would give, to the bit: it is the fresh
computation's own.

An entry names the block by its id, its tail key and the leading tokens the row follows
(the chain before it and what it holds): a block reused for anything else loses its tail
key or tokens, and its entry no longer matches, so a stale row is never served. Entries
are LRU, bounded by bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from station.core.block_pool import BlockHash, KVBlock

# A row of SmolLM2's 49,152 logits is 192 KiB: this keeps the ends of about 40 prompts.
DEFAULT_MAX_BYTES = 8 * 1024 * 1024


def row_bytes(row: Any) -> int:
    return int(row.numel()) * int(row.element_size())


class PromptEnds:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_served = 0  # prompts whose first token was sampled from a kept row (stats)
        # block id -> (its tail key, its leading tokens the row follows, the row)
        self._rows: OrderedDict[int, tuple[BlockHash, tuple[int, ...], Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def keep(self, block: KVBlock, num: int, row: Any) -> None:
        """``row``: the logits after ``block``'s first ``num`` tokens (``block`` is filed in
        the tail index); one row per block, the latest."""
        assert block.tail_key is not None and 0 < num <= len(block.token_ids)
        size = row_bytes(row)
        if size > self.max_bytes:
            return
        self._drop(block.block_id)
        self._rows[block.block_id] = (block.tail_key, block.token_ids[:num], row)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._rows)))

    def row(self, block: KVBlock, num: int) -> Any:
        """The row kept for ``block``'s first ``num`` tokens as it holds them now, or None
        (none kept, another count, or the block was reused since)."""
        entry = self._rows.get(block.block_id)
        if entry is None:
            return None
        key, tokens, row = entry
        if block.tail_key != key or block.token_ids[:len(tokens)] != tokens:
            self._drop(block.block_id)
            return None
        if len(tokens) != num:
            return None
        self._rows.move_to_end(block.block_id)
        return row

    def stats(self) -> dict[str, int]:
        return {"prompt_ends_kept": len(self._rows), "prompt_ends_served": self.num_served}

    def _drop(self, block_id: int) -> None:
        entry = self._rows.pop(block_id, None)
        if entry is not None:
            self.num_bytes -= row_bytes(entry[2])
