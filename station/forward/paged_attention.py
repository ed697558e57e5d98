"""Attention over the paged KV pool, each layer as the model defines it.

``ModelRunner`` registers ``paged_attention_forward`` as transformers' attention function
``gnosis_paged`` and calls the model with every scheduled token of a step packed into one
row (batch 1), absolute ``position_ids`` (rotary is applied before attention) and no mask.
The step's index tensors are built once (``StepContext``); per layer the function

1. writes the new K/V into their pool slots (``slot_mapping``), then
2. decode rows: gathers each sequence's blocks into a padded batch and runs ONE attention
   for all of them (GQA packed as [B, kv_heads, n_rep, D], so K/V are never repeated);
3. prefill chunks: attention per chunk against the sequence's K/V with an offset causal
   mask (or plain ``is_causal`` when the chunk starts the sequence).

Each layer's ``LayerAttention`` (``station.forward.attention_kinds``, set on the module as
``gnosis_attention`` by the runner) decides what a query sees and how its scores are made:
a sliding window of W tokens (a query at p sees p - W + 1 .. p: a decode row reads only the
window's slice, a batched decode or a chunk masks the rest), soft-capping and attention
sinks (the explicit softmax below; SDPA has neither). Every path computes attention here
(the eager step, the decode graphs' static step through ``decode_attention``, the
``embed`` op's forward and a ``generate`` outside a step), so a layer attends alike on all
of them.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from station.forward.attention_kinds import LayerAttention
from station.forward.kv_cache import KVCache

ATTN_IMPLEMENTATION = "gnosis_paged"
KIND_ATTRIBUTE = "gnosis_attention"  # an attention module's LayerAttention

# One engine thread per engine: a thread-local context lets several engines share a process.
_local = threading.local()


@dataclass(slots=True)
class PrefillMeta:
    q_start: int
    q_len: int
    ctx_len: int  # tokens of K/V this chunk attends to (cached + earlier chunks + itself)
    block_table: torch.Tensor | None  # [num_blocks] long; None when the chunk starts at 0
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, offset-causal
    first_block: int | None = None  # the blocks are first_block.. in order: a view, no gather
    windowed: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)  # W -> (lo, mask)

    def window(self, window: int) -> tuple[int, torch.Tensor | None]:
        """(the first key position any of the chunk's queries sees, the mask over keys
        lo..ctx_len) for a sliding window of ``window``; made once per step."""
        start = self.ctx_len - self.q_len
        if window >= self.ctx_len:  # the window holds the whole context: the causal mask
            return 0, self.mask
        if window not in self.windowed:
            lo = max(0, start - window + 1)
            device = self.mask.device if self.mask is not None else None
            self.windowed[window] = (lo, causal_mask(start, self.q_len, lo, self.ctx_len, window, device))
        return self.windowed[window]


@dataclass(slots=True)
class StepContext:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [B * max_blocks] long, row-major
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool; None if B == 1
    decode_ctx_len: int  # B == 1: slice instead of masking
    prefills: list[PrefillMeta]
    decode_first_block: int | None = None  # B == 1 and its blocks are consecutive: a view
    decode_slot: int = -1  # B == 1: the new token's slot (a plain copy, not index_copy_)
    decode_lens: torch.Tensor | None = None  # [B] context lengths, where decode_mask is set
    decode_tables: list[list[int]] | None = None  # B > 1: each row's block ids (host lists)
    decode_ctx_lens: list[int] | None = None  # B > 1: ``decode_lens`` on the host
    decode_windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def decode_window(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched decode rows under a window of ``window``: (the block table from each row's
        first block the window reaches [B * blocks], the mask over those blocks' keys
        [B, 1, 1, blocks * bs]); made once per step, so a sliding layer gathers only the
        blocks it reads."""
        if window not in self.decode_windowed:
            bs = self.kv_cache.block_size
            lens, tables = self.decode_ctx_lens, self.decode_tables
            assert lens is not None and tables is not None  # set for every batched decode step
            firsts = [max(0, n - window) // bs for n in lens]
            rows = [table[first:] for table, first in zip(tables, firsts)]
            width = max(len(row) for row in rows)
            device = self.decode_lens.device
            flat = torch.tensor([block for row in rows for block in row + [0] * (width - len(row))],
                                dtype=torch.long, device=device)
            keys = (torch.tensor(firsts, device=device)[:, None] * bs
                    + torch.arange(width * bs, device=device)[None, :])
            lens_col = self.decode_lens[:, None]
            mask = ((keys < lens_col) & (keys >= lens_col - window)).view(len(rows), 1, 1, width * bs)
            self.decode_windowed[window] = (flat, mask)
        return self.decode_windowed[window]


def causal_mask(first_query: int, queries: int, first_key: int, end_key: int, window: int | None,
                device: torch.device | None = None) -> torch.Tensor:
    """[queries, end_key - first_key] bool: the query at position ``first_query + i`` sees
    the key at position ``k`` when ``k`` is at most its own and, with a window, more than
    its own less ``window`` (transformers' causal mask and ``sliding_window_overlay``)."""
    pos = torch.arange(first_query, first_query + queries, device=device)[:, None]
    keys = torch.arange(first_key, end_key, device=device)[None, :]
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    return mask


def window_mask(lens: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """[B, 1, 1, width] bool: row b sees keys ``lens[b] - window`` .. ``lens[b] - 1``."""
    keys = torch.arange(width, device=lens.device)[None, :]
    mask = keys < lens[:, None]
    if window is not None:
        mask &= keys >= lens[:, None] - window
    return mask.view(lens.shape[0], 1, 1, width)


def kind_of(module: torch.nn.Module, scaling: float | None, kwargs: dict[str, Any]) -> LayerAttention:
    """The layer's ``LayerAttention``, checked against what the model passed (a layer whose
    arguments disagree with what was read at load is an error, never a silent guess)."""
    kind: LayerAttention | None = getattr(module, KIND_ATTRIBUTE, None)
    if kind is None:
        raise RuntimeError(f"attention layer {getattr(module, 'layer_idx', '?')} has no attention "
                           "kind: the runner did not install the model's kinds")
    if scaling is not None and scaling != kind.scaling:
        raise RuntimeError(f"layer {module.layer_idx} scales its scores by {scaling}, not by the "
                           f"{kind.scaling} read at load")
    if kwargs:
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        if (window != kind.window and "sliding_window" in kwargs) or softcap != kind.softcap or (
                ("s_aux" in kwargs) != (kind.sinks is not None)):
            raise RuntimeError(f"layer {module.layer_idx} passes window {window}, softcap {softcap}, "
                               f"sinks {'s_aux' in kwargs}: not the kind read at load ({kind.describe()})")
    return kind


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: LayerAttention,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(cap(q k^T * scaling) masked [+ sink]) v, as transformers' eager attention
    writes it: q [B, H, T, D], k/v [B, Hkv, S, D], mask bool broadcast to [B, H, T, S]
    (True: attend) -> [B, H, T, D]."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * kind.scaling
    if kind.softcap is not None:
        scores = torch.tanh(scores / kind.softcap) * kind.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if kind.sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sinks = kind.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: LayerAttention,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """Decode rows: q [B, Hkv, n_rep, D] (a row's heads grouped by K/V head), k/v
    [B, S, Hkv, D], mask [B, 1, 1, S] or None -> [B, Hkv, n_rep, D]."""
    if kind.fused:
        return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, scale=kind.scaling)
    b, kv_heads, n_rep, head_dim = q.shape
    o = explicit_attention(q.reshape(b, kv_heads * n_rep, 1, head_dim), k.transpose(1, 2),
                           v.transpose(1, 2), kind, mask)
    return o.view(b, kv_heads, n_rep, head_dim)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: LayerAttention,
                    mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """A prompt chunk: q [1, H, n, D], k/v [1, Hkv, S, D]; ``mask`` [n, S] or ``causal``
    (the chunk is the whole context) -> [1, H, n, D]."""
    n_rep, tokens = q.shape[1] // k.shape[1], q.shape[2]
    if causal and (not kind.fused or (kind.window is not None and kind.window < tokens)):
        # SDPA's is_causal knows no window, and the explicit softmax takes only masks
        mask, causal = causal_mask(0, tokens, 0, tokens, kind.window, q.device), False
    if kind.fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=kind.scaling, enable_gqa=n_rep > 1)
    return explicit_attention(q, k, v, kind, mask)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None, **kwargs):
    kind = kind_of(module, scaling, kwargs)
    ctx = getattr(_local, "context", None)
    if ctx is None:  # the model outside the engine: the embed op, or transformers' generate
        return _outside_a_step(module, query, key, value, attention_mask, kind, kwargs), None
    if getattr(ctx, "static", False):  # a decode graph's step (station.forward.decode_graphs)
        return ctx.attend(module, query, key, value, kind), None
    # query: [1, H, T, D]; key/value: [1, Hkv, T, D] (rotary already applied)
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    n_rep = num_heads // num_kv_heads
    # [slots, Hkv, D] twice, [num_blocks, bs, Hkv, D] twice
    k_slots, v_slots, k_pool, v_pool = ctx.kv_cache.layer_views[module.layer_idx]
    b = ctx.num_decodes
    if b == 1 and num_tokens == 1:
        # One sequence decoding alone (a single stream's every step): no output buffer, no
        # copy into it; the same operations on the same values as the general path below.
        k_slots[ctx.decode_slot] = key.reshape(num_kv_heads, head_dim)
        v_slots[ctx.decode_slot] = value.reshape(num_kv_heads, head_dim)
        k, v = _single_decode_kv(ctx, kind, k_pool, v_pool, num_kv_heads, head_dim)
        o = decode_attention(query.reshape(1, num_kv_heads, n_rep, head_dim), k, v, kind, None)
        return o.view(1, 1, num_heads, head_dim), None
    k_slots.index_copy_(0, ctx.slot_mapping, key[0].transpose(0, 1))
    v_slots.index_copy_(0, ctx.slot_mapping, value[0].transpose(0, 1))

    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    if b:
        # q: [B, Hkv, n_rep, D] -- one query token per sequence, its heads grouped per kv head
        q = query[0, :, :b].transpose(0, 1).reshape(b, num_kv_heads, n_rep, head_dim)
        if b == 1:
            k, v = _single_decode_kv(ctx, kind, k_pool, v_pool, num_kv_heads, head_dim)
            mask = None
        elif kind.window is not None:  # the blocks each row's window reaches
            table, mask = ctx.decode_window(kind.window)
            k = k_pool.index_select(0, table).view(b, -1, num_kv_heads, head_dim)
            v = v_pool.index_select(0, table).view(b, -1, num_kv_heads, head_dim)
        else:
            k, v = _decode_kv(ctx, k_pool, v_pool, b, num_kv_heads, head_dim)
            mask = ctx.decode_mask
        # k, v: [B, keys, Hkv, D]
        o = decode_attention(q, k, v, kind, mask)
        out[0, :b] = o.reshape(b, num_heads, head_dim)  # o: [B, Hkv, n_rep, D]
    for p in ctx.prefills:
        end = p.q_start + p.q_len
        q = query[:, :, p.q_start:end]  # [1, H, n, D]
        if p.block_table is None:
            o = chunk_attention(q, key[:, :, p.q_start:end], value[:, :, p.q_start:end], kind, None, True)
        else:
            lo, mask = (0, p.mask) if kind.window is None else p.window(kind.window)
            first, bs = lo // ctx.kv_cache.block_size, ctx.kv_cache.block_size
            if p.first_block is not None:  # consecutive blocks: a view of the pool, no copy
                end_block = p.first_block + p.block_table.numel()
                k, v = k_pool[p.first_block + first:end_block], v_pool[p.first_block + first:end_block]
            else:  # only the blocks from the first one the chunk's window reaches
                table = p.block_table[first:]
                k, v = k_pool.index_select(0, table), v_pool.index_select(0, table)
            start, stop = lo - first * bs, p.ctx_len - first * bs
            k = k.flatten(0, 1)[start:stop].transpose(0, 1)[None]
            v = v.flatten(0, 1)[start:stop].transpose(0, 1)[None]
            o = chunk_attention(q, k, v, kind, mask, False)
        out[0, p.q_start:end] = o[0].transpose(0, 1)  # o: [1, H, n, D]
    return out, None


