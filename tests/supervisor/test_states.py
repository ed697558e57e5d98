"""The child state machine: allowed transitions, exact backoff, good starts and FATAL."""

from __future__ import annotations

import signal

import pytest

from supervisor.states import (
    TRANSITIONS,
    ChildMachine,
    ChildState,
    ExitInfo,
    IllegalTransition,
    RestartPolicy,
)

S = ChildState
POLICY = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=4.0, min_uptime_s=10.0,
                       max_fast_failures=5)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


REFUSED_EXIT = 78


def machine(policy: RestartPolicy = POLICY):
    clock = FakeClock()
    events: list[tuple[str, str]] = []
    m = ChildMachine("station", policy, clock=clock, wall_clock=lambda: 5.0,
                     listener=lambda mach, old, new, why: events.append((old.value, new.value)),
                     permanent_exits=frozenset({REFUSED_EXIT}))
    return m, clock, events


def test_backoff_sequence_is_exponential_and_capped():
    assert [POLICY.backoff_delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert POLICY.backoff_delay(10_000) == 4.0  # no float overflow for long crash loops


def test_every_state_has_a_row_and_fatal_is_terminal():
    assert set(TRANSITIONS) == set(ChildState)
    assert TRANSITIONS[S.FATAL] == frozenset()
    # REFUSED is parked, not terminal: an operator's restart or the shutdown leaves it.
    assert TRANSITIONS[S.REFUSED] == frozenset({S.STARTING, S.STOPPED})


def test_a_permanent_exit_during_start_is_refused_with_no_restart_and_no_failure():
    m, clock, events = machine()
    m.spawned(1)
    clock.now += 4.0
    assert m.exited(REFUSED_EXIT) is None  # no delay: nothing restarts it
    assert m.state is S.REFUSED and m.pid is None
    assert (m.fast_failures, m.restarts, m.backoff_until) == (0, 0, None)
    assert m.last_exit == ExitInfo(REFUSED_EXIT, None, 5.0, 4.0, None)
    assert events == [("stopped", "starting"), ("starting", "refused")]
    snap = m.snapshot()
    assert (snap["state"], snap["pid"], snap["backoff_remaining_s"]) == ("refused", None, None)


def test_a_permanent_exit_after_running_passes_through_exited():
    m, clock, events = machine()
    m.spawned(1)
    m.ready()
    clock.now += 1.0  # a fast exit, yet not a failure: it says a restart is useless
    assert m.exited(REFUSED_EXIT) is None
    assert m.state is S.REFUSED and m.fast_failures == 0
    assert events[-2:] == [("running", "exited"), ("exited", "refused")]


def test_refused_restarts_only_when_asked_and_stops_at_once():
    m, _, events = machine()
    m.spawned(1)
    m.exited(REFUSED_EXIT)
    m.spawned(2)  # an operator's restart
    assert (m.state, m.pid, m.restarts) == (S.STARTING, 2, 1)
    m.exited(REFUSED_EXIT)
    m.stop_requested("shutdown")  # no process to wait for
    assert m.state is S.STOPPED
    assert events[-3:] == [("refused", "starting"), ("starting", "refused"), ("refused", "stopped")]


def test_other_exit_codes_and_a_stop_are_not_refusals():
    m, _, _ = machine()
    m.spawned(1)
    assert m.exited(1) == 0.5 and m.state is S.BACKOFF  # an ordinary failed start
    m.spawned(2)
    m.stop_requested("shutdown")
    assert m.exited(REFUSED_EXIT) is None and m.state is S.STOPPED  # the stop wins
    plain = ChildMachine("host", POLICY, clock=FakeClock(), wall_clock=lambda: 5.0)
    plain.spawned(3)
    assert plain.exited(REFUSED_EXIT) == 0.5 and plain.state is S.BACKOFF  # not its code


def test_start_ready_exit_after_good_uptime_restarts_at_once_with_clean_count():
    m, clock, events = machine()
    m.spawned(101)
    m.ready()
    clock.now += 10.0  # exactly min_uptime_s: a good start
    assert m.exited(1) == 0.0
    assert m.state is S.EXITED and m.fast_failures == 0
    assert m.last_exit == ExitInfo(1, None, 5.0, 10.0, None)
    m.spawned(102)
    assert (m.state, m.pid, m.restarts) == (S.STARTING, 102, 1)
    assert events == [("stopped", "starting"), ("starting", "running"), ("running", "exited"),
                      ("exited", "starting")]


def test_fast_failures_back_off_exactly_then_fatal():
    m, clock, events = machine()
    delays = []
    for n in range(5):
        m.spawned(200 + n)
        m.ready()
        clock.now += 2.0  # below min_uptime_s
        delays.append(m.exited(-signal.SIGKILL))
        clock.now += delays[-1] or 0.0
    assert delays == [0.5, 1.0, 2.0, 4.0, None]
    assert m.state is S.FATAL and m.fast_failures == 5 and m.restarts == 4
    assert m.last_exit.signal == signal.SIGKILL and m.last_exit.code is None
    assert events[-2:] == [("running", "exited"), ("exited", "fatal")]
    with pytest.raises(IllegalTransition):
        m.spawned(300)  # FATAL is terminal


def test_failed_starts_count_even_when_slow_and_a_good_start_resets():
    m, clock, events = machine()
    m.spawned(1)
    clock.now += 60.0  # took a minute, never answered: still a failed start
    assert m.exited(1, reason="not ready after 60 s") == 0.5
    assert m.state is S.BACKOFF and m.last_exit.reason == "not ready after 60 s"
    m.spawned(2)
    assert m.exited(1) == 1.0
    m.spawned(3)
    m.ready()
    clock.now += 30.0
    assert m.exited(0) == 0.0 and m.fast_failures == 0
    assert ("starting", "backoff") in events and ("backoff", "starting") in events


def test_stop_paths():
    m, clock, _ = machine()
    m.spawned(1)
    m.ready()
    m.stop_requested("shutdown")
    assert m.state is S.STOPPING
    assert m.exited(0) is None
    assert m.state is S.STOPPED and m.pid is None
    # a requested stop is not a failure
    assert m.fast_failures == 0
    m.spawned(2)
    assert m.exited(1) == 0.5
    m.stop_requested("shutdown")  # from backoff: no process to wait for
    assert m.state is S.STOPPED


@pytest.mark.parametrize("action", ["ready", "stop"])
def test_illegal_transitions_raise_and_change_nothing(action):
    m, _, events = machine()
    with pytest.raises(IllegalTransition, match="stopped -> "):
        m.ready() if action == "ready" else m.stop_requested("x")
    assert m.state is S.STOPPED and events == []


def test_spawn_while_running_raises_before_any_bookkeeping():
    m, _, _ = machine()
    m.spawned(1)
    m.ready()
    with pytest.raises(IllegalTransition, match="running -> starting"):
        m.spawned(2)
    assert (m.state, m.pid, m.restarts, m.num_starts) == (S.RUNNING, 1, 0, 1)


def test_running_cannot_go_straight_to_backoff():
    m, _, _ = machine()
    m.spawned(1)
    m.ready()
    with pytest.raises(IllegalTransition, match="running -> backoff"):
        m.change_state(S.BACKOFF, {S.RUNNING})


def test_snapshot_fields():
    m, clock, _ = machine()
    m.spawned(7)
    m.ready()
    clock.now += 3.0
    snap = m.snapshot()
    assert snap == {"state": "running", "pid": 7, "restarts": 0, "fast_failures": 0,
                    "uptime_s": 3.0, "started_at": 5.0, "backoff_remaining_s": None,
                    "last_exit": None}
    m.exited(-signal.SIGSEGV)
    snap = m.snapshot()
    assert snap["state"] == "backoff" and snap["pid"] is None and snap["backoff_remaining_s"] == 0.5
    assert snap["last_exit"] == {"code": None, "signal": signal.SIGSEGV, "signal_name": "SIGSEGV",
                                 "at": 5.0, "uptime_s": 3.0, "reason": None}
