"""The paged engine end to end on tiny real models (no socket): parity with model.generate,
prefix hits, chunked prefill, batching, seeded sampling, aborts, exhaustion, block hygiene."""

from __future__ import annotations

import random
import threading
from contextlib import contextmanager

import pytest

from gnosis_daemon.settings import Settings
from gnosis_daemon.protocol import OpError
from station.core.requests import EngineEvent, Failed, Finished, Prefill, Token, GenerationRequest, SamplingParams
from station.model.loader import load_model
from station.engine.loop import PagedEngine
from tests.support.tiny_models import FAMILIES, build_tiny_model, reference_generate

BS = 4


pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (model dir, LoadedModel), built once per module."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            path = build_tiny_model(tmp_path_factory.mktemp(family), family)
            settings = Settings(model=str(path), runtime_dir=str(tmp_path_factory.mktemp("rt")))
            cache[family] = (path, load_model(settings))
        return cache[family]

    return get


_REFERENCE: dict[tuple, list[int]] = {}


def reference(path, prompt: list[int], n: int) -> list[int]:
    key = (str(path), tuple(prompt), n)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_generate(path, prompt, n)
    return _REFERENCE[key]


class Collector:
    def __init__(self) -> None:
        self.events = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done.set()

    def wait(self) -> Collector:
        assert self.done.wait(60), "request never ended"
        return self

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, Token)]

    def one(self, kind: type[EngineEvent]) -> EngineEvent:
        found = [e for e in self.events if isinstance(e, kind)]
        assert len(found) == 1, self.events
        return found[0]


@contextmanager
def engine_for(loaded, num_blocks: int | None = 256, start: bool = True, **overrides):
    """An engine on its thread for the block; ``start`` False: the caller starts it (requests
    added before then are all in its first step)."""
    settings = Settings(runtime_dir="/tmp/unused-rt", kv_block_size=BS, **overrides)
    engine = PagedEngine(loaded, settings, num_blocks=num_blocks)
    if start:
        engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def submit(engine, rid: str, prompt: list[int], n: int, **params) -> Collector:
    collector = Collector()
    params.setdefault("temperature", 0.0)
    engine.add_request(GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=n, **params)),
                       collector)
    return collector


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


