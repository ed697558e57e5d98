"""Log-probabilities of sampled and prompt tokens, batched over a step's rows.

A value is the log-softmax of the model's logits at the temperature the row samples with:
``log_softmax(logits / temperature)``, and plain ``log_softmax(logits)`` for a greedy row
(temperature 0). The logits are the model's own, before ``logit_bias``, penalties, the
``min_tokens`` mask or a grammar act (vLLM's default "raw" logprobs), so greedy values equal
a plain transformers forward's ``log_softmax(model(ids).logits)``.

``token_logprobs`` runs after the sampling of a step: one ``log_softmax`` and one ``topk``
over the rows that asked, one copy to the host. ``prompt_logprobs`` does the same for the
prompt rows the model runner kept (``ModelRunner.prompt_rows``): the row at position ``p``
gives the logprob of prompt token ``p + 1``; the first prompt token has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float | None  # None: the first prompt token (nothing predicts it)
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def _log_softmax(logits: torch.Tensor, temperatures: Seq[float]) -> torch.Tensor:
    scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32,
                         device=logits.device)
    return torch.log_softmax(logits.float() / scale.unsqueeze(1), dim=-1)


def _rows(lp: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[list, list, list]:
    """(chosen logprobs, top ids, top logprobs) as lists, one device-to-host copy each."""
    chosen = lp.gather(1, targets.to(lp.device).long().unsqueeze(1))[:, 0].tolist()
    if k <= 0:
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    values, ids = lp.topk(k, dim=-1)
    return chosen, ids.tolist(), values.tolist()


def token_logprobs(logits: torch.Tensor, seqs: Seq[Any], tokens: torch.Tensor) -> list[TokenLogprobs | None]:
    """logits [B, V] (the step's rows, before any logits processing), the B sequences and
    their sampled tokens [B] -> per row its ``TokenLogprobs``, None where not asked."""
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    lp = _log_softmax(logits.index_select(0, index), [seqs[i].params.temperature for i in rows])
    picked = tokens.to(logits.device).index_select(0, index)
    chosen, ids, values = _rows(lp, picked, max(seqs[i].logprobs for i in rows))
    for j, i in enumerate(rows):
        k = seqs[i].logprobs
        out[i] = TokenLogprobs(int(picked[j]), chosen[j], tuple(zip(ids[j][:k], values[j][:k])))
    return out


def prompt_logprobs(logits: torch.Tensor, prompt_rows: Seq[tuple[Any, int, int, int]]) -> None:
    """Fill ``seq.user.prompt_lps`` ([None, TokenLogprobs...] per prompt token) from the
    kept prompt rows: (seq, first position, first row, rows)."""
    for seq, start, row, n in prompt_rows:
        lp = _log_softmax(logits[row:row + n], [seq.params.temperature] * n)
        targets = torch.tensor(seq.token_ids[start + 1:start + 1 + n])
        chosen, ids, values = _rows(lp, targets, seq.prompt_logprobs)
        store = seq.user.prompt_lps
        if store is None:
            store = seq.user.prompt_lps = [TokenLogprobs(seq.token_ids[0], None)] + \
                [None] * (seq.num_prompt_tokens - 1)
        for j in range(n):
            store[start + 1 + j] = TokenLogprobs(int(targets[j]), chosen[j],
                                                 tuple(zip(ids[j], values[j])))


def prompt_logprobs_of(seq: Any) -> list[TokenLogprobs | None] | None:
    """What the prefill event reports: None when not asked."""
    if seq.prompt_logprobs is None:
        return None
    return seq.user.prompt_lps or [TokenLogprobs(seq.token_ids[0], None)]
