"""The disk tier's I/O process, on the tiny model: sessions pass through a staging area
smaller than one session (the CUDA path, run on the CPU); the disk's LRU learns of the
uses of a session, not only of its saves; and a dead I/O process leaves the station
serving, every request with the right output."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.core.requests import Finished, Prefill
from station.engine.calls import EngineCalls
from station.forward.kv_cache import KVCacheShape
from station.tier.format import session_name
from station.tier.io.worker import BEAT_FRESH_S, DecodeBeat
from station.tier.start import rise_s, writer_yields
from tests.station.tier.test_disk_tier import TierEngine, tier_model
from tests.station.engine.test_paged_engine import prompt_of, reference
from tests.support.kv_tier import tier_dir

BS = 4
pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tier_model(tmp_path_factory)


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_sessions_beyond_the_pool_pass_through_a_staging_area_smaller_than_a_session(tiny, tmp_path):
    path, loaded = tiny
    block_bytes = KVCacheShape.from_config(loaded.model.config, BS, loaded.dtype).bytes_per_block
    prompts = [prompt_of(1200 + i, 23) for i in range(12)]  # 5 full blocks saved each
    # Three slots: a write or a load moves one block at a time through them.
    with TierEngine(loaded, tmp_path / "state", 24, kv_host_bytes=3 * block_bytes) as t:
        assert t.engine.kv_cache.shared is None and t.engine.tier.slots.part_blocks == 1
        first = t.save_each(prompts, "alice.s", 4)
        assert t.engine.stats()["kv_sessions_lost"] == 0
        tiers = t.hit_each(path, prompts, "alice.s", 4, first)
        assert tiers.count("disk") >= 8  # the pool holds at most 4 of these sessions
        assert t.engine.tier.slots.room() == 3  # every slot given back


def test_the_host_tier_serves_sessions_evicted_from_the_pool_without_reading_a_file(tiny, tmp_path):
    path, loaded = tiny
    block_bytes = KVCacheShape.from_config(loaded.model.config, BS, loaded.dtype).bytes_per_block
    prompts = [prompt_of(1250 + i, 23) for i in range(10)]  # 5 full blocks saved each
    state = tmp_path / "state"
    # Host RAM for 128 blocks behind a pool of 24: every session stays in RAM once written.
    with TierEngine(loaded, state, 24, kv_host_bytes=128 * block_bytes) as t:
        first = t.save_each(prompts, "alice.h", 4)
        tiers = t.hit_each(path, prompts, "alice.h", 4, first)
        stats = t.engine.stats()
        assert tiers.count("host") >= 6 and "disk" not in tiers  # the pool holds at most 4
        assert stats["disk_reads"] == 0 and stats["host_block_misses"] == 0
        assert stats["host_block_hits"] == 5 * tiers.count("host") == 5 * stats["kv_disk_loads"]
        assert stats["host_blocks"] == 50 and stats["host_bytes"] == 50 * block_bytes
    # A restart starts with empty RAM: the same sessions come from disk, the same output.
    with TierEngine(loaded, state, 24, kv_host_bytes=128 * block_bytes) as t:
        again = t.generate(prompts[7], 4, match_session=True)
        assert again.one(Prefill).session_tier == "disk" and again.tokens == first[7]
        again = t.generate(prompts[7] + prompt_of(5, 2), 4, match_session=True)
        assert again.one(Prefill).session_tier == "pool"


def test_the_disk_lru_evicts_the_least_recently_used_session_not_the_oldest_save(tiny, tmp_path):
    path, loaded = tiny
    prompts = {name: prompt_of(1300 + i, 23) for i, name in enumerate("ABCD")}
    with TierEngine(loaded, tmp_path / "probe", 64) as t:  # the bytes one session takes on disk
        t.generate(prompts["A"], 2, save_session="alice.A")
        t.expected_writes = 1
        t.settle()
        one = t.engine.stats()["disk_bytes"]
    state = tmp_path / "state"
    root = tier_dir(state, loaded.fingerprint)
    with TierEngine(loaded, state, 64, kv_disk_bytes=int(3.5 * one)) as t:
        for i, name in enumerate("ABC"):
            t.generate(prompts[name], 2, save_session=f"alice.{name}")
            t.expected_writes = i + 1
            t.settle()
        # A, the oldest save, is used again (a hit from the pool): its manifest learns of it.
        hit = t.generate(prompts["A"] + prompt_of(7, 3), 2, match_session=True)
        assert hit.one(Prefill).session_id == "alice.A"
        wait_for(lambda: t.engine.stats()["disk_touches"] >= 1, "the use to reach the disk")
        t.generate(prompts["D"], 2, save_session="alice.D")  # past the budget: one must go
        t.expected_writes = 4
        t.settle()
        assert t.engine.stats()["disk_evicted_sessions"] == 1
    on_disk = {p.name for p in (root / "sessions").iterdir()}
    assert on_disk == {session_name(f"alice.{n}") for n in "ACD"}  # B went, not A


def test_a_dead_io_process_leaves_the_station_serving(tiny, tmp_path):
    path, loaded = tiny
    kept, other_prompt = prompt_of(1400, 23), prompt_of(1401, 23)
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        t.generate(kept, 3, save_session="alice.kept")
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        assert len(t.engine.kv.disk) == 1  # alice.kept: on disk only
        assert t.engine.stats()["kv_io_cpu_s"] > 0  # its imports and the store's listing, at least
        t.engine.tier.io.proc.kill()
        t.engine.tier.io.proc.wait()
        wait_for(lambda: t.engine.stats()["kv_io_down"] is not None, "the tier to be down")
        # The disk session cannot be read: the request is a miss with the right output.
        miss = t.generate(kept, 5, match_session=True)
        assert (miss.one(Prefill).session_loaded, miss.one(Prefill).session_error) == (False, None)
        assert miss.tokens == reference(path, kept, 5)
        # New saves live in the pool (hits there), never durable; nothing crashes.
        saved = t.generate(other_prompt, 3, save_session="alice.new")
        assert saved.one(Prefill).saved is True
        hit = t.generate(other_prompt, 3, match_session=True)
        assert hit.one(Prefill).session_tier == "pool"
        assert hit.tokens == saved.tokens == reference(path, other_prompt, 3)
        assert hit.one(Finished).cached_tokens == len(other_prompt)  # 20 + the tail's 3
        assert t.engine.kv.get_session("alice.new").durable is False
        stats = t.engine.stats()
        assert stats["kv_disk_sessions"] == 0 and stats["kv_io_down"] == "the KV I/O process exited"
        assert stats["kv_io_cpu_s"] is None  # reaped: no process left to measure


def call(engine, handler, owner="c1", **kwargs):
    """One engine call, answered: -> its result (an error fails the test)."""
    box, done = {}, threading.Event()

    def on_done(result, error):
        box["r"] = (result, error)
        done.set()

    engine.call(handler, owner, on_done, **kwargs)
    assert done.wait(60)
    result, error = box["r"]
    assert error is None, f"{error.code}: {error.message}"
    return result


def test_kv_session_load_reads_a_disk_only_session_back(tiny, tmp_path):
    path, loaded = tiny
    prompt = prompt_of(1500, 23)
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        t.generate(prompt, 3, save_session="alice.held")
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        assert "alice.held" in t.engine.kv.disk and t.engine.kv.get_session("alice.held") is None
        held = call(t.engine, EngineCalls.kv_load, session_id="alice.held")
        assert held["num_tokens"] == 20
        assert t.engine.kv.get_session("alice.held").durable  # read back, pinned again
        assert t.engine.stats()["kv_disk_loads"] == 1
        # The rest of the prompt on top of the loaded KV, then greedy tokens: model.generate's.
        fwd = call(t.engine, EngineCalls.forward, seq_id=held["seq_id"], tokens=list(prompt[20:]))
        assert fwd["num_tokens"] == 23
        tokens = [call(t.engine, EngineCalls.decode_next, seq_id=held["seq_id"], temperature=0.0)["token_id"]
                  for _ in range(3)]
        assert tokens == reference(path, prompt, 3)


def test_only_a_cpu_decode_at_the_lowest_priority_makes_the_writer_wait():
    assert writer_yields(Settings(kv_write_behind_s=1.0), torch.device("cpu")) is True
    assert rise_s(Settings(kv_write_behind_s=1.0)) == 0.25  # ... until the priority rises
    assert writer_yields(Settings(kv_write_behind_s=1.0, kv_io_nice=18), torch.device("cpu")) is False
    assert writer_yields(Settings(kv_write_behind_s=1.0), torch.device("cuda")) is False


def steps_going_on(engine) -> None:
    """Stamp the beat as a running step does, once the engine's last step has stamped its
    end (a call is answered between steps): as far as the writer can tell, steps go on."""
    call(engine, EngineCalls.kv_list)
    engine.tier.io.beat.stamp(math.inf)


def test_the_writer_waits_while_decode_steps_go_on(tiny, tmp_path):
    """At kv_io_nice 19 on the CPU no block is written while the engine's steps go on (the
    beat they stamp is fresh), until a quarter of kv_write_behind_s after the save: then the
    writer writes beside them, so a save still lands."""
    _, loaded = tiny
    prompt = prompt_of(1700, 23)  # 5 full blocks
    with TierEngine(loaded, tmp_path / "state", 64, kv_write_behind_s=60.0) as t:  # waits <= 15 s
        beat = t.engine.tier.io.beat
        t.generate(prompt, 3)  # into the prefix cache, no save
        steps_going_on(t.engine)
        assert call(t.engine, EngineCalls.kv_save, session_id="alice.wait", prefix_len=20,
                    tokens=list(prompt), tenant="alice")["num_tokens"] == 20
        time.sleep(1.5)
        assert t.engine.tier.figures.writes == 0 and t.engine.stats()["write_behind_queued"] == 1
        beat.stamp(0.0)  # the steps paused
        t.expected_writes = 1
        t.settle()
        assert t.engine.stats()["disk_write_yield_s"] >= 1.0  # it waited while they went on
    with TierEngine(loaded, tmp_path / "state2", 64) as t:  # kv_write_behind_s 1.0: waits <= 0.25 s
        t.generate(prompt, 3)
        steps_going_on(t.engine)  # steps that never pause
        call(t.engine, EngineCalls.kv_save, session_id="alice.bound", prefix_len=20, tokens=list(prompt),
             tenant="alice")
        t.expected_writes = 1
        t.settle()  # landed all the same
        # its first block waited until 0.25 s after the save (the save was a few ms before it)
        assert t.engine.stats()["disk_write_yield_s"] >= 0.15


def test_a_step_longer_than_the_beats_window_still_holds_the_writer(tiny, tmp_path):
    """The beat reads as busy for a whole step however long it runs (a long prefill chunk),
    and as a fresh pause once it ends: stamped only as a step started, a step longer than
    BEAT_FRESH_S looked like a pause, and the writer wrote beside it."""
    _, loaded = tiny
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        beat, runner = t.engine.tier.io.beat, t.engine.runner
        seen, run = [], runner.run

        def slow_step(out):
            time.sleep(BEAT_FRESH_S * 3)
            seen.append(DecodeBeat.age_s(beat._map))  # what the writer reads, late in the step
            return run(out)

        runner.run = slow_step
        t.generate(prompt_of(600, 23), 2)
        runner.run = run
        call(t.engine, EngineCalls.kv_list)  # answered between steps: the last one's end stamped
        after = DecodeBeat.age_s(beat._map)
    assert len(seen) >= 2 and all(age < 0 for age in seen)  # busy: the writer waits
    assert 0 <= after < 5.0  # a real time: the writer waits BEAT_FRESH_S past it, no longer


def test_a_prompt_saved_again_unchanged_is_written_once(tiny, tmp_path):
    """The next turn saves the same prompt under the same id (a conversation's, or the
    same prompt sent again): while its write is on the way nothing more is queued, once
    durable it is only touched; the hit's tokens are the miss's."""
    _, loaded = tiny
    prompt = prompt_of(1900, 23)  # 5 full blocks
    with TierEngine(loaded, tmp_path / "state", 64) as t:
        io = t.engine.tier.io.proc
        os.kill(io.pid, signal.SIGSTOP)  # the first write stays on the way
        try:
            miss = t.generate(prompt, 3, save_session="alice.same")
            hit = t.generate(prompt, 3, save_session="alice.same")
            session = t.engine.kv.get_session("alice.same")
            assert hit.tokens == miss.tokens and not session.durable
            assert t.engine.stats()["write_behind_queued"] == 1  # one job, not a second
        finally:
            os.kill(io.pid, signal.SIGCONT)
        t.expected_writes = 1
        t.settle()
        assert t.engine.kv.get_session("alice.same") is session and session.durable
        touches = t.engine.tier.figures.touches
        assert t.generate(prompt, 3, save_session="alice.same").tokens == miss.tokens
        t.settle()
        assert t.engine.tier.figures.writes == 1 and t.engine.tier.figures.touches == touches + 1


def test_a_session_evicted_before_its_write_landed_is_kept_on_disk(tiny, tmp_path):
    """A slow writer must not lose a session the pool evicts meanwhile: the job holds the
    blocks, and when it lands the session becomes a disk session (not counted lost)."""
    path, loaded = tiny
    prompts = [prompt_of(1600 + i, 23) for i in range(10)]  # 5 full blocks saved each
    with TierEngine(loaded, tmp_path / "state", 128, kv_session_budget=4) as t:
        io = t.engine.tier.io.proc
        os.kill(io.pid, signal.SIGSTOP)  # the writer makes no progress
        try:
            # The pool (and the session budget, 4) cannot hold 10 sessions: early ones are
            # evicted while their writes wait.
            first = [t.generate(p, 3, save_session=f"alice.slow.{i}").tokens
                     for i, p in enumerate(prompts)]
            assert t.engine.stats()["kv_sessions_lost"] > 0
        finally:
            os.kill(io.pid, signal.SIGCONT)
        t.expected_writes = len(prompts)
        t.settle()
        stats = t.engine.stats()
        assert stats["kv_sessions_lost"] == 0
        assert stats["kv_disk_sessions"] + stats["kv_sessions"] == len(prompts)
        assert stats["kv_disk_sessions"] >= len(prompts) - 4  # the evicted ones, on disk
    with TierEngine(loaded, tmp_path / "state", 128, kv_session_budget=4) as t:
        for i, prompt in enumerate(prompts):
            again = t.generate(prompt, 3, match_session=True)
            pre = again.one(Prefill)
            assert (pre.session_id, pre.session_tier) == (f"alice.slow.{i}", "disk")
            assert again.tokens == first[i] == reference(path, prompt, 3)
