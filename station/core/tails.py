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

With ``PromptEnds`` (``station.core.prompt_ends``) the last token is taken too, when the
cached block a prompt ends inside holds the logits after that token: they were kept when the
sequence that computed them left (its prompt's end, whatever it generated after). The
sequence then starts with every prompt token computed, and its first token is sampled from
that row without a forward.
"""

from __future__ import annotations

from dataclasses import replace

from station.core.block_pool import BlockHash, BlockPool, block_hashes_for, tail_key
from station.core.kv_results import ComputedBlocks
from station.core.prompt_ends import PromptEnds
from station.core.sequence import Sequence


def tail_of(seq: Sequence, index: int) -> BlockHash:
    """The tail key of ``seq``'s block ``index`` (its hashes cover the blocks before it)."""
    return tail_key(seq.block_hashes[index - 1] if index else None, seq.extra_keys)


def find_tail(pool: BlockPool, seq: Sequence, computed: ComputedBlocks,
              ends: PromptEnds | None = None) -> ComputedBlocks:
    """``computed`` (full blocks) with the cached tail that holds ``seq``'s next tokens, and
    those tokens counted in ``num_cached_tokens``; ``computed`` itself when none does. With
    ``ends``, a cached block holding the rest of the prompt and the logits after it is
    taken with all of it (``end_logits``)."""
    n, bs = len(computed.blocks), pool.block_size
    start = n * bs
    if ends is not None and seq.num_tokens - start <= bs:
        rest = tuple(seq.token_ids[start:])
        for block in pool.tails.get((tail_of(seq, n), rest[0]), {}).values():
            if block.token_ids[:len(rest)] == rest and (row := ends.row(block, len(rest))) is not None:
                return replace(computed, tail=block, num_cached_tokens=seq.num_tokens,
                               end_logits=row)
    ahead = seq.token_ids[start:min(start + bs, seq.num_tokens - 1)]
    tail, num = pool.longest_tail(tail_of(seq, n), ahead)
    return computed if tail is None else replace(computed, tail=tail, num_cached_tokens=start + num)


def leave_tail(pool: BlockPool, seq: Sequence, ends: PromptEnds | None = None) -> None:
    """File ``seq``'s partial last block in the pool's tail index, before the sequence drops
    its reference: only a block it alone holds (its full blocks are cached already). With
    ``ends``, its prompt-end logits go with the cached block its prompt ends inside."""
    _file_partial(pool, seq)
    if ends is not None and seq.end_logits is not None:
        keep_end(pool, seq, ends)
    seq.start_logits = seq.end_logits = None


def _file_partial(pool: BlockPool, seq: Sequence) -> None:
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


def keep_end(pool: BlockPool, seq: Sequence, ends: PromptEnds) -> None:
    """Keep ``seq``'s prompt-end logits with the cached block its prompt ends inside: its
    own, or (when a cached block held those tokens already) the one filed in its place."""
    bs, num = pool.block_size, seq.num_prompt_tokens
    if seq.num_computed_tokens < num:
        return
    index = (num - 1) // bs
    lead = tuple(seq.token_ids[index * bs:num])
    if index > len(seq.block_hashes):
        return
    key = tail_of(seq, index)
    for block in pool.tails.get((key, lead[0]), {}).values():
        if block.token_ids[:len(lead)] == lead:
            ends.keep(block, len(lead), seq.end_logits)
            return