def _outside_a_step(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, kind: LayerAttention,
                    kwargs: dict[str, Any]) -> torch.Tensor:
    """Attention without a step: the T queries are the last T of the S keys (the embed op's
    one causal chunk, or a ``generate`` over transformers' own cache), each layer's kind
    applied. transformers makes no mask for an attention function it does not know, so a
    mask here is a caller's own: only plain full attention takes it (as stock SDPA would)."""
    if attention_mask is not None:
        if not (kind.fused and kind.window is None):
            raise RuntimeError("a masked forward outside the engine on a layer with a window, "
                               "soft-cap or sinks")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=kind.scaling, **kwargs)[0]
    tokens, keys = query.shape[2], key.shape[2]
    if tokens == keys:
        return chunk_attention(query, key, value, kind, None, True).transpose(1, 2)
    mask = causal_mask(keys - tokens, tokens, 0, keys, kind.window, query.device)
    return chunk_attention(query, key, value, kind, mask, False).transpose(1, 2)


@contextmanager
def step_context(ctx: Any):
    _local.context = ctx
    try:
        yield
    finally:
        _local.context = None


def _single_decode_kv(ctx: StepContext, kind: LayerAttention, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding sequence's K and V that its query sees, [1, keys, Hkv, D] each: the
    window's blocks only, read in place when they are consecutive."""
    ctx_len, bs = ctx.decode_ctx_len, ctx.kv_cache.block_size
    lo = kind.lowest_key(ctx_len - 1)
    first = lo // bs
    if ctx.decode_first_block is not None:
        start_block = ctx.decode_first_block + first
        end_block = ctx.decode_first_block + ctx.decode_block_tables.numel()
        k, v = k_pool[start_block:end_block], v_pool[start_block:end_block]
    else:
        table = ctx.decode_block_tables[first:]
        k, v = k_pool.index_select(0, table), v_pool.index_select(0, table)
    k = k.reshape(1, -1, num_kv_heads, head_dim)[:, lo - first * bs:ctx_len - first * bs]
    v = v.reshape(1, -1, num_kv_heads, head_dim)[:, lo - first * bs:ctx_len - first * bs]
    return k, v


def _decode_kv(ctx: StepContext, k_pool: torch.Tensor, v_pool: torch.Tensor, b: int,
               num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' K and V, [B, max_blocks * bs, Hkv, D] each (padded with block 0)."""
    first = ctx.decode_first_block
    if first is not None:  # consecutive blocks (common): read the pool in place
        n_blocks = ctx.decode_block_tables.numel()
        return (k_pool[first:first + n_blocks].view(1, -1, num_kv_heads, head_dim),
                v_pool[first:first + n_blocks].view(1, -1, num_kv_heads, head_dim))
    # index_select on a flat 1-D table is much cheaper than 2-D advanced indexing
    table = ctx.decode_block_tables
    assert table is not None  # set for every decode step
    return (k_pool.index_select(0, table).view(b, -1, num_kv_heads, head_dim),
            v_pool.index_select(0, table).view(b, -1, num_kv_heads, head_dim))


def registered_attention():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def install_kinds(kinds: Any) -> None:
    """Give every attention module its ``LayerAttention`` (read by ``kind_of``)."""
    for module, kind in zip(kinds.modules, kinds.layers):
        setattr(module, KIND_ATTRIBUTE, kind)
