"""One supervised child: spawn, wait until it answers, watch its health, restart it.

The policy (which state follows which fact, how long to back off) lives in ``states.py``;
this module turns process events and probe results into those facts.

Resource handling: the process is spawned from the trio thread with ``subprocess.Popen`` (not
``trio.lowlevel.open_process``, which forks from a worker thread: see ``pdeathsig.py``), in its
own session so a terminal's Ctrl-C reaches only the supervisor, which then stops the children
in order. Its exit is awaited through a pidfd (Linux >= 5.3), else by polling. ``run()`` owns
the process: leaving it (cancelled or not) leaves no child behind.

Error handling: probe failures are expected while a child starts and are retried until its
start timeout; a child that fails its health check ``failures_before_kill`` times in a row is
SIGKILLed and then handled like any other exit. A failure to spawn at all counts as a failed
start. Nothing here swallows ``trio.Cancelled``. A child whose exit status is one of its
machine's ``permanent_exits`` is REFUSED: ``run`` parks, with no process, until an operator's
``request_restart`` (which starts it again) or ``stop``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import trio

from supervisor import pdeathsig
from supervisor.probes import ProbeFailed
from supervisor.states import ChildMachine, ChildState

Probe = Callable[[], Awaitable[dict[str, Any]]]


class ChildProcess:
    """A spawned process and a way to await its exit without blocking the event loop."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid
        try:
            self._pidfd: int | None = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            self._pidfd = None
        self.exited = trio.Event()

    @classmethod
    def spawn(cls, argv: Sequence[str], env: dict[str, str]) -> ChildProcess:
        popen = subprocess.Popen(
            list(argv), env=env, stdin=subprocess.DEVNULL, close_fds=True,
            start_new_session=True, preexec_fn=pdeathsig.make_preexec(signal.SIGKILL))
        return cls(popen)

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    async def wait(self) -> int:
        """Wait for the exit and reap. Only one task may call this (``run`` does)."""
        try:
            if self._pidfd is not None:
                await trio.lowlevel.wait_readable(self._pidfd)
            else:
                while self.popen.poll() is None:
                    await trio.sleep(0.05)
            code = self.popen.wait()  # readable pidfd: it has exited, this does not block
        finally:
            if self.popen.returncode is not None:
                self._close_pidfd()
        self.exited.set()
        return code

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def send_signal(self, sig: int) -> None:
        if self.popen.returncode is not None:
            return
        try:
            if self._pidfd is not None:  # a pidfd cannot hit a recycled pid
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                self.popen.send_signal(sig)
        except ProcessLookupError:
            pass

    def kill_now(self) -> None:
        """Synchronous last resort (forced exit, finally blocks): SIGKILL and reap."""
        self.send_signal(signal.SIGKILL)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.returncode is not None:
            self._close_pidfd()
            self.exited.set()


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str]
    ready_probe: Probe  # answers once the child serves; its result is the child's info
    health_probe: Probe  # periodic liveness; its result refreshes the info
    start_timeout_s: float
    health_interval_s: float
    health_timeout_s: float
    failures_before_kill: int
    stop_timeout_s: float  # after SIGTERM, before SIGKILL
    # Called right before every spawn (the station: remove a stale refusal file).
    before_spawn: Callable[[], None] | None = None


