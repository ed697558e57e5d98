"""What a generate request's own history does to its logits, batched over the step.

``SequenceSampling`` is one sequence's sampling state, made once when the request arrives:
its generator, its ``logit_bias`` and the ids ``min_tokens`` masks as small device tensors,
and, when it has penalties, the count of every token it generated so far (a [V] int32
tensor on the device, updated after each step, never recomputed) and the mask of its
prompt's tokens (for ``repetition_penalty``, built at its first step).

``sample_sequences`` samples one token for each row of a step (vLLM's order): logit bias and
``min_tokens`` masking, then the penalties, then ``station.runtime.sampling.sample``
(temperature, min-p, top-k, top-p, the draw). Each stage is a few tensor ops over the rows
that use it; rows that use none are not copied and keep the cheap path (a greedy row is
exactly the argmax of its raw logits).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from station.core.requests import SamplingParams
from station.runtime.sampling import make_generator, sample


class SequenceSampling:
    """One generate sequence's sampling state (see the module docstring). ``stop_ids``: the
    ids that end it (eos unless ``ignore_eos``, ``stop_token_ids``), masked by
    ``min_tokens``."""

    __slots__ = ("params", "generator", "num_generated", "counts", "prompt_seen", "_prompt",
                 "bias_ids", "bias_values", "min_token_ids")

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], stop_ids: Iterable[int],
                 device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        self.params = params
        self.generator = make_generator(params.seed, device)
        self.num_generated = 0
        self.counts: torch.Tensor | None = None  # [V] int32, made at the first step
        self.prompt_seen: torch.Tensor | None = None  # [V] bool, made at the first step
        self._prompt = list(prompt_ids) if params.repetition_penalty != 1.0 else []
        self.bias_ids = self.bias_values = self.min_token_ids = None
        if params.logit_bias:
            self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
            self.bias_values = torch.tensor([b for _, b in params.logit_bias], device=device)
        stops = sorted(set(stop_ids))
        if params.min_tokens and stops:
            self.min_token_ids = torch.tensor(stops, device=device)

    @property
    def masks_stops(self) -> bool:
        return self.min_token_ids is not None and self.num_generated < self.params.min_tokens

    def touches_logits(self) -> bool:
        return self.bias_ids is not None or self.params.penalized or self.masks_stops

    def counts_for(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self.counts is None:
            self.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        return self.counts

    def prompt_seen_for(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self.prompt_seen is None:
            self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if self._prompt:
                ids = torch.tensor(self._prompt, device=device)
                self.prompt_seen.index_fill_(0, ids[ids < vocab], True)
            self._prompt = []
        return self.prompt_seen


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with each row's penalties applied (out of place). ``counts`` [R, V]:
    how often each token is in the row's completion so far; ``prompt_seen`` [R, V]: in its
    prompt; ``presence``, ``frequency``, ``repetition`` [R].

    repetition (vLLM): a token in the prompt or completion has a positive logit divided by
    the penalty, a negative one multiplied; then OpenAI's
    ``logit -= presence * (count > 0) + frequency * count``."""
    logits = logits.float()
    counts = counts.to(logits.dtype)
    in_output = counts > 0
    if bool((repetition != 1.0).any()):
        penalty = torch.where(in_output | prompt_seen, repetition.unsqueeze(1),
                              torch.ones_like(logits))
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * in_output


def _scatter(logits: torch.Tensor, rows: list[int], ids: list[torch.Tensor],
             values: list[torch.Tensor] | float, accumulate: bool) -> None:
    """logits[row, id] (+)= value for every row's ids, one index_put over all the rows."""
    lengths = torch.tensor([len(t) for t in ids], device=logits.device)
    row_index = torch.repeat_interleave(torch.tensor(rows, device=logits.device), lengths)
    col_index = torch.cat(ids)
    if isinstance(values, float):
        value = torch.full((len(col_index),), values, dtype=logits.dtype, device=logits.device)
    else:
        value = torch.cat(values).to(logits.dtype)
    logits.index_put_((row_index, col_index), value, accumulate=accumulate)


def sample_sequences(logits: torch.Tensor, states: Sequence[SequenceSampling]) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] (int64), row i for ``states[i]``; the engine
    appends every token returned, so each state records its token (counts, length)."""
    assert logits.dim() == 2 and logits.shape[0] == len(states)
    touched = [i for i, s in enumerate(states) if s.touches_logits()]
    penalized: list[SequenceSampling] = []
    counts = None
    if touched:
        device, vocab = logits.device, logits.shape[1]
        index = torch.tensor(touched, device=device)
        sub = logits.index_select(0, index).float()
        sub_states = [states[i] for i in touched]
        biased = [(j, s) for j, s in enumerate(sub_states) if s.bias_ids is not None]
        if biased:
            _scatter(sub, [j for j, _ in biased], [s.bias_ids for _, s in biased],
                     [s.bias_values for _, s in biased], accumulate=True)
        masked = [(j, s) for j, s in enumerate(sub_states) if s.masks_stops]
        if masked:
            _scatter(sub, [j for j, _ in masked], [s.min_token_ids for _, s in masked],
                     float("-inf"), accumulate=False)
        pen_rows = [j for j, s in enumerate(sub_states) if s.params.penalized]
        if pen_rows:
            penalized = [sub_states[j] for j in pen_rows]
            counts = torch.stack([s.counts_for(vocab, device) for s in penalized])
            seen = torch.stack([s.prompt_seen_for(vocab, device) for s in penalized])
            factors = torch.tensor([[s.params.presence_penalty, s.params.frequency_penalty,
                                     s.params.repetition_penalty] for s in penalized],
                                   dtype=sub.dtype).to(device)
            rows = torch.tensor(pen_rows, device=device)
            sub = sub.index_copy(0, rows, apply_penalties(
                sub.index_select(0, rows), counts, seen, factors[:, 0], factors[:, 1],
                factors[:, 2]))
        logits = logits.float().index_copy(0, index, sub)
    tokens = sample(logits, [s.params for s in states], [s.generator for s in states])
    if penalized:
        assert counts is not None
        picked = tokens.index_select(0, torch.tensor(
            [touched[j] for j in pen_rows], device=tokens.device))
        counts[torch.arange(len(penalized), device=counts.device), picked] += 1
        for state, row in zip(penalized, counts.unbind(0)):
            state.counts = row
    for state in states:
        state.num_generated += 1
    return tokens
