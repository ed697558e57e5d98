"""The child driver with real processes: a tiny Unix-socket server stands in for a worker
(no torch), so restart, hang detection, backoff and stop are exercised in a second or two."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from gnosis_daemon.logs import get_logger
from supervisor.child import Child, ChildSpec
from supervisor.probes import ProbeFailed
from supervisor.states import ChildMachine, ChildState, RestartPolicy

PING_SERVER = r"""
import os, signal, socket, sys
path, mode = sys.argv[1], sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "crash":
    sys.exit(3)
if mode == "refuse" and os.path.exists(path + ".refuse"):
    sys.exit(78)
if mode == "pdeathsig":
    from supervisor.pdeathsig import current_pdeathsig
    open(path + ".sig", "w").write(str(current_pdeathsig()))
try:
    os.unlink(path)
except FileNotFoundError:
    pass
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(16)
while True:
    c, _ = s.accept()
    c.sendall(str(os.getpid()).encode() + b"\n")
    c.close()
"""


async def ping(path: Path) -> dict:
    try:
        stream = await trio.open_unix_socket(str(path))
    except OSError as exc:
        raise ProbeFailed(str(exc)) from None
    async with stream:
        data = await stream.receive_some(100)
    if not data:
        raise ProbeFailed("closed")
    return {"pid": int(data)}


def make_child(tmp_path: Path, mode: str = "serve", *, max_fast_failures: int = 3,
               min_uptime_s: float = 0.0, before_spawn=None) -> Child:
    sock = tmp_path / "ping.sock"
    spec = ChildSpec(
        "station", [sys.executable, "-c", PING_SERVER, str(sock), mode],
        dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        ready_probe=lambda: ping(sock), health_probe=lambda: ping(sock),
        start_timeout_s=10.0, health_interval_s=0.1, health_timeout_s=0.3,
        failures_before_kill=2, stop_timeout_s=0.5, before_spawn=before_spawn)
    policy = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.2,
                           min_uptime_s=min_uptime_s, max_fast_failures=max_fast_failures)
    machine = ChildMachine("station", policy, logger=get_logger(), permanent_exits=frozenset({78}))
    return Child(spec, machine, get_logger())


async def wait_state(child: Child, state: ChildState, *, pid_not: int | None = None,
                     timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while child.state is not state or (pid_not is not None and child.machine.pid == pid_not):
            await trio.sleep(0.02)


async def test_killed_child_is_restarted_with_a_new_pid(tmp_path):
    child = make_child(tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.run)
        await wait_state(child, ChildState.RUNNING)
        first = child.machine.pid
        assert child.ready_info == {"pid": first}
        os.kill(first, signal.SIGKILL)
        await wait_state(child, ChildState.RUNNING, pid_not=first)
        assert child.machine.restarts == 1
        assert child.machine.last_exit.signal == signal.SIGKILL
        assert child.machine.last_exit.reason is None
        await child.stop(1.0)
    assert child.state is ChildState.STOPPED and child.machine.last_exit.signal == signal.SIGTERM


async def test_hung_child_is_killed_and_restarted(tmp_path):
    child = make_child(tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.run)
        await wait_state(child, ChildState.RUNNING)
        first = child.machine.pid
        os.kill(first, signal.SIGSTOP)
        # 2 failures x (0.1 s interval + 0.3 s timeout), then a fresh start: well under 10 s
        await wait_state(child, ChildState.RUNNING, pid_not=first)
        assert child.machine.last_exit.signal == signal.SIGKILL
        assert child.machine.last_exit.reason == "unresponsive: 2 failed health checks"
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # reaped, not a zombie
        await child.stop(1.0)


async def test_crash_loop_backs_off_then_goes_fatal(tmp_path):
    child = make_child(tmp_path, "crash")
    states: list[str] = []
    child.machine.listener = lambda m, old, new, why: states.append(new.value)
    with trio.fail_after(10):
        await child.run()  # returns by itself: FATAL
    assert states == ["starting", "backoff", "starting", "backoff", "starting", "fatal"]
    assert child.machine.last_exit.code == 3
    assert child.machine.restarts == 2


async def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path):
    child = make_child(tmp_path, "ignore-term")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.run)
        await wait_state(child, ChildState.RUNNING)
        await child.stop(0.3)
    assert child.state is ChildState.STOPPED
    assert child.machine.last_exit.signal == signal.SIGKILL


async def test_requested_restart_gives_a_new_pid(tmp_path):
    child = make_child(tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.run)
        await wait_state(child, ChildState.RUNNING)
        first = child.machine.pid
        await child.request_restart(1.0)
        await wait_state(child, ChildState.RUNNING, pid_not=first)
        assert child.machine.restarts == 1 and child.machine.fast_failures == 0
        await child.stop(1.0)


async def test_child_has_sigkill_as_parent_death_signal(tmp_path):
    child = make_child(tmp_path, "pdeathsig")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.run)
        await wait_state(child, ChildState.RUNNING)
        await child.stop(1.0)
    assert (tmp_path / "ping.sock.sig").read_text() == str(int(signal.SIGKILL))


async def test_cancelling_run_leaves_no_process(tmp_path):
    child = make_child(tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.run)
        await wait_state(child, ChildState.RUNNING)
        pid = child.machine.pid
        nursery.cancel_scope.cancel()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_refused_child_is_parked_until_an_operator_restart(tmp_path):
    marker = tmp_path / "ping.sock.refuse"
    marker.touch()
    spawns: list[float] = []
    child = make_child(tmp_path, "refuse", max_fast_failures=1,
                       before_spawn=lambda: spawns.append(trio.current_time()))
    states: list[str] = []
    child.machine.listener = lambda m, old, new, why: states.append(new.value)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.run)
        await wait_state(child, ChildState.REFUSED)
        await trio.sleep(1.0)  # backoff is 0.05 s and one failure would be FATAL: neither
        assert (child.state, len(spawns), child.machine.restarts) == (ChildState.REFUSED, 1, 0)
        assert child.machine.last_exit.code == 78 and not child.done.is_set()
        marker.unlink()  # the operator fixed it, then asks for a restart
        await child.request_restart(1.0)
        await wait_state(child, ChildState.RUNNING)
        assert len(spawns) == 2 and child.machine.restarts == 1
        await child.stop(1.0)
    assert states == ["starting", "refused", "starting", "running", "stopping", "stopped"]


async def test_stop_while_refused_is_immediate(tmp_path):
    (tmp_path / "ping.sock.refuse").touch()
    child = make_child(tmp_path, "refuse")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.run)
        await wait_state(child, ChildState.REFUSED)
        with trio.fail_after(2):
            await child.stop(5.0)
    assert child.state is ChildState.STOPPED and child.done.is_set()