class Child:
    def __init__(self, spec: ChildSpec, machine: ChildMachine, logger: Any,
                 on_info: Callable[[Child], None] | None = None) -> None:
        self.spec = spec
        self.machine = machine
        self.log = logger
        self.on_info = on_info
        self.proc: ChildProcess | None = None
        self.ready_info: dict[str, Any] = {}  # what the ready probe returned (station: hello)
        self.health_info: dict[str, Any] = {}  # the last health answer
        self.health_failures = 0
        self.done = trio.Event()  # run() returned: STOPPED or FATAL
        self._kill_reason: str | None = None
        self._stopping = False  # stop() called: no more restarts
        self._restart = False  # request_restart(): stop, then start again at once
        self._wake = trio.CancelScope()  # cancels a backoff sleep
        self.started = False  # run() was called

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state(self) -> ChildState:
        return self.machine.state

    # -- lifecycle
    async def run(self) -> None:
        """Start the child and keep it running until ``stop()`` or FATAL; a REFUSED child
        waits here for an operator's restart or the stop."""
        self.started = True
        try:
            while not self._stopping:
                if self.machine.state is ChildState.REFUSED:
                    with trio.CancelScope() as self._wake:
                        await trio.sleep_forever()  # request_restart or stop cancels it
                    if self._stopping:
                        break
                self._spawn()
                if self.proc is None:
                    delay = self.machine.exited(None, reason="spawn failed")
                else:
                    code = await self._supervise(self.proc)
                    delay = self.machine.exited(code, reason=self._kill_reason)
                self._kill_reason = None
                if self.machine.state is ChildState.FATAL:
                    return
                if self.machine.state is ChildState.REFUSED:
                    continue  # parked at the top of the loop
                if self.machine.state is ChildState.STOPPED:
                    if self._restart and not self._stopping:
                        self._restart = False
                        continue
                    return
                if delay and not self._stopping:
                    with trio.CancelScope() as self._wake:
                        await trio.sleep(delay)
                if self._stopping and self.machine.state in (ChildState.BACKOFF, ChildState.EXITED):
                    self.machine.stop_requested("shutdown")
            if self.machine.state is ChildState.REFUSED:  # stopped while parked
                self.machine.stop_requested("shutdown")
        finally:
            if self.proc is not None and self.proc.returncode is None:
                self.proc.kill_now()  # cancelled from outside: never leave an orphan
            self.done.set()

    def _spawn(self) -> None:
        self.ready_info = {}
        self.health_info = {}
        self.health_failures = 0
        if self.spec.before_spawn is not None:
            self.spec.before_spawn()
        try:
            self.proc = ChildProcess.spawn(self.spec.argv, self.spec.env)
        except (OSError, subprocess.SubprocessError) as exc:
            self.proc = None
            self.log.error("child_spawn_failed", child=self.name, error=str(exc))
            self.machine.spawned(None)
            return
        self.machine.spawned(self.proc.pid)

    async def _supervise(self, proc: ChildProcess) -> int:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, proc)
            code = await proc.wait()
            nursery.cancel_scope.cancel()
        return code

    async def _watch(self, proc: ChildProcess) -> None:
        """Readiness, then the health loop. Kills ``proc`` when it will not answer."""
        info: dict[str, Any] | None = None
        with trio.move_on_after(self.spec.start_timeout_s):
            while info is None:
                # Each attempt is bounded too: one answer that never comes must not use up
                # the whole start timeout.
                with trio.move_on_after(self.spec.health_timeout_s):
                    try:
                        info = await self.spec.ready_probe()
                    except ProbeFailed as exc:
                        self.log.debug("child_not_ready", child=self.name, error=str(exc))
                if info is None:
                    await trio.sleep(0.1)
        if self.machine.state is not ChildState.STARTING:
            return  # a stop or restart was requested meanwhile: that path owns the process
        if info is None:
            self._kill(proc, f"not ready after {self.spec.start_timeout_s:g} s")
            return
        self.ready_info = info
        self.machine.ready()
        self._info_changed()
        await self._health_loop(proc)

    async def _health_loop(self, proc: ChildProcess) -> None:
        while True:
            await trio.sleep(self.spec.health_interval_s)
            if self.machine.state is not ChildState.RUNNING:
                continue  # stopping: the stop path owns the process now
            error: str | None = None
            with trio.move_on_after(self.spec.health_timeout_s):
                try:
                    self.health_info = await self.spec.health_probe()
                    self.health_failures = 0
                    self._info_changed()
                    continue
                except ProbeFailed as exc:
                    error = str(exc)
            self.health_failures += 1
            self.log.warning("child_health_failed", child=self.name, pid=proc.pid,
                             failures=self.health_failures,
                             error=error or f"no answer in {self.spec.health_timeout_s:g} s")
            if (self.health_failures >= self.spec.failures_before_kill
                    and self.machine.state is ChildState.RUNNING):
                self._kill(proc, f"unresponsive: {self.health_failures} failed health checks")
                return

    def _kill(self, proc: ChildProcess, reason: str) -> None:
        self.log.error("child_kill", child=self.name, pid=proc.pid, reason=reason)
        self._kill_reason = reason
        proc.send_signal(signal.SIGKILL)

    def _info_changed(self) -> None:
        if self.on_info is not None:
            self.on_info(self)

    # -- requests from the supervisor
    async def stop(self, timeout_s: float, reason: str = "shutdown") -> None:
        """Stop for good: SIGTERM, ``timeout_s`` grace, then SIGKILL. Returns when run() has."""
        self._stopping = True
        if not self.started:
            return
        await self._terminate(timeout_s, reason)
        self._wake.cancel()
        await self.done.wait()

    async def request_restart(self, timeout_s: float) -> None:
        """Operator restart: stop (SIGTERM, grace, SIGKILL) and start again with a clean
        failure count; a child waiting in backoff, or REFUSED, starts at once."""
        if self._stopping or self.done.is_set():
            return
        self.machine.reset_failures()
        if self.machine.state in (ChildState.BACKOFF, ChildState.REFUSED):
            self._wake.cancel()
            return
        self._restart = True
        await self._terminate(timeout_s, "restart requested")

    async def _terminate(self, timeout_s: float, reason: str) -> None:
        proc = self.proc
        if self.machine.state in (ChildState.STARTING, ChildState.RUNNING):
            self.machine.stop_requested(reason)
        if proc is None or self.machine.state is not ChildState.STOPPING:
            return
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(timeout_s):
            await proc.exited.wait()
            return
        self.log.warning("child_stop_timeout", child=self.name, pid=proc.pid, timeout_s=timeout_s)
        proc.send_signal(signal.SIGKILL)
        await proc.exited.wait()

    def force_kill(self) -> None:
        """Second Ctrl-C: no grace for anyone."""
        self._stopping = True
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)

