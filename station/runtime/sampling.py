"""Token sampling: small pure functions over a batch of logits.

Each row has its own ``SamplingParams`` and its own ``torch.Generator`` (seeded from
``params.seed``), so a seeded request gives the same tokens whatever else shares its batch.
Greedy rows take the argmax and never touch a generator.
"""

from __future__ import annotations

from typing import Sequence

import torch

from station.core.requests import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from ``seed`` on ``device``; ``None`` (draw from torch's global RNG) when unseeded."""
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits [V] -> probabilities [V] after temperature, top-k and top-p."""
    assert logits.dim() == 1
    logits = logits.float() / max(params.temperature, 1e-5)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already cover top_p; the first always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] (int64), one row per request."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    out = torch.argmax(logits, dim=-1)  # [B]; greedy rows are already done
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = logits_to_probs(logits[row], p)
        out[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return out.to(torch.int64)
