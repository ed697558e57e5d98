"""KV sessions: the registry without a model, then the paged engine on a tiny real model
(session hits with greedy parity, misses, tenants, budget, eviction pressure, reclaim,
held sequences batched into one step per token)."""

from __future__ import annotations

import threading

import pytest

from gnosis_daemon.settings import Settings
from station.core.block_pool import BlockPool
from station.core.requests import Finished, Prefill, GenerationRequest, SamplingParams, Sessions
from station.engine.calls import EngineCalls
from station.model.loader import load_model
from station.engine.loop import PagedEngine
from gnosis_daemon.tokens import common_prefix_len
from station.core.sessions import SessionRegistry
from tests.station.engine.test_paged_engine import (Collector, assert_pool_clean, prompt_of, reference)
from tests.support.tiny_models import build_tiny_model

BS = 4


# -- the registry alone
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def registry(num_blocks: int = 16, budget: int = 3) -> tuple[BlockPool, SessionRegistry]:
    pool = BlockPool(num_blocks, BS)
    return pool, SessionRegistry(pool, budget, clock=Clock())


def save_released(reg: SessionRegistry, name: str, tokens: list[int]):
    """Save the blocks of a sequence, then end it: the session alone holds them."""
    blocks = reg.pool.allocate(len(tokens) // BS)
    reg.save(name, "", tokens, blocks)
    reg.pool.free(blocks)
    return blocks


def test_save_pins_without_copy_and_replacing_unpins_the_old():
    pool, reg = registry()
    blocks = pool.allocate(2)  # held by a running sequence
    reg.save("s", "t", list(range(8)), blocks)
    pool.free(blocks)  # the sequence ends: pinned blocks stay out of the free queue
    assert pool.num_free_blocks == 14 and reg.pinned_blocks == 2
    assert not {b.block_id for b in blocks} & set(pool.free_queue_ids())
    other = pool.allocate(1)
    reg.save("s", "t", list(range(4)), [blocks[0]])  # same id: replaces, shares block 0
    assert reg.get("s").token_ids == (0, 1, 2, 3) and len(reg) == 1
    assert blocks[0].pin_cnt == 1 and blocks[1].pin_cnt == 0
    assert blocks[1].block_id in pool.free_queue_ids()
    assert blocks[0].block_id not in pool.free_queue_ids()
    pool.free(other)
    assert reg.delete("s") is True and reg.delete("s") is False
    assert pool.num_free_blocks == 16 and reg.pinned_blocks == 0


def test_budget_expires_least_recently_used():
    pool, reg = registry(budget=2)
    a = save_released(reg, "a", [1] * 4)
    b = save_released(reg, "b", [2] * 4)
    reg.use(reg.get("a"))  # a is now the most recent: b goes first
    save_released(reg, "c", [3] * 4)
    assert [s.session_id for s in reg.sessions()] == ["a", "c"]
    assert reg.num_expired == 1 and b[0].pin_cnt == 0 and a[0].pin_cnt == 1
    assert reg.get("a").last_used > reg.get("c").last_used - 2


def test_reclaim_expires_lru_only_when_it_makes_room():
    pool, reg = registry(num_blocks=8, budget=8)
    for name in "abc":
        save_released(reg, name, [0] * 8)
    running = pool.allocate(2)
    assert pool.num_free_blocks == 0
    assert reg.reclaim(3) == 2  # LRU a, then b: 4 blocks free, enough for 3
    assert [s.session_id for s in reg.sessions()] == ["c"] and pool.can_allocate(3)
    assert reg.reclaim(7) == 0  # even dropping c leaves 6: expire nothing
    assert reg.reclaim(6, keep="c") == 0 and len(reg) == 1
    pool.free(running)


def test_empty_session_and_common_prefix():
    pool, reg = registry()
    reg.save("probe", "", [], [])
    assert reg.get("probe").num_tokens == 0 and reg.pinned_blocks == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2 and common_prefix_len([], [1]) == 0


# -- the engine on a tiny model
pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("sessions") / "llama", "llama")
    settings = Settings(model=str(path), runtime_dir=str(tmp_path_factory.mktemp("rt")))
    return path, load_model(settings)


