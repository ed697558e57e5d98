"""Kept prompt-end logits without a model: a row is served only for the block and the
token count it was kept for, never after the block was reused, and the store stays within
its byte bound (oldest out first)."""

from __future__ import annotations

import torch

from station.core.block_pool import KVBlock
from station.core.prompt_ends import PromptEnds


def filed(block_id: int, key: bytes, tokens: tuple[int, ...]) -> KVBlock:
    return KVBlock(block_id, tail_key=key, token_ids=tokens)


def test_a_row_is_served_for_its_block_and_count_only():
    ends = PromptEnds()
    block = filed(3, b"k", (5, 6, 7))
    row = torch.arange(8, dtype=torch.float32)
    ends.keep(block, 2, row)
    assert ends.row(block, 2) is row
    assert ends.row(block, 3) is None and ends.row(block, 1) is None  # another prompt's end
    assert ends.row(filed(4, b"k", (5, 6, 7)), 2) is None  # another block
    assert len(ends) == 1


def test_a_reused_block_drops_its_row():
    ends = PromptEnds()
    block = filed(3, b"k", (5, 6, 7))
    ends.keep(block, 3, torch.zeros(8))
    block.tail_key, block.token_ids = b"other", (5, 6, 7)  # the block now follows another chain
    assert ends.row(block, 3) is None
    assert len(ends) == 0 and ends.num_bytes == 0
    block.tail_key, block.token_ids = b"k", (5, 9)
    ends.keep(block, 2, torch.zeros(8))
    block.token_ids = (5, 8, 1)  # refilled with other tokens under the same chain
    assert ends.row(block, 2) is None and len(ends) == 0


def test_the_byte_bound_evicts_the_least_recently_served():
    ends = PromptEnds(max_bytes=3 * 8 * 4)  # three rows of 8 float32
    blocks = [filed(i, b"k", (i,)) for i in range(4)]
    for b in blocks[:3]:
        ends.keep(b, 1, torch.zeros(8))
    assert ends.row(blocks[0], 1) is not None  # served: the most recent now
    ends.keep(blocks[3], 1, torch.zeros(8))
    assert [ends.row(b, 1) is not None for b in blocks] == [True, False, True, True]
    assert ends.num_bytes == 3 * 8 * 4
    ends.keep(blocks[0], 1, torch.zeros(64))  # larger than the whole bound: not kept
    assert ends.row(blocks[0], 1) is not None  # the old row stays
