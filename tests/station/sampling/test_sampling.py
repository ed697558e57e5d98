from __future__ import annotations

import torch

from station.core.requests import SamplingParams
from station.sampling.sample import make_generator, sample


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_rows_take_argmax():
    logits = _logits()
    params = [SamplingParams(max_tokens=1, temperature=0.0)] * 4
    out = sample(logits, params, [None] * 4)
    assert out.dtype == torch.int64
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_same_seed_same_tokens():
    logits = _logits(rows=1)
    p = SamplingParams(max_tokens=1, temperature=1.5, seed=1234)

    def run() -> list[int]:
        gen = make_generator(p.seed)
        return [int(sample(logits, [p], [gen])[0]) for _ in range(20)]

    first, second = run(), run()
    assert first == second
    assert len(set(first)) > 1  # a high temperature really samples


def test_unseeded_generator_is_none():
    assert make_generator(None) is None


def test_top_k_one_equals_greedy():
    logits = _logits()
    params = [SamplingParams(max_tokens=1, temperature=2.0, top_k=1)] * 4
    gens = [make_generator(i) for i in range(4)]
    assert sample(logits, params, gens).tolist() == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = _logits()
    params = [SamplingParams(max_tokens=1, temperature=2.0, top_p=1e-6, seed=i) for i in range(4)]
    gens = [make_generator(p.seed) for p in params]
    for _ in range(5):
        assert sample(logits, params, gens).tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_distribution():
    logits = _logits(rows=1, vocab=100, seed=3)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    p = SamplingParams(max_tokens=1, temperature=5.0, top_k=5, seed=7)
    gen = make_generator(p.seed)
    seen = {int(sample(logits, [p], [gen])[0]) for _ in range(300)}
    assert seen <= allowed
    assert len(seen) > 1


def test_top_p_restricts_to_nucleus():
    # Probabilities 0.5, 0.3, 0.2: top_p=0.7 keeps the first two tokens only.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    p = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7, seed=1)
    gen = make_generator(p.seed)
    seen = {int(sample(logits, [p], [gen])[0]) for _ in range(300)}
    assert seen == {0, 1}


def test_mixed_batch_keeps_rows_independent():
    logits = _logits(rows=2)
    seeded = SamplingParams(max_tokens=1, temperature=1.0, seed=99)
    alone = [int(sample(logits[1:], [seeded], [make_generator(99)])[0]) for _ in range(1)]
    mixed = sample(logits, [SamplingParams(max_tokens=1, temperature=0.0), seeded],
                   [None, make_generator(99)])
    assert int(mixed[0]) == int(logits[0].argmax())
    assert int(mixed[1]) == alone[0]
