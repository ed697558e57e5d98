"""Child process states, the transitions allowed between them, and the restart policy.

Stdlib only, no I/O, no trio: the async driver (``child.py``) reports facts (spawned, ready,
exited, stop requested) and this module decides what they mean. A clock is injected so the
tests can drive backoff and the fast-failure count exactly.

::

    STOPPED --spawn--> STARTING --ready--> RUNNING --exit--> EXITED --> STARTING (good run)
                          |                   |                 +----> BACKOFF  (fast failure)
                          |                   |                 +----> FATAL    (too many)
                          |                   |                 +----> REFUSED  (permanent exit)
                          +--exit/timeout--> BACKOFF | FATAL
                          +--permanent exit--> REFUSED
       STARTING | RUNNING --stop--> STOPPING --exit--> STOPPED
       BACKOFF --delay over--> STARTING;   BACKOFF | EXITED | REFUSED --stop--> STOPPED
       REFUSED --operator restart--> STARTING

A *good start* is a child that reached RUNNING and stayed there ``min_uptime_s``: it resets the
failure count. Any other exit (a failed start included) is a fast failure; after
``max_fast_failures`` in a row the child is FATAL and the supervisor gives up (exits non-zero,
so systemd restarts the whole unit with its own, slower, policy).

A *permanent exit* is an exit status the child uses to say that starting it again changes
nothing (the station's ``REFUSED_EXIT``, 78: it refuses its model). The child is REFUSED: not
restarted, no backoff, no failure counted, and the supervisor stays up (unlike FATAL); only an
operator's restart (``gnosis-daemon restart station``) starts it again.
"""

from __future__ import annotations

import enum
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable


class ChildState(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    EXITED = "exited"
    FATAL = "fatal"
    REFUSED = "refused"


S = ChildState
TRANSITIONS: dict[ChildState, frozenset[ChildState]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.RUNNING, S.BACKOFF, S.FATAL, S.STOPPING, S.REFUSED}),
    S.RUNNING: frozenset({S.EXITED, S.STOPPING}),
    S.EXITED: frozenset({S.STARTING, S.BACKOFF, S.FATAL, S.STOPPED, S.REFUSED}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED}),
    S.STOPPING: frozenset({S.STOPPED}),
    S.FATAL: frozenset(),  # terminal: the supervisor exits and systemd takes over
    # Parked: the supervisor stays up; an operator's restart, or the shutdown, ends it.
    S.REFUSED: frozenset({S.STARTING, S.STOPPED}),
}


