"""The batched sampler's controls on plain logits tensors: penalties against a direct
computation, logit bias, min_tokens, min_p, and the batched filters against a per-row
reference."""

from __future__ import annotations

import pytest
import torch

from gnosis_daemon.protocol import ErrorCode, OpError
from station.core.requests import SamplingParams
from station.sampling.logits import SequenceSampling, apply_penalties, sample_sequences
from station.sampling.sample import filter_logits, make_generator, sample

V = 40


def _logits(rows: int = 3, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def _state(prompt=(1, 2, 3), stop_ids=(), **params) -> SequenceSampling:
    params.setdefault("temperature", 0.0)
    return SequenceSampling(SamplingParams(max_tokens=100, **params), list(prompt), stop_ids)


def test_presence_and_frequency_penalties_match_openais_formula():
    logits = _logits(rows=2)
    counts = torch.zeros(2, V, dtype=torch.int32)
    counts[0, 5], counts[0, 7], counts[1, 5] = 3, 1, 2
    presence, frequency = torch.tensor([0.5, -1.0]), torch.tensor([0.25, 2.0])
    got = apply_penalties(logits, counts, torch.zeros(2, V, dtype=torch.bool), presence,
                          frequency, torch.ones(2))
    expected = logits.clone()
    for row in range(2):
        for token in range(V):
            c = int(counts[row, token])
            expected[row, token] -= float(presence[row]) * (c > 0) + float(frequency[row]) * c
    torch.testing.assert_close(got, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 4.0]])
    counts = torch.tensor([[1, 1, 0, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False, False, True, True, False]])
    got = apply_penalties(logits, counts, prompt, torch.zeros(1), torch.zeros(1), torch.tensor([2.0]))
    torch.testing.assert_close(got, torch.tensor([[1.0, -4.0, 1.5, -2.0, 4.0]]))


def test_penalties_count_the_tokens_generated_so_far_incrementally():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4] = 1.0, 0.9  # greedy picks 3, then (penalised) 4, then 3...
    state = _state(presence_penalty=0.0, frequency_penalty=0.15)
    picked = [int(sample_sequences(logits, [state])[0]) for _ in range(6)]
    assert picked == [3, 4, 3, 4, 3, 4]
    expected = torch.zeros(V, dtype=torch.int32)
    expected[3], expected[4] = 3, 3
    assert torch.equal(state.counts, expected)


def test_logit_bias_forces_or_removes_a_token():
    logits = _logits(rows=2)
    top2 = torch.topk(logits[0], 2).indices.tolist()
    forced = _state(logit_bias=((11, 100.0),))
    banned = _state(logit_bias=((top2[0], -100.0),))
    assert sample_sequences(logits[:1], [forced]).tolist() == [11]
    assert sample_sequences(logits[:1], [banned]).tolist() == [top2[1]]


def test_a_plain_greedy_row_beside_processed_rows_is_the_raw_argmax():
    logits = _logits(rows=4)
    states = [_state(), _state(logit_bias=((0, 100.0),)), _state(presence_penalty=2.0),
              _state(temperature=1.0, seed=3, repetition_penalty=1.5)]
    tokens = sample_sequences(logits, states)
    assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[1]) == 0
    assert states[0].counts is None  # no penalties: no counts kept


def test_min_tokens_masks_the_stop_ids_until_enough_tokens():
    logits = torch.zeros(1, V)
    logits[0, 9], logits[0, 2] = 5.0, 1.0  # 9 is the "eos" the model would pick
    state = _state(stop_ids=(9,), min_tokens=2)
    assert [int(sample_sequences(logits, [state])[0]) for _ in range(3)] == [2, 2, 9]
    sampled = _state(stop_ids=(9,), min_tokens=50, temperature=1.0, seed=1)
    assert 9 not in [int(sample_sequences(logits, [sampled])[0]) for _ in range(50)]


def test_min_p_keeps_only_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(max_tokens=1, temperature=1.0, min_p=0.5, seed=5)
    gen = make_generator(p.seed)
    assert {int(sample(logits, [p], [gen])[0]) for _ in range(300)} == {0, 1}


def _reference_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The former per-row filter: temperature, top-k (ties kept), top-p."""
    row = row / max(p.temperature, 1e-5)
    if 0 < p.top_k < row.shape[-1]:
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= p.top_p
        drop_sorted[0] = False
        row = row.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted),
                              float("-inf"))
    return row


def test_batched_filters_equal_the_per_row_reference():
    logits = _logits(rows=6, vocab=200, seed=4)
    params = [SamplingParams(max_tokens=1, temperature=t, top_k=k, top_p=tp)
              for t, k, tp in [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.6), (0.9, 20, 0.8),
                               (2.0, 199, 0.95), (1.0, 500, 1.0)]]
    t = torch.tensor([p.temperature for p in params])
    k = torch.tensor([p.top_k for p in params])
    tp = torch.tensor([p.top_p for p in params])
    got = filter_logits(logits, t, k, tp, torch.zeros(6))
    for row, p in enumerate(params):
        expected = _reference_filter(logits[row], p)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(expected)), row
        torch.testing.assert_close(got[row][~torch.isinf(got[row])],
                                   expected[~torch.isinf(expected)])


def test_seeded_rows_are_reproducible_whatever_shares_the_batch():
    logits = _logits(rows=3, vocab=100, seed=8)

    def run(batch: list[int]) -> list[int]:
        states = {i: _state(temperature=1.5, seed=77 if i == 0 else None,
                            frequency_penalty=0.5, logit_bias=((i, 1.0),)) for i in batch}
        return [int(sample_sequences(logits[batch], [states[i] for i in batch])[batch.index(0)])
                for _ in range(15)]

    alone = run([0])
    assert run([0, 1, 2]) == alone and run([2, 0]) == alone
    assert len(set(alone)) > 1


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.01),
                                 dict(repetition_penalty=0.0), dict(min_p=1.5),
                                 dict(logit_bias=((1, 101.0),)), dict(min_tokens=-1),
                                 dict(logit_bias=tuple((i, 1.0) for i in range(301))),
                                 dict(presence_penalty=float("nan"))])
def test_out_of_range_controls_are_refused(bad):
    with pytest.raises(OpError) as err:
        SamplingParams(max_tokens=1, **bad)
    assert err.value.code is ErrorCode.BAD_REQUEST and repr(next(iter(bad))) in err.value.message
