"""``n`` choices from one prompt: one prefill, shared prompt blocks.

A generate with ``n > 1`` becomes ``n`` sequences made together (``make_sequences``): the
first (the parent, index 0, the request's own id) is scheduled; the others (ids
``<id>#<i>``) wait on ``parent.forks``. When the parent's prompt is prefilled (the step
whose forward produced its last prompt position's logits), each child is forked
(``sample_step``) through the scheduler (``Scheduler.add_fork``) and the KV cache manager
(``KVCacheManager.fork``): it takes a reference on every full block of the prompt (the pool
is reference counted, the blocks are shared, nothing is copied) and gets one new block holding
a copy of the parent's partial last block (copy-on-fork: from then on each sequence writes its
own last block), is marked computed up to the prompt's end and joins the running batch; its
first token is sampled from the parent's logits row, with its own generator. A child the
pool has no block for is scheduled as a sequence of its own instead (its prompt's full
blocks are prefix-cache hits, only the partial block is recomputed).

So the prompt's blocks are allocated once (``stats``' ``blocks_allocated`` counts every
block handed out, ``prefill_tokens`` every token prefilled), only the parent saves sessions
(liquid memory sees the prompt once) and reports the prefill event, and every choice
decodes in the same batched forward. Choice ``i`` samples with ``seed + i`` (``seed`` unset:
torch's global generator), so a seeded request is reproducible and its choices differ.

The functions here take the parts they use (the scheduler, the KV keys, the runner's
prompt rows), never the engine; a parent that ends early hands its pending choices back
(``detach_forks``) for the engine to end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence as Seq

import torch

from station.core.block_pool import ExtraKeys
from station.core.requests import EventCallback, GenerationRequest
from station.core.scheduler import Scheduler, SchedulerOutput
from station.core.sequence import Sequence, SequenceKind
from station.engine.state import RequestState
from station.sampling.logits import SequenceSampling, sample_sequences
from station.sampling.logprobs import TokenLogprobs, prompt_logprobs, token_logprobs

PromptRow = tuple[Sequence, int, int, int]  # the runner's kept prompt rows (seq, start, row, n)


def choice_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


def make_sequences(request: GenerationRequest, on_event: EventCallback, *, extra_keys: ExtraKeys,
                   eos_token_ids: Iterable[int], device: torch.device) -> list[Sequence]:
    """The request's sequences, the parent first (its ``forks``: the others); ``extra_keys``:
    the request's tenant's block-hash keys, ``eos_token_ids``: the model's."""
    prompt = list(request.prompt_ids)
    params = request.params
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(eos_token_ids)
    seqs = []
    sessions, choices = request.sessions, request.choices
    for i in range(choices.n):
        p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
        parent = i == 0
        seqs.append(Sequence(
            choice_id(request.request_id, i), list(prompt), p,
            extra_keys=extra_keys, tenant=sessions.tenant,
            load_session=sessions.load_session if parent else None,
            match_session=sessions.match_session and parent,
            sampling=SequenceSampling(p, prompt, stop_ids, device, request.grammar),
            user=RequestState(on_event, frozenset(stop_ids),
                              save_session=sessions.save_session if parent else None,
                              save_final_session=sessions.save_final_session if parent else None,
                              pins=request.pins if parent else ()),
            logprobs=choices.logprobs,
            prompt_logprobs=choices.prompt_logprobs if parent else None))
    seqs[0].forks = seqs[1:]
    return seqs


def sample_step(scheduler: Scheduler, out: SchedulerOutput, logits: torch.Tensor | None,
                sampled: list[Sequence], prompt_rows: Seq[PromptRow]
                ) -> tuple[list[tuple[Sequence, int]], list[Sequence], list[int],
                           list[TokenLogprobs | None]]:
    """After a step's forward: fork the choices whose parent's prompt is done, sample every
    generate row, compute the logprobs asked for (``prompt_rows``: the runner's kept prompt
    rows of this step). Returns (held sequences with their logits row, generate sequences,
    their tokens, their ``TokenLogprobs`` or None)."""
    if logits is not None and prompt_rows:
        prompt_logprobs(logits, prompt_rows)
    pairs: list[tuple[Sequence, int]] = []
    for row, seq in enumerate(sampled):
        pairs.append((seq, row))
        if seq.forks and not seq.prefill_reported:
            children, seq.forks = seq.forks, []
            for child in children:
                if scheduler.add_fork(seq, child):
                    child.prefill_reported = True  # the parent reports the prefill
                    pairs.append((child, row))
                    out.forked.append(child)
    held = [(s, r) for s, r in pairs if s.kind is SequenceKind.HELD]
    gens = [(s, r) for s, r in pairs if s.kind is SequenceKind.GENERATE]
    if not gens:
        return held, [], [], []
    assert logits is not None
    rows = logits.index_select(0, torch.tensor([r for _, r in gens], device=logits.device))
    seqs = [s for s, _ in gens]
    tokens = sample_sequences(rows, [sampling_of(s) for s in seqs])
    return held, seqs, tokens.tolist(), token_logprobs(rows, seqs, tokens)


def sampling_of(seq: Sequence) -> SequenceSampling:
    """The sampling state of a generate sequence (a held one has none)."""
    assert seq.sampling is not None, f"generate sequence {seq.seq_id!r} has no sampling state"
    return seq.sampling


def detach_forks(seq: Sequence) -> list[Sequence]:
    """The parent ``seq`` ended before its prompt was prefilled: its pending choices, each
    finished with the parent's reason, for the engine to end as it ended the parent."""
    children, seq.forks = seq.forks, []
    for child in children:
        child.finish(seq.finish_reason)
    return children
