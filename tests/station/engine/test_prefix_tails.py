"""Reuse inside a block, end to end on a tiny real model (no socket): the same prompt again
computes no row (its first token is sampled from the logits its first computation kept), a
prompt that extends an earlier one mid-block computes from the first token it does not
share, and every hit answers the tokens a fresh computation does."""

from __future__ import annotations

import pytest

from station.core.requests import (Choices, Finished, GenerationRequest, Prefill, SamplingParams,
                                   Sessions, Token)
from tests.station.engine import test_paged_engine as _engine_tests
from tests.station.engine.test_paged_engine import (BS, Collector, assert_pool_clean, engine_for,
                                                    prompt_of, reference, submit)

tiny = _engine_tests.tiny  # the module's fixture: tiny models built once

pytestmark = pytest.mark.usefixtures("few_threads")


def generate(engine, rid: str, prompt: list[int], n: int, *, choices: int = 1,
             **sessions) -> Collector:
    collector = Collector()
    engine.add_request(GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0.0),
                                         Sessions(**sessions), Choices(n=choices)), collector)
    while sum(isinstance(e, Finished) for e in collector.events) < choices:
        collector.done.clear()
        collector.wait()
    return collector


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("length", [27, 28])  # a partial last block, and none
def test_the_same_prompt_again_computes_no_row(tiny, family, length):
    path, loaded = tiny(family)
    prompt = prompt_of(40 + length, length)
    expected = reference(path, prompt, 12)
    with engine_for(loaded) as engine:
        first = submit(engine, "a", prompt, 12).wait()
        assert first.tokens == expected and first.one(Prefill).cached_tokens == 0
        before = engine.stats()
        second = submit(engine, "b", prompt, 12).wait()
        after = engine.stats()
        assert second.tokens == expected
        assert second.one(Prefill).cached_tokens == second.one(Finished).cached_tokens == length
        assert after["prefill_tokens"] - before["prefill_tokens"] == 0  # the model ran no prompt row
        assert after["prompt_ends_served"] - before["prompt_ends_served"] == 1
        # The first token's step samples the kept row (no forward), then the decodes.
        assert after["steps"] - before["steps"] == len(expected)
        assert after["prefix_cache_hits_tokens"] - before["prefix_cache_hits_tokens"] == length
        assert_pool_clean(engine)


def test_a_prompt_ending_where_another_ended_early_computes_its_last_row(tiny):
    """A cached block holding the prompt's tokens and more, whose kept row follows other
    tokens, serves all but the last token: that row is computed."""
    path, loaded = tiny("llama")
    prompt = prompt_of(60, 26)
    with engine_for(loaded) as engine:
        submit(engine, "a", prompt, 4).wait()  # its end row follows token 26
        shorter = prompt[:25]
        before = engine.stats()
        hit = submit(engine, "b", shorter, 6).wait()
        assert hit.one(Prefill).cached_tokens == 24
        assert engine.stats()["prefill_tokens"] - before["prefill_tokens"] == 1
        assert hit.tokens == reference(path, shorter, 6)


def test_a_turn_reuses_the_answer_tokens_of_a_partial_block(tiny):
    path, loaded = tiny("llama")
    prompt = prompt_of(50, 26)
    with engine_for(loaded) as engine:
        turn1 = submit(engine, "a", prompt, 6).wait()
        # 26 + 5 answer tokens computed (the last one has no KV): 7 full blocks + 3 tokens.
        follow = prompt + turn1.tokens + prompt_of(51, 4)
        before = engine.stats()["prefill_tokens"]
        turn2 = submit(engine, "b", follow, 8).wait()
        assert turn2.one(Prefill).cached_tokens == 31
        assert engine.stats()["prefill_tokens"] - before == len(follow) - 31
        assert turn2.tokens == reference(path, follow, 8)


def test_a_prompt_that_departs_mid_block_reuses_up_to_the_shared_token(tiny):
    path, loaded = tiny("llama")
    prompt = prompt_of(52, 27)
    with engine_for(loaded) as engine:
        submit(engine, "a", prompt, 1).wait()  # 27 computed: 6 full blocks + 3 tokens
        departs = prompt[:26] + prompt_of(53, 5)
        hit = submit(engine, "b", departs, 8).wait()
        assert hit.one(Prefill).cached_tokens == 26
        assert hit.tokens == reference(path, departs, 8)


def test_another_tenants_identical_prompt_reuses_nothing(tiny):
    path, loaded = tiny("llama")
    prompt = prompt_of(54, 27)
    with engine_for(loaded) as engine:
        alice = generate(engine, "a", prompt, 6, tenant="alice")
        bob = generate(engine, "b", prompt, 6, tenant="bob")
        assert bob.one(Prefill).cached_tokens == 0 and bob.tokens == alice.tokens
        again = generate(engine, "c", prompt, 6, tenant="alice")
        assert again.one(Prefill).cached_tokens == 27 and again.tokens == alice.tokens
        assert alice.tokens == reference(path, prompt, 6)


def test_n_choices_fork_from_a_tail_hit(tiny):
    path, loaded = tiny("llama")
    prompt = prompt_of(55, 27)
    with engine_for(loaded) as engine:
        submit(engine, "a", prompt, 5).wait()
        before = engine.stats()["prefill_tokens"]
        both = generate(engine, "b", prompt, 5, choices=2)
        assert engine.stats()["prefill_tokens"] - before == 0  # the kept row, for both choices
        assert both.one(Prefill).cached_tokens == 27
        per_choice: dict[str, list[int]] = {}
        for e in both.events:
            if isinstance(e, Token):
                per_choice.setdefault(e.request_id, []).append(e.token_id)
        assert per_choice == {"b": reference(path, prompt, 5), "b#1": reference(path, prompt, 5)}
        assert_pool_clean(engine)


def test_a_session_saved_and_loaded_after_a_tail_hit(tiny):
    path, loaded = tiny("llama")
    prompt = prompt_of(56, 27)
    expected = reference(path, prompt, 6)
    with engine_for(loaded) as engine:
        submit(engine, "a", prompt, 6).wait()
        saved = generate(engine, "b", prompt, 6, save_session="s")
        pre = saved.one(Prefill)
        assert (pre.cached_tokens, pre.saved) == (27, True) and saved.tokens == expected
        assert engine.kv.sessions.get("s").num_tokens == 24  # sessions hold full blocks only
        loaded_hit = generate(engine, "c", prompt, 6, load_session="s")
        pre = loaded_hit.one(Prefill)
        assert (pre.session_loaded, pre.session_tokens, pre.cached_tokens) == (True, 24, 27)
        assert loaded_hit.tokens == expected


def test_a_small_pool_evicts_tails_and_serves_nothing_stale(tiny):
    path, loaded = tiny("llama")
    a, b = prompt_of(57, 20), prompt_of(58, 20)
    with engine_for(loaded, num_blocks=8) as engine:
        first = submit(engine, "a", a, 4).wait()  # 23 computed: blocks 0-4 full, 5 holds 3
        assert engine.kv.pool.num_partial_blocks == 1
        # b takes the 2 unused blocks, then a's tail and a's blocks 4, 3, 2 (LRU order).
        other = submit(engine, "b", b, 4).wait()
        assert other.one(Prefill).cached_tokens == 0
        again = submit(engine, "c", a, 4).wait()
        assert again.one(Prefill).cached_tokens == 2 * BS  # a's blocks 0 and 1 only
        assert first.tokens == again.tokens == reference(path, a, 4)
        assert other.tokens == reference(path, b, 4)
        assert_pool_clean(engine)