class Engine:
    def __init__(self, loaded, num_blocks: int = 256, **overrides) -> None:
        settings = Settings(runtime_dir="/tmp/unused-rt", kv_block_size=BS, **overrides)
        self.engine = PagedEngine(loaded, settings, num_blocks=num_blocks)
        self.n = 0

    def __enter__(self) -> Engine:
        self.engine.start()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.shutdown()

    def generate(self, prompt, n: int, **session) -> Collector:
        self.n += 1
        collector = Collector()
        self.engine.add_request(GenerationRequest(
            f"r{self.n}", list(prompt), SamplingParams(max_tokens=n, temperature=0.0),
            Sessions(**session)),
            collector)
        return collector.wait()

    def call(self, handler, owner="c1", **kwargs) -> dict:
        box, done = {}, threading.Event()

        def on_done(result, error):
            box["r"] = (result, error)
            done.set()

        self.engine.call(handler, owner, on_done, **kwargs)
        assert done.wait(60)
        result, error = box["r"]
        if error is not None:
            raise AssertionError(f"{error.code}: {error.message}")
        return result


def test_save_then_load_hits_with_greedy_parity(tiny):
    path, loaded = tiny
    prompt = prompt_of(11, 30)
    follow = prompt + prompt_of(12, 9)
    with Engine(loaded) as e:
        first = e.generate(prompt, 6, save_session="s1")
        pre = first.one(Prefill)
        assert (pre.saved, pre.save_error, pre.session_loaded) == (True, None, False)
        assert e.engine.kv.sessions.get("s1").num_tokens == 28
        again = e.generate(prompt, 6, load_session="s1")
        pre = again.one(Prefill)
        assert pre.session_loaded is True and pre.session_error is None
        # The session's 7 full blocks, then the first's block 7 (its tail) with the logits
        # kept after the prompt's last token: nothing is computed again.
        assert (pre.session_tokens, pre.cached_tokens) == (28, len(prompt))
        assert again.tokens == first.tokens == reference(path, prompt, 6)
        hit = e.generate(follow, 12, load_session="s1")
        pre = hit.one(Prefill)
        # Block 7 holds the prompt's last 2 tokens and 2 generated ones: follow shares the 2.
        assert (pre.session_loaded, pre.session_tokens, pre.cached_tokens) == (True, 28, 30)
        assert hit.tokens == reference(path, follow, 12)


def test_final_session_serves_the_next_turn(tiny):
    path, loaded = tiny
    prompt = prompt_of(21, 17)
    with Engine(loaded) as e:
        turn1 = e.generate(prompt, 10, save_final_session="chat")
        assert turn1.one(Finished).final_saved is True
        completion = turn1.tokens
        assert completion == reference(path, prompt, 10)
        kept = (len(prompt) + len(completion) - 1) // BS * BS  # the last token has no KV yet
        assert e.engine.kv.sessions.get("chat").num_tokens == kept
        e.engine.kv.pool.reset_prefix_cache()  # only the session can serve the next turn now
        turn2_prompt = prompt + completion + prompt_of(22, 6)
        turn2 = e.generate(turn2_prompt, 8, load_session="chat")
        pre = turn2.one(Prefill)
        assert pre.session_tokens == kept and pre.cached_tokens == kept
        assert turn2.tokens == reference(path, turn2_prompt, 8)


def test_a_matched_session_serves_the_next_turn_with_greedy_parity(tiny):
    path, loaded = tiny
    prompt = prompt_of(25, 17)
    with Engine(loaded) as e:
        turn1 = e.generate(prompt, 10, save_final_session="alice.c.1", tenant="alice",
                           match_session=True)
        pre = turn1.one(Prefill)
        assert (pre.session_loaded, pre.session_id, pre.session_error) == (False, None, None)
        kept = e.engine.kv.sessions.get("alice.c.1").num_tokens
        e.engine.kv.pool.reset_prefix_cache()  # only the session can serve the next turn now
        turn2_prompt = prompt + turn1.tokens + prompt_of(26, 6)
        turn2 = e.generate(turn2_prompt, 8, tenant="alice", match_session=True)
        pre = turn2.one(Prefill)
        assert (pre.session_loaded, pre.session_id) == (True, "alice.c.1")
        assert pre.session_tokens == kept and pre.cached_tokens == kept
        assert turn2.tokens == reference(path, turn2_prompt, 8)
        # Another tenant with the same prompt matches nothing and computes it all.
        other = e.generate(turn2_prompt, 8, tenant="bob", match_session=True)
        pre = other.one(Prefill)
        assert (pre.session_loaded, pre.cached_tokens) == (False, 0)
        assert other.tokens == turn2.tokens


