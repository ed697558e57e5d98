"""``n`` choices from one prompt: one prefill, shared prompt blocks.

A generate with ``n > 1`` becomes ``n`` sequences made together (``make_sequences``): the
first (the parent, index 0, the request's own id) is scheduled; the others (ids
``<id>#<i>``) wait on ``parent.forks``. When the parent's prompt is prefilled (the step
whose forward produced its last prompt position's logits), each child is forked
(``sample_step``): it takes a reference on every full block of the prompt (the pool is
reference counted, the blocks are shared, nothing is copied) and gets one new block holding a
copy of the parent's partial last block (copy-on-fork: from then on each sequence writes its
own last block), is marked computed up to the prompt's end and joins the running batch; its
first token is sampled from the parent's logits row, with its own generator. A child the
pool has no block for is scheduled as a sequence of its own instead (its prompt's full
blocks are prefix-cache hits, only the partial block is recomputed).

So the prompt's blocks are allocated once (``stats``' ``blocks_allocated`` counts every
block handed out, ``prefill_tokens`` every token prefilled), only the parent saves sessions
(liquid memory sees the prompt once) and reports the prefill event, and every choice
decodes in the same batched forward. Choice ``i`` samples with ``seed + i`` (``seed`` unset:
torch's global generator), so a seeded request is reproducible and its choices differ.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from station.core.requests import EventCallback, GenerationRequest
from station.core.sequence import Sequence, SequenceKind, SequenceStatus
from station.engine.calls import RequestState
from station.sampling.logits import SequenceSampling, sample_sequences
from station.sampling.logprobs import prompt_logprobs, token_logprobs

if TYPE_CHECKING:
    from station.engine.loop import PagedEngine
    from station.core.scheduler import SchedulerOutput


def choice_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


def make_sequences(engine: PagedEngine, request: GenerationRequest,
                   on_event: EventCallback) -> list[Sequence]:
    """The request's sequences, the parent first (its ``forks``: the others)."""
    prompt = list(request.prompt_ids)
    params = request.params
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(engine.loaded.eos_token_ids)
    seqs = []
    for i in range(request.n):
        p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
        parent = i == 0
        seqs.append(Sequence(
            choice_id(request.request_id, i), list(prompt), p,
            extra_keys=engine.kv.extra_keys(request.tenant), tenant=request.tenant,
            load_session=request.load_session if parent else None,
            match_session=request.match_session and parent,
            sampling=SequenceSampling(p, prompt, stop_ids, engine.device, request.grammar),
            user=RequestState(on_event, frozenset(stop_ids),
                              save_session=request.save_session if parent else None,
                              save_final_session=request.save_final_session if parent else None),
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs if parent else None))
    seqs[0].forks = seqs[1:]
    return seqs


def _fork(engine: PagedEngine, parent: Sequence, child: Sequence) -> bool:
    """Give ``child`` the parent's prompt KV (engine thread, after the step's forward)."""
    pool, bs = engine.kv.pool, engine.block_size
    num_prompt = parent.num_prompt_tokens
    full, partial = divmod(num_prompt, bs)
    if partial and not pool.can_allocate(1):
        return False
    pool.touch(parent.blocks[:full])
    child.blocks = list(parent.blocks[:full])
    if partial:
        [block] = pool.allocate(1)
        kv = engine.kv_cache.kv  # [layers, 2, blocks, bs, kv_heads, head_dim]
        kv[:, :, block.block_id].copy_(kv[:, :, parent.blocks[full].block_id])
        child.blocks.append(block)
    child.block_hashes = list(parent.block_hashes[:full])
    child.num_registered_blocks = full
    child.num_computed_tokens = num_prompt
    child.num_cached_tokens = child.num_admitted_cached_tokens = parent.num_cached_tokens
    child.prefill_reported = True  # the parent reports the prefill
    child.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(child)
    return True


def sample_step(engine: PagedEngine, out: SchedulerOutput, logits: torch.Tensor | None,
                sampled: list[Sequence]) -> tuple[list[tuple[Sequence, int]], list, list, list]:
    """After a step's forward: fork the choices whose parent's prompt is done, sample every
    generate row, compute the logprobs asked for. Returns (held sequences with their logits
    row, generate sequences, their tokens, their ``TokenLogprobs`` or None)."""
    if logits is not None and engine.runner.prompt_rows:
        prompt_logprobs(logits, engine.runner.prompt_rows)
    pairs: list[tuple[Sequence, int]] = []
    for row, seq in enumerate(sampled):
        pairs.append((seq, row))
        if seq.forks and not seq.prefill_reported:
            children, seq.forks = seq.forks, []
            for child in children:
                if _fork(engine, seq, child):
                    pairs.append((child, row))
                    out.forked.append(child)
                else:
                    engine.scheduler.waiting.appendleft(child)
    held = [(s, r) for s, r in pairs if s.kind is SequenceKind.HELD]
    gens = [(s, r) for s, r in pairs if s.kind is SequenceKind.GENERATE]
    if not gens:
        return held, [], [], []
    assert logits is not None
    rows = logits.index_select(0, torch.tensor([r for _, r in gens], device=logits.device))
    seqs = [s for s, _ in gens]
    tokens = sample_sequences(rows, [s.sampling for s in seqs])
    return held, seqs, tokens.tolist(), token_logprobs(rows, seqs, tokens)


def end_forks(engine: PagedEngine, seq: Sequence, error: Any = None) -> None:
    """The parent ended before its prompt was prefilled: its pending choices end with it
    (``error``: (code, message) when it failed)."""
    children, seq.forks = seq.forks, []
    for child in children:
        child.status, child.finish_reason = SequenceStatus.FINISHED, seq.finish_reason
        if error is not None:
            engine._end(child, *error)
        else:
            engine._finished(child)
