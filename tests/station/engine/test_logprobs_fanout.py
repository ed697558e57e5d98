"""Logprobs and ``n`` choices in the engine (no socket): logprobs equal a plain forward's log-softmax, prompt
logprobs take no prefix hit, ``n`` choices fork from one prefill and share its blocks."""

from __future__ import annotations

import pytest
import torch

from station.core.requests import Choices, Finished, GenerationRequest, Prefill, SamplingParams, Token
from tests.station.engine import test_paged_engine as _engine_tests
from tests.station.engine.test_paged_engine import Collector, engine_for, reference

tiny = _engine_tests.tiny  # the module's fixture: tiny models built once

pytestmark = pytest.mark.usefixtures("few_threads")

PROMPT = [5, 9, 77, 120, 33, 8, 200, 41, 17, 3]  # 10 tokens: 2 full blocks + a partial one


def plain_log_softmax(loaded, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(engine, request_id, prompt, *, n=1, logprobs=None, prompt_logprobs=None, **params):
    collector = Collector()
    params.setdefault("max_tokens", 6)
    params.setdefault("ignore_eos", True)
    engine.add_request(GenerationRequest(request_id, list(prompt), SamplingParams(**params),
                                         choices=Choices(n=n, logprobs=logprobs,
                                                         prompt_logprobs=prompt_logprobs)),
                       collector)
    return collector


def by_choice(collector) -> dict[str, list[Token]]:
    out: dict[str, list[Token]] = {}
    for e in collector.events:
        if isinstance(e, Token):
            out.setdefault(e.request_id, []).append(e)
    return out


def test_greedy_logprobs_equal_plain_forward(tiny):
    _, loaded = tiny("llama")
    with engine_for(loaded) as engine:
        c = run(engine, "a", PROMPT, temperature=0, logprobs=5, prompt_logprobs=3)
        while sum(isinstance(e, Finished) for e in c.events) < 1:
            c.wait()
    toks = [e for e in c.events if isinstance(e, Token)]
    ids = PROMPT + [t.token_id for t in toks]
    ref = plain_log_softmax(loaded, ids)
    for i, t in enumerate(toks):
        row = ref[len(PROMPT) - 1 + i]
        assert t.logprobs.top[0][0] == t.token_id == int(row.argmax())
        assert abs(t.logprobs.logprob - float(row[t.token_id])) < 1e-4
        top = row.topk(5)
        assert [x for x, _ in t.logprobs.top] == top.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(t.logprobs.top, top.values.tolist())) < 1e-4
    prefill = c.one(Prefill)
    plp = prefill.prompt_logprobs
    assert len(plp) == len(PROMPT) and plp[0].logprob is None
    for p in range(1, len(PROMPT)):
        assert plp[p].token_id == PROMPT[p]
        assert abs(plp[p].logprob - float(ref[p - 1][PROMPT[p]])) < 1e-4
        assert len(plp[p].top) == 3


def test_prompt_logprobs_take_no_prefix_hit(tiny):
    _, loaded = tiny("llama")
    with engine_for(loaded) as engine:
        run(engine, "a", PROMPT, temperature=0).wait()
        hit = run(engine, "b", PROMPT, temperature=0).wait()
        again = run(engine, "c", PROMPT, temperature=0, prompt_logprobs=0).wait()
    assert hit.one(Prefill).cached_tokens == 10  # 2 full blocks, the tail's 2 and its kept logits
    assert again.one(Prefill).cached_tokens == 0
    assert all(x is not None for x in again.one(Prefill).prompt_logprobs[1:])


def test_n_choices_share_one_prefill(tiny):
    path, loaded = tiny("llama")
    with engine_for(loaded) as engine:
        before = engine.stats()
        c = run(engine, "g", PROMPT, n=4, temperature=1.0, seed=7, max_tokens=5)
        while sum(isinstance(e, Finished) for e in c.events) < 4:
            c.done.clear()
            c.wait()
        after = engine.stats()
        again = run(engine, "h", PROMPT, n=2, temperature=0, max_tokens=5, ignore_eos=False)
        while sum(isinstance(e, Finished) for e in again.events) < 2:
            again.done.clear()
            again.wait()
        assert engine.stats()["blocks_held"] == 0
    choices = by_choice(c)
    assert sorted(choices) == ["g", "g#1", "g#2", "g#3"]
    assert len({tuple(t.token_id for t in ts) for ts in choices.values()}) == 4
    assert len([e for e in c.events if isinstance(e, Prefill)]) == 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(PROMPT)
    # 5 tokens each: KV for prompt + 4 = 14 positions, 4 blocks; the first 2 are shared.
    assert after["blocks_allocated"] - before["blocks_allocated"] == 2 + 4 * 2
    greedy = by_choice(again)
    ref = reference(path, PROMPT, 5)
    assert [t.token_id for t in greedy["h"]] == ref == [t.token_id for t in greedy["h#1"]]
    assert again.one(Prefill).cached_tokens == 10  # all of it, and the logits kept after it


def test_seeded_choices_reproducible(tiny):
    _, loaded = tiny("llama")
    outs = []
    for rid in ("r1", "r2"):
        with engine_for(loaded) as engine:
            c = run(engine, rid, PROMPT, n=3, temperature=1.0, seed=11)
            while sum(isinstance(e, Finished) for e in c.events) < 3:
                c.done.clear()
                c.wait()
        outs.append([[t.token_id for t in ts] for _, ts in sorted(by_choice(c).items())])
    assert outs[0] == outs[1]
