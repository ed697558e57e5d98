"""Turns one scheduled step into one packed forward over the paged KV pool, and logits back.

Any decoder-only transformers model whose attention goes through ``AttentionInterface``
(Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, SmolLM, ...) reads and writes the pool: the
runner registers the attention function ``gnosis_paged``
(``station.forward.paged_attention``), gives each attention module its layer's kind
(window, soft-cap, sinks: ``station.forward.attention_kinds``) and switches the model to
it. The model is called with every scheduled token packed into one row (batch 1), absolute
``position_ids`` (the model applies rotary before attention) and no cache object or mask.

Every per-step index tensor is built once per step (``StepContext``), not per layer. Only
the rows whose logits are needed reach ``lm_head`` (``VocabHead``, or the model's own
forward with ``logits_to_keep`` when its logits are post-processed). Which body computes
the step (transformers' forward, the lean decoder, or the C step over every row:
``station.kernels.cpu_step``), which head, and whether pure-decode steps run a bucket's
static step replayed as a CUDA graph (``station.forward.decode_graphs``) is the decode
plan's (``station.plan``), fixed at start. The runner makes no policy decisions: it runs
exactly what the scheduler handed it, the way the plan says.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gnosis_daemon.logs import get_logger
from station.forward.attention_kinds import AttentionKinds
from station.forward.decode_graphs import DecodeGraphs, decode_rows
from station.forward.kv_cache import KVCache
from station.forward.paged_attention import (ATTN_IMPLEMENTATION, PrefillMeta, StepContext, causal_mask,
                                             install_kinds, register_attention, step_context,
                                             window_mask)
from station.core.scheduler import SchedulerOutput
from station.core.sequence import Sequence
from station.plan.choose import DecodeParts
from station.plan.plan import DecodePlan

log = get_logger(__name__)

def _prompt_rows(seq: Sequence, start: int, end: int, row: int) -> list[tuple[Sequence, int, int, int]]:
    """A ``prompt_logprobs`` sequence's chunk of positions start..end (its first at
    ``row`` of the step) -> the rows that predict prompt tokens, as (seq, start, row, count)."""
    if seq.prompt_logprobs is None or seq.prefill_reported:
        return []
    upto = min(end, seq.num_prompt_tokens - 1)
    return [(seq, start, row, upto - start)] if upto > start else []


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The step's parts end to end (a pure-decode step has one: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _first_if_consecutive(block_ids: list[int]) -> int | None:
    """The first id when the ids run first, first + 1, ... (then K/V are a view of the pool)."""
    first = block_ids[0]
    if block_ids[-1] - first != len(block_ids) - 1:
        return None
    return first if block_ids == list(range(first, first + len(block_ids))) else None


class ModelRunner:
    """Runs each step as the decode plan (``station.plan``) says: its body, head and static
    decode steps were chosen and built once (``choose_plan``); nothing is chosen here."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 kinds: AttentionKinds, plan: DecodePlan, parts: DecodeParts, max_positions: int) -> None:
        register_attention()
        install_kinds(kinds)  # each layer's window, soft-cap, sinks (station.forward.attention_kinds)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.kinds = kinds
        self.plan = plan
        self.model = model.eval()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        # The head for the rows a step keeps (station.kernels.dense.VocabHead); None: the
        # model's own forward, whose logits are post-processed.
        self._head = parts.head
        self._head_kernel = parts.head_kernel  # the head's Q8_0 kernel, on the C step's threads
        # The body of every step: a torch decoder over the packed row (the lean decoder or
        # transformers' forward), or the C step over every row (station.kernels.cpu_step).
        self._decoder = parts.body.decoder
        self._step = parts.body.step.bind(kv_cache, max_positions) if parts.body.step is not None else None
        self._torch_threads = torch.get_num_threads()
        # station.forward.decode_graphs: pure-decode steps within the plan's bounds through
        # the static step, replayed as CUDA graphs where the plan captures them.
        self._graphs: DecodeGraphs | None = None
        if parts.graphs is not None:  # the plan's static step runs the lean decoder and the head
            shape, decoder, head = parts.graphs, parts.body.decoder, parts.head
            assert decoder is not None and head is not None
            self._graphs = DecodeGraphs(kv_cache, device, decoder, head, step_context, shape.max_rows,
                                        shape.max_context, capture=shape.capture)

    @property
    def stepped(self) -> bool:
        """The C step computes this runner's steps (``cpu_step``), not torch."""
        return self._step is not None

    def graph_stats(self) -> dict[str, int]:
        return self._graphs.stats() if self._graphs is not None else {}

    def _stepped_head(self, stepped: torch.Tensor) -> torch.Tensor:
        """The C step's rows' logits, computed alike whatever else is in the step: the Q8_0
        head on the step's threads (the kernel's own sums) where there is one."""
        assert self._step is not None and self._head is not None  # the plan's c-step has a head
        with torch.inference_mode():
            if self._head_kernel is not None:
                return self._step.head(self._head_kernel, stepped)
            return self._head(stepped).float()

    def _quiet_torch(self, quiet: bool) -> None:
        """Decode steps that run wholly in C (the step, then the head's C kernel) leave torch
        one thread until the next prefill: the few torch ops around them (sampling) then open
        no OpenMP region, whose threads would spin for a while after it on the cores the C
        threads need (the cost through a station's socket is in docs/benchmarks.md)."""
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
        assert self._step is not None and self._head is not None
        self._quiet_torch(self._head_kernel is not None)
        with torch.inference_mode():
            hidden = self._step(tokens, positions, slots, tables)
        if not keep:  # a mid-prompt chunk only: no logits, no head
            return None, []
        return self._stepped_head(hidden[keep]), sampled

    def run(self, batch: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """One forward for the step -> (logits [K, V] float32, the K sequences to sample);
        rows past K: the prompt rows of ``prompt_logprobs`` sequences (``self.prompt_rows``).

        A prefill of no rows is a sequence admission gave every prompt token's KV and the
        logits after them (``Sequence.start_logits``, ``station.core.prompt_ends``): it is
        sampled from those, and when nothing else is scheduled no forward runs at all. Each
        sequence whose prompt's last row this step computed keeps a copy of it
        (``end_logits``), kept with the block that ends its prompt when it leaves the pool."""
        ready = [seq for seq, n in batch.prefills if n == 0]
        if ready:
            batch = replace(batch, prefills=[(s, n) for s, n in batch.prefills if n])
        if batch.decodes or batch.prefills:
            logits, sampled = self._forward(batch)
        else:
            logits, sampled, self.prompt_rows = None, [], []
        if ready:
            logits, sampled = self._with_ready(logits, sampled, ready)
        for i, seq in enumerate(sampled):
            if seq.num_tokens == seq.num_prompt_tokens and seq.end_logits is None:
                assert logits is not None
                seq.end_logits = logits[i].clone()
        return logits, sampled

    def _with_ready(self, logits: torch.Tensor | None, sampled: list[Sequence],
                    ready: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """The step's logits with the ready sequences' kept rows after the sampled ones
        (before any prompt rows, whose row numbers move up by as many)."""
        rows = torch.stack([seq.start_logits for seq in ready])
        for seq in ready:
            assert seq.num_uncomputed_tokens == 0, "a row-less prefill with tokens to compute"
            seq.end_logits, seq.start_logits = seq.start_logits, None
        if logits is None:
            return rows, ready
        k = len(sampled)
        logits = torch.cat([logits[:k], rows.to(logits.device, logits.dtype), logits[k:]])
        self.prompt_rows = [(s, start, row + len(ready), n) for s, start, row, n in self.prompt_rows]
        return logits, sampled + ready

    def _forward(self, batch: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """``run``'s forward over the rows scheduled (every prefill has at least one)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampled: list[Sequence] = []
        keep: list[int] = []

        if self._step is not None:  # the plan's body is the C step: every row of every step
            return self._run_stepped(batch)
        if self._graphs is not None and not batch.prefills and self._graphs.covers(batch.decodes):
            with torch.inference_mode():
                logits = self._graphs.run(batch.decodes)
            self.prompt_rows = []
            return logits, list(batch.decodes)
        assert self._decoder is not None  # a torch body
        decodes = batch.decodes
        num_decodes = len(decodes)
        decode_tables = decode_mask = decode_first = decode_lens = None
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
                decode_lens = torch.tensor(ctx_lens, dtype=torch.long)
                decode_mask = window_mask(decode_lens, max_blocks * bs, None)
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
                mask = causal_mask(start, n, 0, ctx_len, None)  # [n, ctx_len]
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
            slot_mapping=_joined(slot_parts).to(dev),
            num_decodes=num_decodes,
            decode_block_tables=None if decode_tables is None else decode_tables.to(dev),
            decode_mask=None if decode_mask is None else decode_mask.to(dev),
            decode_ctx_len=decode_ctx_len,
            prefills=prefills,
            decode_first_block=decode_first,
            decode_slot=slots[0] if num_decodes == 1 else -1,
            decode_lens=None if decode_lens is None else decode_lens.to(dev),
            decode_tables=tables if num_decodes > 1 else None,
            decode_ctx_lens=ctx_lens if num_decodes > 1 else None,
        )
        ids = _joined(ids_parts).to(dev)[None]
        pos_ids = _joined(pos_parts).to(dev)[None]
        with step_context(ctx), torch.inference_mode():
            if not keep:  # a mid-prompt chunk only: no logits, no head
                self._decoder(ids, pos_ids)
                return None, []
            if self._head is not None:
                hidden = self._decoder(ids, pos_ids)[0]
                if prefills:
                    hidden = hidden[torch.tensor(keep, device=dev, dtype=torch.long)]
                # (a pure-decode step keeps every row, in order: the rows as they are)
                return self._head(hidden).float(), sampled
            rows = torch.tensor(keep, device=dev, dtype=torch.long)
            # the plan's head is the model's own forward (its logits are post-processed)
            out = self.model(input_ids=ids, position_ids=pos_ids, use_cache=False, logits_to_keep=rows)
        return out.logits[0].float(), sampled  # [K, V]
