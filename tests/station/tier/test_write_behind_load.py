"""The write-behind under load, on the tiny model: saves far beyond the pool, sent back to
back while other streams keep decode busy, all reach disk and all hit again with
``model.generate``'s greedy output; the writer's priority rises as a save nears its bound;
only a stalled disk has saves given up, each counted, and every session is accounted for
(in the pool, on disk, or lost)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from station.core.requests import Prefill
from station.engine.calls import EngineCalls
from tests.station.tier.test_disk_tier import BS, TierEngine, tier_model
from tests.station.tier.test_disk_tier_io import call, steps_going_on
from tests.station.engine.test_paged_engine import prompt_of, reference

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tier_model(tmp_path_factory)


class Decoders:
    """``count`` greedy streams that keep decoding (each one starts again when it ends)
    until the block exits: the engine steps without pause, its beat always fresh."""

    def __init__(self, t: TierEngine, count: int, prompt_len: int, tokens: int) -> None:
        self.t, self.count, self.prompt_len, self.tokens = t, count, prompt_len, tokens
        self.stop = threading.Event()
        self.finished = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            done = self.t.generate(prompt_of(9000 + i, self.prompt_len), self.tokens)
            assert len(done.tokens) == self.tokens
            self.finished += 1

    def __enter__(self) -> Decoders:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)


def test_sessions_ten_times_the_pool_saved_beside_decoding_streams_all_hit(tiny, tmp_path):
    """30 sessions totalling 10x the pool, sent back to back while 2 other streams decode,
    at the default priority (kv_io_nice 19: the writer yields to decode steps until a
    quarter of kv_write_behind_s after each save, then rises): none is dropped or lost, and each one
    hits when asked again, from the pool or the disk, with the first greedy output."""
    path, loaded = tiny
    num_blocks = 96
    prompts = [prompt_of(2100 + i, 32 * BS + 1) for i in range(30)]  # 32 full blocks saved each
    assert len(prompts) * 32 >= 10 * num_blocks
    with TierEngine(loaded, tmp_path / "state", num_blocks, kv_session_budget=8) as t:
        with Decoders(t, 2, 8, 48) as decoders:
            first = [t.generate(p, 3, save_session=f"alice.load.{i}").tokens for i, p in enumerate(prompts)]
            assert decoders.finished > 0
        t.expected_writes = len(prompts)
        t.settle(60.0)
        stats = t.engine.stats()
        assert (stats["write_behind_dropped"], stats["write_behind_errors"], stats["kv_sessions_lost"]) == (0, 0, 0)
        assert stats["kv_sessions"] + stats["kv_disk_sessions"] == len(prompts)
        for i, prompt in enumerate(prompts):
            again = t.generate(prompt, 3, match_session=True)
            pre = again.one(Prefill)
            assert (pre.session_loaded, pre.session_id) == (True, f"alice.load.{i}"), (i, pre)
            assert again.tokens == first[i] == reference(path, prompt, 3), i


def test_a_save_older_than_half_the_bound_is_written_at_the_stations_priority(tiny, tmp_path):
    """Steps that never pause (the beat stamped far ahead): the save's blocks are written
    by the writer thread at the station's priority once a quarter of kv_write_behind_s has gone."""
    _, loaded = tiny
    prompt = prompt_of(2200, 23)  # 5 full blocks
    with TierEngine(loaded, tmp_path / "state", 64, kv_write_behind_s=0.8) as t:  # rises 0.2 s after a save
        t.generate(prompt, 3)  # into the prefix cache, no save
        steps_going_on(t.engine)
        assert call(t.engine, EngineCalls.kv_save, session_id="alice.risen", prefix_len=20,
                    tokens=list(prompt), tenant="alice")["num_tokens"] == 20
        t.expected_writes = 1
        t.settle()
        stats = t.engine.stats()
        assert stats["disk_write_risen_blocks"] == 5 and stats["disk_write_yield_s"] >= 0.1
        assert stats["write_behind_late"] == 0


def _threads(pid: int) -> list[tuple[int, int]]:
    """(nice, scheduling policy) of each thread of ``pid``."""
    tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    return sorted((os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)) for tid in tids)


def test_only_the_low_writer_thread_runs_at_kv_io_nice(tiny, tmp_path):
    """The process runs at the station's priority (its loads have requests waiting on them,
    its late writes a bound to meet); one thread, the young saves' writer, at kv_io_nice."""
    _, loaded = tiny
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    with TierEngine(loaded, tmp_path / "state", 16) as t:  # kv_io_nice 19, the default
        threads = _threads(t.engine.tier.io.proc.pid)
        assert threads.count((19, os.SCHED_IDLE)) == 1
        assert all(nice == ours and policy == os.SCHED_OTHER for nice, policy in threads
                   if (nice, policy) != (19, os.SCHED_IDLE)), threads
    with TierEngine(loaded, tmp_path / "state", 16, kv_io_nice=7) as t:
        threads = _threads(t.engine.tier.io.proc.pid)
        assert threads.count((max(7, ours), os.SCHED_OTHER)) == 1 and len(threads) > 1
    with TierEngine(loaded, tmp_path / "state", 16, kv_io_nice=0) as t:  # no low thread at all
        assert {nice for nice, _ in _threads(t.engine.tier.io.proc.pid)} == {ours}


def test_a_stalled_disk_gives_saves_up_counted_and_every_session_accounted_for(tiny, tmp_path, capfd):
    """With the I/O process stopped, saves far beyond the pool are still served: once the
    write in flight has stalled past ``stall_s`` with half the pool queued, the oldest
    queued writes are given up, each counted and logged by name; every session is then in
    the pool, on disk or counted lost."""
    path, loaded = tiny
    prompts = [prompt_of(2300 + i, 23) for i in range(12)]  # 5 blocks each, 60 in all
    with TierEngine(loaded, tmp_path / "state", 24) as t:
        t.engine.tier.stall_s = 0.3
        io = t.engine.tier.io.proc
        os.kill(io.pid, signal.SIGSTOP)
        try:
            for i, prompt in enumerate(prompts):
                done = t.generate(prompt, 3, save_session=f"alice.stall.{i}")
                assert done.one(Prefill).saved is True  # served, never a capacity failure
                assert done.tokens == reference(path, prompt, 3)
            dropped = t.engine.stats()["write_behind_dropped"]
            assert dropped > 0
        finally:
            os.kill(io.pid, signal.SIGCONT)
        t.expected_writes = len(prompts) - dropped
        t.settle()
        stats = t.engine.stats()
        assert stats["write_behind_errors"] == 0
        assert stats["kv_sessions"] + stats["kv_disk_sessions"] + stats["kv_sessions_lost"] == len(prompts)
        assert stats["kv_sessions_lost"] > 0
    captured = capfd.readouterr()
    logged = captured.out + captured.err
    assert logged.count("kv_tier_write_dropped") == dropped
    assert "alice.stall.1" in logged  # the oldest queued (.0 was in flight, stalled)
