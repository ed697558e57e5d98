"""Turns one scheduled step into one packed forward over the paged KV pool, and logits back.

Any decoder-only transformers model whose attention goes through ``AttentionInterface``
(Llama, Mistral, Qwen2, SmolLM, ...) reads and writes the pool: we register the attention
function ``gnosis_paged`` and switch the model to it. The model is called with every
scheduled token packed into one row (batch 1), absolute ``position_ids`` (the model applies
rotary before attention) and no cache object or mask; per layer our attention function

1. writes the new K/V into their pool slots (``slot_mapping``), then
2. decode rows: gathers each sequence's blocks into a padded batch and runs ONE SDPA call
   for all of them (GQA packed as [B, kv_heads, n_rep, D], so K/V are never repeated);
3. prefill chunks: SDPA per chunk against the sequence's gathered K/V with an offset
   causal mask (or plain ``is_causal`` when the chunk starts the sequence).

Every per-step index tensor is built once per step (``StepContext``), not per layer. Only
the rows whose logits are needed reach ``lm_head`` (``VocabHead``, or the model's own
forward with ``logits_to_keep`` when its logits are post-processed). Two other ways run
the same step: the C step on a CPU (``station.runtime.cpu_step``, every row) and, for steps
whose rows all decode, a bucket's static step replayed as a CUDA graph
(``station.runtime.decode_graphs``). The runner makes no policy decisions: it runs exactly
what the scheduler handed it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gnosis_daemon.logs import get_logger
from station.runtime.decode_graphs import DecodeGraphs, StaticDecode, decode_rows
from station.runtime.kv_cache import KVCache
from station.runtime.lean_decoder import LeanDecoder
from station.runtime.linear_kernels import VocabHead, pack_decoder_linears
from station.core.scheduler import SchedulerOutput
from station.core.sequence import Sequence

log = get_logger(__name__)

ATTN_IMPLEMENTATION = "gnosis_paged"

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


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None, **kwargs):
    ctx: StepContext | None = getattr(_local, "context", None)
    if ctx is None:  # the model used outside the engine: behave like stock SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if type(ctx) is StaticDecode:  # a decode graph's step (station.runtime.decode_graphs)
        return ctx.attend(module, query, key, value, scaling), None
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
        k, v = _decode_kv(ctx, k_pool, v_pool, 1, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(query.reshape(1, num_kv_heads, n_rep, head_dim),
                                           k[:, :ctx.decode_ctx_len].transpose(1, 2),
                                           v[:, :ctx.decode_ctx_len].transpose(1, 2), scale=scaling)
        return o.view(1, 1, num_heads, head_dim), None
    k_slots.index_copy_(0, ctx.slot_mapping, key[0].transpose(0, 1))
    v_slots.index_copy_(0, ctx.slot_mapping, value[0].transpose(0, 1))

    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    if b:
        # q: [B, Hkv, n_rep, D] -- one query token per sequence, its heads grouped per kv head
        q = query[0, :, :b].transpose(0, 1).reshape(b, num_kv_heads, n_rep, head_dim)
        k, v = _decode_kv(ctx, k_pool, v_pool, b, num_kv_heads, head_dim)
        # k, v: [B, max_blocks * bs, Hkv, D]
        if ctx.decode_mask is None:
            k, v = k[:, :ctx.decode_ctx_len], v[:, :ctx.decode_ctx_len]
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=ctx.decode_mask, scale=scaling)
        out[0, :b] = o.reshape(b, num_heads, head_dim)  # o: [B, Hkv, n_rep, D]
    for p in ctx.prefills:
        end = p.q_start + p.q_len
        q = query[:, :, p.q_start:end]  # [1, H, n, D]
        if p.block_table is None:
            o = F.scaled_dot_product_attention(q, key[:, :, p.q_start:end], value[:, :, p.q_start:end],
                                               is_causal=True, scale=scaling, enable_gqa=n_rep > 1)
        else:
            if p.first_block is not None:  # consecutive blocks: a view of the pool, no copy
                end_block = p.first_block + p.block_table.numel()
                k, v = k_pool[p.first_block:end_block], v_pool[p.first_block:end_block]
            else:
                k, v = k_pool.index_select(0, p.block_table), v_pool.index_select(0, p.block_table)
            k = k.flatten(0, 1)[:p.ctx_len].transpose(0, 1)[None]
            v = v.flatten(0, 1)[:p.ctx_len].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scaling,
                                               enable_gqa=n_rep > 1)
        out[0, p.q_start:end] = o[0].transpose(0, 1)  # o: [1, H, n, D]
    return out, None


@contextmanager
def _step_context(ctx: StepContext | StaticDecode):
    _local.context = ctx
    try:
        yield
    finally:
        _local.context = None


def _decode_kv(ctx: StepContext, k_pool: torch.Tensor, v_pool: torch.Tensor, b: int,
               num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' K and V, [B, max_blocks * bs, Hkv, D] each (padded with block 0)."""
    first = ctx.decode_first_block
    if first is not None:  # consecutive blocks (common): read the pool in place
        n_blocks = ctx.decode_block_tables.numel()
        return (k_pool[first:first + n_blocks].view(1, -1, num_kv_heads, head_dim),
                v_pool[first:first + n_blocks].view(1, -1, num_kv_heads, head_dim))
    # index_select on a flat 1-D table is much cheaper than 2-D advanced indexing
    return (k_pool.index_select(0, ctx.decode_block_tables).view(b, -1, num_kv_heads, head_dim),
            v_pool.index_select(0, ctx.decode_block_tables).view(b, -1, num_kv_heads, head_dim))