def test_missing_or_foreign_session_is_a_miss(tiny):
    path, loaded = tiny
    prompt = prompt_of(31, 21)
    with Engine(loaded) as e:
        miss = e.generate(prompt, 5, load_session="nope")
        pre = miss.one(Prefill)
        assert (pre.session_loaded, pre.session_error, pre.cached_tokens) == (
            False, "not_found", 0)
        assert miss.tokens == reference(path, prompt, 5)
        e.generate(prompt, 1, save_session="mine", tenant="alice")
        other = e.generate(prompt, 5, load_session="mine", tenant="bob")
        pre = other.one(Prefill)
        assert (pre.session_loaded, pre.session_error) == (False, "tenant_mismatch")
        assert pre.cached_tokens == 0  # bob never sees alice's blocks, cache or session
        assert other.tokens == reference(path, prompt, 5)
        unrelated = e.generate(prompt_of(32, 21), 1, load_session="mine", tenant="alice")
        assert unrelated.one(Prefill).session_error == "no_common_prefix"


def test_pinned_blocks_survive_eviction_pressure_and_delete_frees(tiny):
    path, loaded = tiny
    prompt = prompt_of(41, 20)
    with Engine(loaded, num_blocks=24) as e:
        e.generate(prompt, 1, save_session="keep")
        pinned = {b.block_id for b in e.engine.kv.sessions.get("keep").blocks}
        assert len(pinned) == 5
        for i in range(8):  # 12 blocks each: the rest of the pool churns several times
            e.generate(prompt_of(100 + i, 40), 8)
            assert not pinned & set(e.engine.kv.pool.free_queue_ids())
        assert e.engine.stats()["kv_sessions_expired"] == 0
        follow = prompt + [7, 8, 9]
        hit = e.generate(follow, 6, load_session="keep")
        assert hit.one(Prefill).session_tokens == 20
        assert hit.tokens == reference(path, follow, 6)
        assert e.call(EngineCalls.kv_delete, session_id="keep") == {"deleted": True}
        assert_pool_clean(e.engine)


def test_sessions_expire_before_running_work_is_refused(tiny):
    _, loaded = tiny
    with Engine(loaded, num_blocks=16, kv_session_budget=2) as e:
        for i in range(3):
            e.generate(prompt_of(50 + i, 24), 1, save_session=f"s{i}")
        listed = e.call(EngineCalls.kv_list)
        assert [s["session_id"] for s in listed["sessions"]] == ["s2", "s1"]  # budget 2: s0 expired
        assert listed["budget"] == 2 and listed["pinned_blocks"] == 12
        big = e.generate(prompt_of(60, 40), 10)  # needs 13 of 16 blocks: sessions must go
        assert big.one(Finished).finish_reason in {"stop", "length"}
        assert e.engine.stats()["kv_sessions_expired"] >= 2
        e.call(EngineCalls.kv_delete, session_id="s2")
        e.call(EngineCalls.kv_delete, session_id="s1")
        assert_pool_clean(e.engine)


def test_held_sequences_decode_in_one_step_per_token(tiny):
    path, loaded = tiny
    prompts = [prompt_of(70 + i, 9 + 3 * i) for i in range(4)]
    with Engine(loaded) as e:
        seqs = [e.call(EngineCalls.forward, tokens=p)["seq_id"] for p in prompts]
        got = [[] for _ in prompts]
        for _ in range(6):
            steps = e.engine.num_steps
            results, done = {}, threading.Event()

            def answer(i):
                def on_done(result, error):
                    assert error is None, error
                    results[i] = result
                    if len(results) == len(seqs):
                        done.set()
                return on_done

            with e.engine._cond:  # queue every call before the engine thread looks
                for i, seq_id in enumerate(seqs):
                    e.engine.call(EngineCalls.decode_next, "c1", answer(i), seq_id=seq_id,
                                  temperature=0.0)
            assert done.wait(60)
            assert e.engine.num_steps == steps + 1  # four tokens, one batched forward
            for i in range(len(seqs)):
                got[i].append(results[i]["token_id"])
        for prompt, tokens in zip(prompts, got):
            expected = reference(path, prompt, 6)  # model.generate stops at eos; we do not
            assert tokens[:len(expected)] == expected
        saved = e.call(EngineCalls.kv_save, session_id="h", seq_id=seqs[0],
                       prefix_len=len(prompts[0]) + 6)
        assert saved["num_tokens"] == (len(prompts[0]) + 6) // BS * BS
        e.engine.release_owner("c1")
        e.call(EngineCalls.kv_delete, session_id="h")
        assert_pool_clean(e.engine)


