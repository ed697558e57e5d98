"""What a generate request's own history does to its logits, batched over the step.

``SequenceSampling`` is one sequence's sampling state, made once when the request arrives:
its generator, its ``logit_bias`` and the ids ``min_tokens`` masks as small device tensors,
and, when it has penalties, the count of every token it generated so far (a [V] int32
tensor on the device, updated after each step, never recomputed) and the mask of its
prompt's tokens (for ``repetition_penalty``, built at its first step).

``sample_sequences`` samples one token for each row of a step (vLLM's order): logit bias and
``min_tokens`` masking, then the penalties, then the grammar's token bitmask (structured
output, ``station.sampling.grammar``), then ``station.sampling.sample.sample``
(temperature, min-p, top-k, top-p, the draw). Each stage is a few tensor ops over the rows
that use it; rows that use none are not copied and keep the cheap path (a greedy row is
exactly the argmax of its raw logits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from station.core.requests import SamplingParams
from station.sampling.grammar import SequenceGrammar, apply_masks
from station.sampling.sample import make_generator, sample

if TYPE_CHECKING:
    import xgrammar  # imported where a grammar is compiled, not at start


class SequenceSampling:
    """One generate sequence's sampling state (see the module docstring). ``stop_ids``: the
    ids that end it (eos unless ``ignore_eos``, ``stop_token_ids``), masked by
    ``min_tokens``; ``grammar``: the compiled grammar of structured output
    (``station.sampling.grammar``), which then decides where the output ends (``min_tokens``
    does not hold its stop tokens back, and stop ids that are not the grammar's own are
    always masked: they would end the output before it is complete; so are the grammar's
    ``forbidden_ids``, the control-character tokens of a JSON grammar). Made on the server's
    thread, so it makes no tensor there: each is built on the engine thread at the
    sequence's first step."""

    __slots__ = ("params", "generator", "num_generated", "counts", "_device", "_prompt",
                 "_prompt_seen", "_stops", "_stop_tensor", "_bias", "grammar")

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], stop_ids: Iterable[int],
                 device: torch.device | str = "cpu",
                 grammar: xgrammar.CompiledGrammar | None = None) -> None:
        self.params = params
        self.grammar = SequenceGrammar(grammar) if grammar is not None else None
        self._device = torch.device(device)
        self.generator = make_generator(params.seed, self._device)
        self.num_generated = 0
        self.counts: torch.Tensor | None = None  # [V] int32 completion token counts
        self._prompt = list(prompt_ids) if params.repetition_penalty != 1.0 else []
        self._prompt_seen: torch.Tensor | None = None  # [V] bool
        self._stops = sorted(set(stop_ids)) if params.min_tokens and grammar is None else []
        if grammar is not None:  # only the grammar's own stop tokens may end its output
            self._stops = sorted(set(stop_ids) - set(grammar.tokenizer_info.stop_token_ids)
                                 | set(getattr(grammar, "forbidden_ids", ())))
        self._stop_tensor: torch.Tensor | None = None
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def masks_stops(self) -> bool:
        return bool(self._stops) and (self.grammar is not None
                                      or self.num_generated < self.params.min_tokens)

    @property
    def finished(self) -> bool:
        """The grammar is complete (its stop token accepted): the sequence ends (stop)."""
        return self.grammar is not None and self.grammar.terminated

    @property
    def failure(self) -> str | None:
        """Why the grammar cannot go on (the engine ends the sequence with an error)."""
        return self.grammar.failure if self.grammar is not None else None

    def touches_logits(self) -> bool:
        return (bool(self.params.logit_bias) or self.params.penalized or self.masks_stops
                or self.grammar is not None)

    def bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, biases) of ``logit_bias``."""
        if self._bias is None:
            pairs = self.params.logit_bias
            self._bias = (torch.tensor([t for t, _ in pairs], device=self._device),
                          torch.tensor([b for _, b in pairs], device=self._device))
        return self._bias

    def stop_tensor(self) -> torch.Tensor:
        if self._stop_tensor is None:
            self._stop_tensor = torch.tensor(self._stops, device=self._device)
        return self._stop_tensor

    def counts_for(self, vocab: int) -> torch.Tensor:
        if self.counts is None:
            self.counts = torch.zeros(vocab, dtype=torch.int32, device=self._device)
        return self.counts

    def prompt_seen_for(self, vocab: int) -> torch.Tensor:
        if self._prompt_seen is None:
            self._prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=self._device)
            if self._prompt:
                ids = torch.tensor([t for t in self._prompt if 0 <= t < vocab], device=self._device)
                self._prompt_seen.index_fill_(0, ids, True)
            self._prompt = []
        return self._prompt_seen


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
                    any_repetition: bool = True) -> torch.Tensor:
    """logits [R, V] with each row's penalties applied (out of place). ``counts`` [R, V]:
    how often each token is in the row's completion so far; ``prompt_seen`` [R, V]: in its
    prompt; ``presence``, ``frequency``, ``repetition`` [R].

    repetition (vLLM): a token in the prompt or completion has a positive logit divided by
    the penalty, a negative one multiplied; then OpenAI's
    ``logit -= presence * (count > 0) + frequency * count``. ``any_repetition`` false (no
    row's repetition differs from 1, known without reading the device) skips that part."""
    logits = logits.float()
    counts = counts.to(logits.dtype)
    in_output = counts > 0
    if any_repetition:
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
    pen_rows = [i for i in touched if states[i].params.penalized]
    counts = None
    if touched:
        index = torch.tensor(touched, device=logits.device)
        sub = logits.index_select(0, index).float()
        _bias_and_min_tokens(sub, [states[i] for i in touched])
        if pen_rows:
            where = {i: j for j, i in enumerate(touched)}
            at = torch.tensor([where[i] for i in pen_rows], device=logits.device)
            penalized, counts = _penalize(sub.index_select(0, at), [states[i] for i in pen_rows])
            sub = sub.index_copy(0, at, penalized)
        grammar_rows = [j for j, i in enumerate(touched) if states[i].grammar is not None]
        if grammar_rows:  # last, so nothing above can bring back a forbidden token
            grammars = [g for j in grammar_rows if (g := states[touched[j]].grammar) is not None]
            apply_masks(sub, grammar_rows, grammars)
        logits = logits.float().index_copy(0, index, sub)
    tokens = sample(logits, [s.params for s in states], [s.generator for s in states])
    if counts is not None:  # count the new tokens: one batched add, rows stay views
        picked = tokens.index_select(0, torch.tensor(pen_rows, device=tokens.device))
        counts[torch.arange(len(pen_rows), device=counts.device), picked.to(counts.device)] += 1
        for i, row in zip(pen_rows, counts.unbind(0)):
            states[i].counts = row
    grammar_states = [(s.grammar, i) for i, s in enumerate(states) if s.grammar is not None]
    if grammar_states:
        picked_list = tokens.tolist()
        for grammar, i in grammar_states:
            grammar.accept(picked_list[i])
    for state in states:
        state.num_generated += 1
    return tokens


def _bias_and_min_tokens(logits: torch.Tensor, states: list[SequenceSampling]) -> None:
    """Add each row's ``logit_bias``; mask its stop ids while ``min_tokens`` holds them."""
    biased = [(j, s.bias()) for j, s in enumerate(states) if s.params.logit_bias]
    if biased:
        _scatter(logits, [j for j, _ in biased], [b[0] for _, b in biased],
                 [b[1] for _, b in biased], accumulate=True)
    masked = [(j, s) for j, s in enumerate(states) if s.masks_stops]
    if masked:
        _scatter(logits, [j for j, _ in masked], [s.stop_tensor() for _, s in masked],
                 float("-inf"), accumulate=False)


def _penalize(logits: torch.Tensor, states: list[SequenceSampling]) -> tuple[torch.Tensor, torch.Tensor]:
    """(penalised logits [P, V], the rows' stacked token counts [P, V])."""
    vocab, device = logits.shape[1], logits.device
    counts = torch.stack([s.counts_for(vocab) for s in states])
    repetition = any(s.params.repetition_penalty != 1.0 for s in states)
    seen = (torch.stack([s.prompt_seen_for(vocab) for s in states]) if repetition
            else torch.zeros_like(counts, dtype=torch.bool))
    factors = torch.tensor([[s.params.presence_penalty, s.params.frequency_penalty,
                             s.params.repetition_penalty] for s in states],
                           dtype=logits.dtype).to(device)
    return apply_penalties(logits, counts, seen, factors[:, 0], factors[:, 1], factors[:, 2],
                           repetition), counts
