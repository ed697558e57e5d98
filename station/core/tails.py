"""Prefix reuse inside a block (pure Python): the tail a sequence starts from, and the one it
leaves behind when it is freed.

Full blocks are reused by their chained hash (``BlockPool.get_computed_blocks``). Past them a
prompt may still share tokens with a cached block: a freed sequence's partial last block (its
computed tokens past its last full block, prompt and generated alike), or a full block that
the prompt ends inside or departs from mid-way. The pool files both under the tail key of the
chain before them (``block_pool.tail_key``: the parent block's hash and the extra keys, so
tenants and models never share one). ``find_tail`` gives admission the one whose tokens share
the longest prefix with the prompt's next ones, never its last token (its logits are needed);
the KV cache manager copies it into the sequence's own fresh block, because the sequence
writes its own tokens into that block's later slots. ``leave_tail`` files a freed sequence's
partial last block.
"""

from __future__ import annotations

from dataclasses import replace

from station.core.block_pool import BlockHash, BlockPool, block_hashes_for, tail_key
from station.core.kv_results import ComputedBlocks
from station.core.sequence import Sequence


def tail_of(seq: Sequence, index: int) -> BlockHash:
    """The tail key of ``seq``'s block ``index`` (its hashes cover the blocks before it)."""
    return tail_key(seq.block_hashes[index - 1] if index else None, seq.extra_keys)


def find_tail(pool: BlockPool, seq: Sequence, computed: ComputedBlocks) -> ComputedBlocks:
    """``computed`` (full blocks) with the cached tail that holds ``seq``'s next tokens, and
    those tokens counted in ``num_cached_tokens``; ``computed`` itself when none does."""
    n, bs = len(computed.blocks), pool.block_size
    start = n * bs
    ahead = seq.token_ids[start:min(start + bs, seq.num_tokens - 1)]
    tail, num = pool.longest_tail(tail_of(seq, n), ahead)
    return computed if tail is None else replace(computed, tail=tail, num_cached_tokens=start + num)


def leave_tail(pool: BlockPool, seq: Sequence) -> None:
    """File ``seq``'s partial last block in the pool's tail index, before the sequence drops
    its reference: only a block it alone holds (its full blocks are cached already)."""
    bs = pool.block_size
    full, part = divmod(seq.num_computed_tokens, bs)
    if not part or full >= len(seq.blocks):
        return
    block = seq.blocks[full]
    if block.ref_cnt != 1 or block.pin_cnt or block.block_hash is not None:
        return
    seq.block_hashes = block_hashes_for(seq.token_ids[:full * bs], bs, seq.extra_keys,
                                        seq.block_hashes)
    pool.cache_partial_block(block, tail_of(seq, full), seq.token_ids[full * bs:seq.num_computed_tokens])