# -- fair share between tenants (the registry alone, then the engine)
def fair_registry(num_blocks: int = 32, budget: int = 4, share: float = 0.5):
    pool = BlockPool(num_blocks, BS)
    return pool, SessionRegistry(pool, budget, clock=Clock(), tenant_share=share)


def save_as(reg: SessionRegistry, name: str, tenant: str, num_blocks: int = 1):
    blocks = reg.pool.allocate(num_blocks)
    reg.save(name, tenant, [len(name)] * (num_blocks * BS), blocks)
    reg.pool.free(blocks)
    return blocks


def names(reg: SessionRegistry) -> list[str]:
    return [s.session_id for s in reg.sessions()]


def test_a_tenant_over_its_share_loses_its_own_lru_session_first():
    pool, reg = fair_registry()  # budget 4, share 0.5: over share past 2 sessions
    save_as(reg, "a1", "alice")
    save_as(reg, "a2", "alice")
    save_as(reg, "b1", "bob")
    save_as(reg, "b2", "bob")
    save_as(reg, "b3", "bob")  # 5 > 4; bob holds 3 > 2: bob's LRU goes, not alice's a1
    assert names(reg) == ["a1", "a2", "b2", "b3"]
    save_as(reg, "b4", "bob")
    assert names(reg) == ["a1", "a2", "b3", "b4"]
    save_as(reg, "a3", "alice")  # now alice is the one over her share
    assert names(reg) == ["a2", "b3", "b4", "a3"]
    assert (reg.num_expired, reg.num_expired_over_share) == (3, 3)
    assert (reg.tenant_sessions("alice"), reg.tenant_sessions("bob"), reg.num_tenants) == (2, 2, 2)


def test_a_tenant_under_its_share_takes_from_the_tenant_over_it():
    pool, reg = fair_registry()
    save_as(reg, "a1", "alice")  # the global LRU session
    save_as(reg, "b1", "bob")
    save_as(reg, "b2", "bob")
    save_as(reg, "b3", "bob")  # 4 sessions: within budget, though bob holds 3 > 2
    save_as(reg, "c1", "carol")  # carol is under her share: the over-share tenant pays
    assert names(reg) == ["a1", "b2", "b3", "c1"]
    assert reg.num_expired_over_share == 1


def test_when_nobody_is_over_share_the_global_lru_expires():
    pool, reg = fair_registry()
    for name, tenant in [("a1", "alice"), ("b1", "bob"), ("a2", "alice"), ("b2", "bob")]:
        save_as(reg, name, tenant)
    reg.use(reg.get("a1"))  # b1 is now the least recently used
    save_as(reg, "c1", "carol")
    assert names(reg) == ["a2", "b2", "a1", "c1"]
    assert (reg.num_expired, reg.num_expired_over_share) == (1, 0)


def test_reclaim_takes_blocks_from_the_tenant_over_its_pool_share():
    pool, reg = fair_registry(num_blocks=16, budget=64)  # over share past 8 pinned blocks
    save_as(reg, "a1", "alice", 2)  # the global LRU session
    for name in ("b1", "b2", "b3"):
        save_as(reg, name, "bob", 3)  # bob pins 9 blocks
    running = pool.allocate(pool.num_free_blocks)  # 5 blocks: the pool is full
    assert reg.tenant_pinned_blocks("bob") == 9 and reg.tenant_pinned_blocks("alice") == 2
    assert reg.reclaim(3, tenant="alice") == 1
    assert names(reg) == ["a1", "b2", "b3"] and pool.num_free_blocks == 3
    pool.allocate(3)
    # bob is at his share now (6 <= 8), so nobody is over it: the global LRU goes.
    assert reg.reclaim(2, tenant="bob") == 1
    assert names(reg) == ["b2", "b3"] and reg.num_expired_over_share == 1
    pool.free(running)


