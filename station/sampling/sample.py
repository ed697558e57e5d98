"""Token sampling: batched tensor ops over a batch of logits.

Each row has its own ``SamplingParams`` and its own ``torch.Generator`` (seeded from
``params.seed``), so a seeded request gives the same tokens whatever else shares its batch.
Greedy rows take the argmax of their logits and never touch a generator.

The sampled rows are filtered together, each by its own parameters held in per-row tensors:
temperature, then ``min_p`` (vLLM's order), then ``top_k`` and ``top_p`` over one sort of
the rows that use them. A token is then drawn by the exponential race
(``argmax(probs / q)``, ``q ~ Exp(1)``, the same law as ``multinomial``): one draw of ``q``
from torch's global RNG for the unseeded rows, one per seeded row from its own generator
(per-request generators cannot share a draw). Penalties, ``logit_bias`` and ``min_tokens``
act on the logits before this (``station.sampling.logits``).
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


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, *, use_min_p: bool = True,
                  use_top: bool = True) -> torch.Tensor:
    """logits [R, V] -> logits [R, V] / temperature with the tokens each row's ``min_p``,
    ``top_k`` (0 = off) and ``top_p`` drop set to -inf; the parameters are [R] tensors on
    the logits' device. A row's most likely token always stays. ``use_min_p`` /
    ``use_top`` false (no row uses them, known without reading the device) skip a stage."""
    logits = logits.float() / temperature.clamp(min=1e-5).unsqueeze(1)
    vocab = logits.shape[-1]
    if use_min_p:
        probs = torch.softmax(logits, dim=-1)
        floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if not use_top:
        return logits
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    # top_k keeps every token at least as likely as the k-th (ties included).
    k = torch.where(use_k, top_k, vocab).clamp(1, vocab)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    drop = logits < kth
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # top_p: drop a token when the tokens before it already cover top_p; the first stays.
    probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop_sorted &= use_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop |= torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits [V] -> probabilities [V] after temperature, min-p, top-k and top-p."""
    assert logits.dim() == 1
    t = _row_params(logits.device, [params])
    return torch.softmax(filter_logits(logits.unsqueeze(0), *t), dim=-1)[0]


def _row_params(device: torch.device, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, ...]:
    """temperature, top_k, top_p, min_p as [R] tensors (one host-to-device copy; a top_k
    past any vocabulary is capped where float32 still holds it exactly)."""
    values = torch.tensor([[p.temperature, min(p.top_k, 1 << 24), p.top_p, p.min_p]
                           for p in params], dtype=torch.float32).to(device)
    return values[:, 0], values[:, 1].long(), values[:, 2], values[:, 3]


def _exponential(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            q[row].exponential_(generator=generator)
    return q.clamp_(min=torch.finfo(q.dtype).tiny)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] (int64), one row per request."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    out = torch.argmax(logits, dim=-1)  # [B]; greedy rows are already done
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out.to(torch.int64)
    index = torch.tensor(rows, device=logits.device)
    chosen = [params[i] for i in rows]
    probs = torch.softmax(filter_logits(
        logits.index_select(0, index), *_row_params(logits.device, chosen),
        use_min_p=any(p.min_p > 0 for p in chosen),
        use_top=any(p.top_k > 0 or p.top_p < 1.0 for p in chosen)), dim=-1)
    picked = probs.div_(_exponential(probs, [generators[i] for i in rows])).argmax(dim=-1)
    out = out.index_copy(0, index, picked.to(out.dtype))
    return out.to(torch.int64)