def assert_pool_clean(engine) -> None:
    stats = engine.stats()
    assert stats["blocks_held"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["blocks_free"] == stats["blocks_total"]
    assert all(b.ref_cnt == 0 and b.pin_cnt == 0 for b in engine.kv.pool.blocks)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_alone_then_prefix_hit(tiny, family):
    path, loaded = tiny(family)
    prompt = prompt_of(1, 27)
    expected = reference(path, prompt, 16)
    with engine_for(loaded) as engine:
        first = submit(engine, "a", prompt, 16).wait()
        assert first.tokens == expected
        assert first.one(Prefill).cached_tokens == 0
        before = engine.stats()["prefill_tokens"]
        second = submit(engine, "b", prompt, 16).wait()
        assert second.tokens == expected
        # 6 full blocks, then the 3 prompt tokens of the first's block 6 (cached full: 3
        # prompt tokens and its first answer token), and the logits the first kept after
        # them: no prompt row is computed again.
        assert second.one(Prefill).cached_tokens == len(prompt) == 27
        assert second.one(Finished).finish_reason in {"stop", "length"}
        stats = engine.stats()
        assert stats["prefill_tokens"] - before == 0
        assert (stats["prefix_cache_queries_tokens"], stats["prefix_cache_hits_tokens"]) == (54, 27)
        assert_pool_clean(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_with_chunked_prefill(tiny, family):
    path, loaded = tiny(family)
    prompt = prompt_of(2, 41)
    with engine_for(loaded, prefill_chunk_tokens=6) as engine:
        result = submit(engine, "a", prompt, 12).wait()
        assert result.tokens == reference(path, prompt, 12)
        assert engine.num_steps >= 7 + len(result.tokens) - 1  # 41 tokens in chunks of 6


@pytest.mark.parametrize("family", FAMILIES)
def test_eight_concurrent_requests_match_reference(tiny, family):
    path, loaded = tiny(family)
    prompts = [prompt_of(10 + i, 3 + 7 * i) for i in range(8)]
    with engine_for(loaded, prefill_chunk_tokens=16) as engine:
        results = [submit(engine, f"r{i}", p, 10 + i) for i, p in enumerate(prompts)]
        for i, (p, r) in enumerate(zip(prompts, results)):
            assert r.wait().tokens == reference(path, p, 10 + i), f"request {i}"
        # Batched: far fewer forwards than tokens produced.
        assert engine.num_steps < sum(len(r.tokens) for r in results) // 2
        assert_pool_clean(engine)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(tiny):
    _, loaded = tiny("llama")
    prompt = prompt_of(3, 12)
    with engine_for(loaded) as engine:
        alone = submit(engine, "a", prompt, 20, temperature=1.0, seed=1234, ignore_eos=True).wait()
        crowd = [submit(engine, f"n{i}", prompt_of(30 + i, 9), 20, temperature=1.0, ignore_eos=True)
                 for i in range(3)]
        again = submit(engine, "b", prompt, 20, temperature=1.0, seed=1234, ignore_eos=True).wait()
        other = submit(engine, "c", prompt, 20, temperature=1.0, seed=99, ignore_eos=True).wait()
        for c in crowd:
            c.wait()
        assert len(alone.tokens) == 20 and again.tokens == alone.tokens
        assert other.tokens != alone.tokens


def test_abort_frees_blocks(tiny):
    _, loaded = tiny("llama")
    with engine_for(loaded) as engine:
        first_token = threading.Event()
        collector = Collector()

        def on_event(event):
            collector(event)
            if isinstance(event, Token):
                first_token.set()

        engine.add_request(GenerationRequest("long", prompt_of(4, 30), SamplingParams(
            max_tokens=10_000, temperature=0.0, ignore_eos=True)), on_event)
        assert first_token.wait(30)
        engine.abort("long")
        engine.abort("long")  # idempotent
        engine.abort("never-existed")
        assert collector.wait().one(Finished).finish_reason == "cancelled"
        assert_pool_clean(engine)
        assert engine.stats()["blocks_cached"] > 0  # its full blocks stay as prefix cache


def test_capacity_exhaustion_waits_and_preempts_yet_all_finish_correctly(tiny):
    path, loaded = tiny("qwen2")
    prompts = [prompt_of(40 + i, 10 + i) for i in range(5)]
    # 12 blocks of 4 = 48 tokens for 5 requests that each grow to ~35 tokens.
    with engine_for(loaded, num_blocks=12) as engine:
        results = [submit(engine, f"r{i}", p, 24) for i, p in enumerate(prompts)]
        for p, r in zip(prompts, results):
            assert r.wait().tokens == reference(path, p, 24)
        assert engine.stats()["preemptions"] > 0
        assert_pool_clean(engine)


def test_requests_it_can_never_serve_are_refused(tiny):
    _, loaded = tiny("llama")
    with engine_for(loaded, num_blocks=4) as engine:
        with pytest.raises(OpError, match="no tokens") as empty:
            submit(engine, "e", [], 4)
        assert empty.value.code == "bad_request"
        with pytest.raises(OpError, match="KV pool") as big:
            submit(engine, "big", prompt_of(5, 16), 4)
        assert big.value.code == "context_overflow"
        with pytest.raises(OpError, match="context") as long:
            submit(engine, "long", prompt_of(5, loaded.max_model_len), 4)
        assert long.value.code == "context_overflow"
        with pytest.raises(OpError, match=r"\[0, ") as vocab:
            submit(engine, "v", [10**6], 4)
        assert vocab.value.code == "bad_request"
        ok = submit(engine, "ok", prompt_of(5, 5), 4).wait()
        assert len(ok.tokens) >= 1
        with pytest.raises(OpError, match="already running"):
            submit(engine, "dup", prompt_of(5, 5), 1000, ignore_eos=True)
            submit(engine, "dup", prompt_of(5, 5), 4)


def test_two_hundred_mixed_requests_with_aborts_leave_no_block_held(tiny):
    _, loaded = tiny("mistral")
    rng = random.Random(7)
    shared = [prompt_of(100 + i, 12) for i in range(4)]  # common prefixes -> cache hits
    with engine_for(loaded, num_blocks=48, prefill_chunk_tokens=8, max_batch_size=8) as engine:
        results = []
        for i in range(200):
            prompt = rng.choice(shared)[:rng.randrange(4, 13)] + prompt_of(1000 + i, rng.randrange(1, 10))
            params = dict(temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=rng.random() < 0.5)
            results.append(submit(engine, f"m{i}", prompt, rng.randrange(1, 12), **params))
            if rng.random() < 0.25:
                engine.abort(f"m{rng.randrange(0, i + 1)}")
        reasons = [r.wait().events[-1].finish_reason for r in results]
        assert set(reasons) <= {"stop", "length", "cancelled"} and "cancelled" in reasons
        for r in results:
            finals = [e for e in r.events if isinstance(e, (Finished, Failed))]
            assert len(finals) == 1
        assert_pool_clean(engine)
        assert engine.stats()["prefix_cache_hits_tokens"] > 0


def test_a_failing_step_ends_its_requests_with_internal_and_the_engine_keeps_serving(tiny):
    path, loaded = tiny("llama")
    prompt = prompt_of(6, 9)
    with engine_for(loaded) as engine:
        real_run = engine.runner.run
        calls = []

        def fail_once(batch):  # fault injection: a forward that raises (e.g. CUDA OOM)
            if not calls:
                calls.append(1)
                raise RuntimeError("boom")
            return real_run(batch)

        engine.runner.run = fail_once
        failed = submit(engine, "bad", prompt, 4).wait()
        error = failed.one(Failed).error
        assert error.code == "internal" and "boom" in error.message
        assert_pool_clean(engine)
        assert submit(engine, "good", prompt, 6).wait().tokens == reference(path, prompt, 6)


def test_shutdown_ends_unfinished_requests_with_shutting_down(tiny):
    _, loaded = tiny("llama")
    started = threading.Event()
    running = Collector()

    def on_event(event):
        running(event)
        if isinstance(event, Token):
            started.set()

    with engine_for(loaded, num_blocks=1024) as engine:
        engine.add_request(GenerationRequest("r", prompt_of(8, 5), SamplingParams(
            max_tokens=100_000, temperature=0.0, ignore_eos=True)), on_event)
        assert started.wait(30)
    assert running.wait().one(Failed).error.code == "shutting_down"
    assert engine.kv.pool.num_held_blocks == 0
    with pytest.raises(OpError, match="shutting down"):
        submit(engine, "late", prompt_of(8, 5), 4)


def test_turn_listeners_follow_each_turns_events_on_the_engine_thread_and_shutdowns_leftovers(tiny):
    """The station writes a turn's frames when its listener is called: after every event of
    that turn, on the engine's thread; and once more after shutdown fails what was left."""
    _, loaded = tiny("llama")
    log: list = []  # ("event", kind, thread) and ("turn", None, thread), in order

    def recorder(rid: str):
        def on_event(event):
            log.append(("event", type(event).__name__, threading.get_ident()))
            if isinstance(event, Token) and rid == "a":
                decoding.set()
        return on_event

    decoding = threading.Event()
    with engine_for(loaded, max_batch_size=1) as engine:
        engine.turn_done.append(lambda: log.append(("turn", None, threading.get_ident())))
        for rid in ("a", "b"):  # b waits behind a (one row a step) until shutdown fails both
            engine.add_request(GenerationRequest(rid, prompt_of(3, 12), SamplingParams(
                max_tokens=100_000, temperature=0.0, ignore_eos=True)), recorder(rid))
        assert decoding.wait(30)
        loop_thread = engine._thread.ident
    here = threading.get_ident()
    looped = [entry for entry in log if entry[2] == loop_thread]
    assert [kind for what, kind, _ in looped if what == "event"][:2] == ["Prefill", "Token"]
    assert looped[-1][0] == "turn"  # the loop's last events were followed by a call, there
    assert log[len(looped):] == [("event", "Failed", here), ("event", "Failed", here), ("turn", None, here)]


def test_the_engine_keeps_its_pools_pages_ready_ahead_of_the_blocks_it_hands_out(tiny):
    _path, loaded = tiny("llama")
    with engine_for(loaded, num_blocks=4096) as engine:
        state = engine.kv_cache._prefault
        assert state is not None and state.target == state.ahead  # PREFAULT_AHEAD_BYTES' worth at start
        submit(engine, "long", prompt_of(3, 40 * BS), 2).wait()
        high = engine.kv.pool.high_water
        assert high >= 40 and state.target == high + state.ahead  # asked for as the blocks went out