def test_reclaim_by_an_over_share_tenant_expires_its_own_sessions_or_nothing():
    pool, reg = fair_registry(num_blocks=16, budget=64)
    save_as(reg, "a1", "alice", 2)
    save_as(reg, "b1", "bob", 2)
    save_as(reg, "b2", "bob", 9)  # bob: 11 blocks > 8
    running = pool.allocate(pool.num_free_blocks)
    assert reg.reclaim(2, keep="b2", tenant="bob") == 1  # his own LRU b1, never alice's a1
    assert names(reg) == ["a1", "b2"]
    more = pool.allocate(2)
    # bob's one session left is the one his request loads, and it alone is over his share:
    # alice (under hers) keeps her session; bob's request waits instead.
    assert reg.reclaim(2, keep="b2", tenant="bob") == 0
    assert names(reg) == ["a1", "b2"] and reg.num_expired == 1
    pool.free(running)
    pool.free(more)


def test_reclaim_plans_first_and_expires_nothing_that_would_not_make_room():
    pool, reg = fair_registry(num_blocks=16, budget=64)
    save_as(reg, "a1", "alice", 2)
    save_as(reg, "b1", "bob", 2)
    save_as(reg, "b2", "bob", 9)  # bob: 11 blocks > 8
    running = pool.allocate(pool.num_free_blocks)
    # bob's b1 frees 2 of the 3 blocks; the third could only come from alice, who is
    # under her share: nothing expires (losing b1 would not give bob his room).
    assert reg.reclaim(3, keep="b2", tenant="bob") == 0
    assert names(reg) == ["a1", "b1", "b2"] and reg.num_expired == 0
    pool.free(running)


def test_a_flooding_tenant_expires_its_own_sessions_and_the_other_still_hits(tiny):
    path, loaded = tiny
    prompt = prompt_of(80, 30)
    with Engine(loaded, kv_session_budget=8) as e:  # share 0.5: over share past 4 sessions
        e.generate(prompt, 1, save_session="a-conv", tenant="alice")
        for i in range(12):  # like unnamed requests: prompt and final session each
            e.generate(prompt_of(200 + i, 14), 3, tenant="bob", save_session=f"b{i}",
                       save_final_session=f"b{i}-final")
        stats = e.engine.stats()
        assert stats["kv_sessions"] == 8 and stats["kv_session_tenants"] == 2
        assert e.engine.kv.sessions.tenant_sessions("bob") == 7
        assert stats["kv_sessions_expired"] == stats["kv_sessions_expired_over_share"] == 24 - 7
        follow = prompt + [5, 6, 7]
        hit = e.generate(follow, 4, load_session="a-conv", tenant="alice")
        pre = hit.one(Prefill)
        assert (pre.session_loaded, pre.session_tokens) == (True, 28)
        assert hit.tokens == reference(path, follow, 4)


def test_block_pressure_from_one_tenant_reclaims_its_own_sessions(tiny):
    path, loaded = tiny
    prompt = prompt_of(81, 22)
    with Engine(loaded, num_blocks=32) as e:  # share 0.5: over share past 16 pinned blocks
        e.generate(prompt, 1, save_session="a-conv", tenant="alice")  # 5 blocks
        for i in range(10):  # 5 pinned blocks each: the pool runs out after a few
            e.generate(prompt_of(300 + i, 22), 2, tenant="bob", save_session=f"b{i}")
        # Each of bob's requests needs 6 blocks: once the pool is short, bob (over his
        # share) gives up his own oldest sessions; alice's, the oldest of all, stays.
        assert [s.session_id for s in e.engine.kv.sessions.sessions()] == [
            "a-conv", "b5", "b6", "b7", "b8", "b9"]
        stats = e.engine.stats()
        assert stats["kv_sessions_expired"] == stats["kv_sessions_expired_over_share"] == 5
        follow = prompt + [9, 9]
        hit = e.generate(follow, 4, load_session="a-conv", tenant="alice")
        assert hit.one(Prefill).session_tokens == 20
        assert hit.tokens == reference(path, follow, 4)