class IllegalTransition(AssertionError):
    """A state change the table does not allow: a bug in the supervisor, never user input."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_initial_s: float
    backoff_max_s: float
    min_uptime_s: float
    max_fast_failures: int

    def __post_init__(self) -> None:
        assert 0 < self.backoff_initial_s <= self.backoff_max_s, self
        assert self.min_uptime_s >= 0 and self.max_fast_failures >= 1, self

    @classmethod
    def from_settings(cls, settings: Any) -> RestartPolicy:
        return cls(settings.backoff_initial_s, settings.backoff_max_s, settings.min_uptime_s,
                   settings.max_fast_failures)

    def backoff_delay(self, failures: int) -> float:
        """Delay before the restart that follows the ``failures``-th fast failure in a row."""
        assert failures >= 1, failures
        # Cap the exponent too: 2.0 ** 2000 overflows long before the cap would apply.
        return min(self.backoff_initial_s * 2.0 ** min(failures - 1, 60), self.backoff_max_s)


@dataclass(frozen=True, slots=True)
class ExitInfo:
    code: int | None  # exit status when it exited by itself
    signal: int | None  # the signal that killed it
    at: float  # wall-clock time (time.time()) of the exit
    uptime_s: float  # since spawn
    reason: str | None = None  # why the supervisor killed it, when it did

    @classmethod
    def from_returncode(cls, returncode: int | None, *, at: float, uptime_s: float,
                        reason: str | None = None) -> ExitInfo:
        if returncode is not None and returncode < 0:
            return cls(None, -returncode, at, uptime_s, reason)
        return cls(returncode, None, at, uptime_s, reason)

    def as_dict(self) -> dict[str, Any]:
        name = None
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = None
        return {"code": self.code, "signal": self.signal, "signal_name": name, "at": self.at,
                "uptime_s": round(self.uptime_s, 3), "reason": self.reason}

    def describe(self) -> str:
        how = (f"signal {self.as_dict()['signal_name'] or self.signal}" if self.signal is not None
               else f"code {self.code}")
        return f"{how}" + (f" ({self.reason})" if self.reason else "")


Listener = Callable[["ChildMachine", ChildState, ChildState, dict[str, Any]], None]


class ChildMachine:
    """One child's state, failure count and restart count. Every change goes through
    ``change_state``, which checks the table, logs and tells the listener."""

    def __init__(self, name: str, policy: RestartPolicy, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 listener: Listener | None = None, logger: Any = None,
                 permanent_exits: frozenset[int] = frozenset()) -> None:
        self.name = name
        self.policy = policy
        # Exit statuses after which a restart would change nothing: REFUSED, not restarted.
        self.permanent_exits = permanent_exits
        self._clock = clock
        self._wall = wall_clock
        self.listener = listener
        self._log = logger
        self.state = ChildState.STOPPED
        self.pid: int | None = None
        self.num_starts = 0
        self.restarts = 0  # spawns after the first one
        self.fast_failures = 0  # consecutive; reset by a good start or a requested restart
        self.started_at: float | None = None  # monotonic, at spawn
        self.started_wall: float | None = None
        self.ready_at: float | None = None  # monotonic, when it reached RUNNING
        self.backoff_until: float | None = None  # monotonic
        self.last_exit: ExitInfo | None = None

    # -- the one place state changes
    def change_state(self, new: ChildState, expected: frozenset[ChildState] | set[ChildState],
                     **why: Any) -> None:
        old = self.state
        self._check(new, expected)
        self.state = new
        if self._log is not None:
            self._log.info("child_state", child=self.name, old=old.value, new=new.value,
                           pid=self.pid, **why)
        if self.listener is not None:
            self.listener(self, old, new, why)

    def _check(self, new: ChildState, expected: frozenset[ChildState] | set[ChildState]) -> None:
        old = self.state
        if old not in expected or new not in TRANSITIONS[old]:
            raise IllegalTransition(
                f"child {self.name!r}: {old.value} -> {new.value} is not allowed "
                f"(expected source {sorted(s.value for s in expected)})")

    # -- facts reported by the driver
    def spawned(self, pid: int | None) -> None:
        """A process was started (``pid`` None: spawning itself failed; ``exited`` follows)."""
        expected = {S.STOPPED, S.BACKOFF, S.EXITED, S.REFUSED}
        self._check(S.STARTING, expected)  # before any bookkeeping changes
        if self.num_starts > 0:
            self.restarts += 1
        self.num_starts += 1
        self.pid = pid
        self.started_at = self._clock()
        self.started_wall = self._wall()
        self.ready_at = None
        self.backoff_until = None
        self.change_state(S.STARTING, expected, restarts=self.restarts)

    def ready(self) -> None:
        self.ready_at = self._clock()
        self.change_state(S.RUNNING, {S.STARTING})

    def stop_requested(self, reason: str) -> None:
        """Begin an orderly stop: STARTING/RUNNING -> STOPPING; with no process (BACKOFF,
        EXITED before its restart, REFUSED) -> STOPPED at once."""
        if self.state in (S.BACKOFF, S.EXITED, S.REFUSED):
            self.backoff_until = None
            self.change_state(S.STOPPED, {S.BACKOFF, S.EXITED, S.REFUSED}, reason=reason)
            return
        self.change_state(S.STOPPING, {S.STARTING, S.RUNNING}, reason=reason)

    def reset_failures(self) -> None:
        """An operator asked for this restart: past failures say nothing about the next start."""
        self.fast_failures = 0

    def exited(self, returncode: int | None, reason: str | None = None) -> float | None:
        """The process is gone. Returns the delay before the next start, or None when there
        is none (stopped on request, FATAL, or REFUSED)."""
        now = self._clock()
        assert self.started_at is not None
        assert self.state in {S.STARTING, S.RUNNING, S.STOPPING}, self.state
        self.last_exit = ExitInfo.from_returncode(returncode, at=self._wall(),
                                                  uptime_s=now - self.started_at, reason=reason)
        old_pid, self.pid = self.pid, None
        why = {"exit": self.last_exit.describe(), "old_pid": old_pid}
        if self.state is S.STOPPING:
            self.change_state(S.STOPPED, {S.STOPPING}, **why)
            return None
        if returncode is not None and returncode in self.permanent_exits:
            # Not a failure to count or back off from: the child says a restart is useless.
            if self.state is S.RUNNING:
                self.change_state(S.EXITED, {S.RUNNING}, fast_failures=self.fast_failures, **why)
            self.change_state(S.REFUSED, {S.EXITED, S.STARTING}, **why)
            return None
        if self.state is S.RUNNING:
            assert self.ready_at is not None
            good = now - self.ready_at >= self.policy.min_uptime_s
            self.fast_failures = 0 if good else self.fast_failures + 1
            self.change_state(S.EXITED, {S.RUNNING}, fast_failures=self.fast_failures, **why)
        else:  # a failed start: it never answered, however long it took
            assert self.state is S.STARTING, self.state
            self.fast_failures += 1
        source = {S.EXITED, S.STARTING}
        if self.fast_failures >= self.policy.max_fast_failures:
            self.change_state(S.FATAL, source, fast_failures=self.fast_failures, **why)
            return None
        if self.fast_failures == 0:
            return 0.0  # a good run that ended: restart now (EXITED -> STARTING on spawn)
        delay = self.policy.backoff_delay(self.fast_failures)
        self.backoff_until = now + delay
        self.change_state(S.BACKOFF, source, delay_s=delay, fast_failures=self.fast_failures, **why)
        return delay

    # -- figures for the status file
    def uptime_s(self) -> float | None:
        if self.started_at is None or self.pid is None:
            return None
        return self._clock() - self.started_at

    def snapshot(self) -> dict[str, Any]:
        uptime = self.uptime_s()
        backoff_left = (max(0.0, self.backoff_until - self._clock())
                        if self.backoff_until is not None and self.state is S.BACKOFF else None)
        return {
            "state": self.state.value,
            "pid": self.pid,
            "restarts": self.restarts,
            "fast_failures": self.fast_failures,
            "uptime_s": None if uptime is None else round(uptime, 3),
            "started_at": self.started_wall if self.pid is not None else None,
            "backoff_remaining_s": None if backoff_left is None else round(backoff_left, 3),
            "last_exit": None if self.last_exit is None else self.last_exit.as_dict(),
        }