def _prompt_rows(seq: Sequence, start: int, end: int, row: int) -> list[tuple[Sequence, int, int, int]]:
    """Issue 13: a ``prompt_logprobs`` sequence's chunk of positions start..end (its first at
    ``row`` of the step) -> the rows that predict prompt tokens, as (seq, start, row, count)."""
    if seq.prompt_logprobs is None or seq.prefill_reported:
        return []
    upto = min(end, seq.num_prompt_tokens - 1)
    return [(seq, start, row, upto - start)] if upto > start else []


def _first_if_consecutive(block_ids: list[int]) -> int | None:
    """The first id when the ids run first, first + 1, ... (then K/V are a view of the pool)."""
    first = block_ids[0]
    if block_ids[-1] - first != len(block_ids) - 1:
        return None
    return first if block_ids == list(range(first, first + len(block_ids))) else None


def _registered_attention():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 pack_linears: bool = True, lean: bool = True, head_kernel=None, step=None,
                 max_positions: int = 0, graphs: tuple[int, int] | None = None) -> None:
        register_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.eval()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        # station.runtime.linear_kernels: on CPU fp32 the linears run through oneDNN, packed once.
        # When logits are exactly lm_head(hidden), the runner applies the head itself
        # (VocabHead); else the model's own forward.
        if pack_linears:
            pack_decoder_linears(model)
        self._head = VocabHead.for_model(model, pack=pack_linears, kernel=head_kernel)
        # station.runtime.lean_decoder: the same layers' arithmetic without transformers'
        # per-call wrappers (Llama family); None: the model's own forward.
        self._lean = LeanDecoder.for_model(model, _registered_attention) if lean else None
        # station.runtime.cpu_step: every row of a step, decode or prompt, through C calls
        # of up to 8 rows (4-bit Llama-family on a CPU), where the runner applies the head.
        self._step = (step.bind(kv_cache, max_positions) if step is not None and self._head is not None
                      and max_positions > 0 else None)
        self._torch_threads = torch.get_num_threads()
        # station.runtime.decode_graphs: pure-decode steps replayed as CUDA graphs (captured on
        # a GPU; on a CPU the same static step, eagerly, where the setting asks for it).
        # ``graphs``: (the most rows, the longest context) to capture; None: eager steps.
        self._graphs = (self._decode_graphs(graphs[0], min(graphs[1], max_positions))
                        if graphs is not None else None)

    def _decode_graphs(self, max_batch: int, max_context: int) -> DecodeGraphs | None:
        reason = ("the model's forward is not the lean decoder's" if self._lean is None
                  else "the model's logits are post-processed" if self._head is None
                  else "the KV pool has no scratch block" if self.kv_cache.scratch_block is None
                  else "no context to capture" if max_context < 1 else None)
        if reason is not None:
            log.info("decode_graphs_not_used", reason=reason)
            return None
        return DecodeGraphs(self.kv_cache, self.device, self._lean, self._head, _step_context,
                            max_batch, max_context, capture=self.device.type == "cuda")

    def graph_stats(self) -> dict[str, int]:
        return self._graphs.stats() if self._graphs is not None else {}

    def _decoder(self, ids: torch.Tensor, pos_ids: torch.Tensor) -> torch.Tensor:
        if self._lean is not None:
            return self._lean(ids, pos_ids)
        return self.model.base_model(input_ids=ids, position_ids=pos_ids, use_cache=False).last_hidden_state

    def _stepped_head(self, stepped: torch.Tensor) -> torch.Tensor:
        """The C step's rows' logits, computed alike whatever else is in the step: the Q8_0
        head on the step's threads (the kernel's own sums) where there is one."""
        kernel = getattr(self._head, "kernel", None)
        with torch.inference_mode():
            if kernel is not None:
                return self._step.head(kernel, stepped)
            return self._head(stepped).float()

    def _quiet_torch(self, quiet: bool) -> None:
        """Decode steps that run wholly in C (the step, then the head's C kernel) leave torch
        one thread until the next prefill: the few torch ops around them (sampling) then open
        no OpenMP region, whose threads would spin for a while after it on the cores the C
        threads need (on 2 cores: 54-65 against 83-106 tok/s through a station's socket)."""
        want = 1 if quiet else self._torch_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _keep_prompt_rows(self, extra: list[tuple[Sequence, int, int, int]], keep: list[int]) -> None:
        """``extra`` (``_prompt_rows``' entries) kept after the sampled rows in ``keep``;
        ``self.prompt_rows``: (seq, first position, first row in the returned logits, rows)
        per ``prompt_logprobs`` chunk."""
        self.prompt_rows = []
        for seq, start, row, n in extra:
            self.prompt_rows.append((seq, start, len(keep), n))
            keep.extend(range(row, row + n))

    def _run_stepped(self, batch: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """``run`` where the C step takes every row, the prompts' too: each token's K/V is
        then one arithmetic's, whether its row was a decode or a prompt's, so a prefix hit
        on a previous answer is the same to the bit as computing it again."""
        bs = self.block_size
        tokens, positions, slots, tables = decode_rows(batch.decodes, bs)
        sampled = list(batch.decodes)
        keep = list(range(len(tokens)))
        extra: list[tuple[Sequence, int, int, int]] = []
        for seq, n in batch.prefills:
            start, row = seq.num_computed_tokens, len(tokens)
            end = start + n
            table = [b.block_id for b in seq.blocks[:-(-end // bs)]]
            tokens.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.extend([table] * n)
            if end == seq.num_tokens:
                keep.append(row + n - 1)
                sampled.append(seq)
            extra += _prompt_rows(seq, start, end, row)
        self._keep_prompt_rows(extra, keep)
        self._quiet_torch(getattr(self._head, "kernel", None) is not None)
        with torch.inference_mode():
            hidden = self._step(tokens, positions, slots, tables)
        if not keep:  # a mid-prompt chunk only: no logits, no head
            return None, []
        return self._stepped_head(hidden[keep]), sampled

    def run(self, batch: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """One forward for the step -> (logits [K, V] float32, the K sequences to sample);
        rows past K: the prompt rows of ``prompt_logprobs`` sequences (``self.prompt_rows``)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampled: list[Sequence] = []
        keep: list[int] = []

        if self._step is not None and (batch.decodes or batch.prefills) and self._step.fits(
                [seq.num_computed_tokens for seq in batch.decodes]
                + [seq.num_computed_tokens + n - 1 for seq, n in batch.prefills]):
            return self._run_stepped(batch)
        if self._graphs is not None and batch.decodes and not batch.prefills:
            with torch.inference_mode():
                logits = self._graphs.run(batch.decodes)
            if logits is not None:
                self.prompt_rows = []
                return logits, list(batch.decodes)
        decodes = batch.decodes
        num_decodes = len(decodes)
        decode_tables = decode_mask = decode_first = None
        decode_ctx_len = 0
        if decodes:
            input_ids, positions, slots, tables = decode_rows(decodes, bs)
            ctx_lens = [pos + 1 for pos in positions]
            max_blocks = max(len(table) for table in tables)
            # Pad with block 0: padded slots are masked out (or sliced off when B == 1).
            decode_tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables],
                                         dtype=torch.long).flatten()
            if num_decodes == 1:
                decode_ctx_len = ctx_lens[0]
                decode_first = _first_if_consecutive(tables[0])
            else:
                lens = torch.tensor(ctx_lens, dtype=torch.long)
                decode_mask = (torch.arange(max_blocks * bs)[None, :] < lens[:, None]).view(
                    num_decodes, 1, 1, max_blocks * bs)
            keep.extend(range(num_decodes))
            sampled.extend(decodes)

        prefills: list[PrefillMeta] = []
        extra: list[tuple[Sequence, int, int, int]] = []
        ids_parts = [torch.tensor(input_ids, dtype=torch.long)]
        pos_parts = [torch.tensor(positions, dtype=torch.long)]
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        q_start = num_decodes
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            ctx_len = start + n
            pos = torch.arange(start, ctx_len)
            block_ids = [b.block_id for b in seq.blocks[:-(-ctx_len // bs)]]
            table = torch.tensor(block_ids, dtype=torch.long)
            ids_parts.append(torch.tensor(seq.token_ids[start:ctx_len], dtype=torch.long))
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            if start == 0:
                meta = PrefillMeta(q_start, n, ctx_len, None, None)
            else:
                mask = torch.arange(ctx_len)[None, :] <= pos[:, None]  # [n, ctx_len]
                meta = PrefillMeta(q_start, n, ctx_len, table.to(self.device), mask.to(self.device),
                                   _first_if_consecutive(block_ids))
            prefills.append(meta)
            if ctx_len == seq.num_tokens:
                keep.append(q_start + n - 1)
                sampled.append(seq)
            extra += _prompt_rows(seq, start, ctx_len, q_start)
            q_start += n
        self._keep_prompt_rows(extra, keep)

        self._quiet_torch(False)
        dev = self.device
        ctx = StepContext(
            kv_cache=self.kv_cache,
            slot_mapping=torch.cat(slot_parts).to(dev),
            num_decodes=num_decodes,
            decode_block_tables=None if decode_tables is None else decode_tables.to(dev),
            decode_mask=None if decode_mask is None else decode_mask.to(dev),
            decode_ctx_len=decode_ctx_len,
            prefills=prefills,
            decode_first_block=decode_first,
            decode_slot=slots[0] if num_decodes == 1 else -1,
        )
        ids = torch.cat(ids_parts).to(dev)[None]
        pos_ids = torch.cat(pos_parts).to(dev)[None]
        with _step_context(ctx), torch.inference_mode():
            if not keep:  # a mid-prompt chunk only: no logits, no head
                self._decoder(ids, pos_ids)
                return None, []
            rows = torch.tensor(keep, device=dev, dtype=torch.long)
            if self._head is not None:
                return self._head(self._decoder(ids, pos_ids)[0, rows]).float(), sampled
            out = self.model(input_ids=ids, position_ids=pos_ids, use_cache=False, logits_to_keep=rows)
        return out.logits[0].float(), sampled  # [K, V]
