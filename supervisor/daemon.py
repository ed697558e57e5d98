"""``gnosis-daemon run``: the supervisor of the station and the host.

Start order: the station, until it answers ``hello``; then the host, until ``/health``
answers; then ``READY=1``. From then on each child is restarted on its own when it exits or
stops answering (``child.py``), and every state change is published: the status file,
systemd's ``STATUS=`` line, and the control socket's ``status`` op.

Shutdown (SIGTERM or SIGINT): ``STOPPING=1``; the host gets SIGTERM first and up to
``drain_grace_s`` plus a margin to finish in-flight requests; then the station gets SIGTERM
and ``stop_timeout_s`` to persist its sessions; SIGKILL for whatever remains; exit 0. A second
signal kills both at once. A child that goes FATAL stops the other and the supervisor exits 1,
so systemd's ``Restart=on-failure`` takes over.

A station that refuses its model (exit ``REFUSED_EXIT``, 78) is REFUSED: never restarted,
and not FATAL either. The supervisor stays up, starts (or keeps) the host so that HTTP
answers (``/health`` and every ``/v1`` route say why, with a 503), sends ``READY=1`` and
keeps the watchdog fed (a restart of the unit would refuse again), and publishes the
refusal file's reason: state ``refused``, ``supervisor.refused`` in the status file,
``gnosis-daemon status`` and the ``STATUS=`` line. Only an operator's ``gnosis-daemon
restart station`` (or a restart of the unit) starts the station again.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import trio

from gnosis_daemon.api_keys import KeyFileError
from gnosis_daemon.logs import configure_logging, get_logger
from gnosis_daemon.refusal import REFUSED_EXIT, clear_refusal, describe, read_refusal
from gnosis_daemon.settings import Settings
from gnosis_daemon.unix_sockets import prepare_runtime_dir
from supervisor.child import Child, ChildSpec
from supervisor.control import ControlError, serve_control
from supervisor.notify import Notifier
from supervisor.probes import host_health, probe_api_key, station_health, station_hello
from supervisor.states import ChildMachine, ChildState, RestartPolicy
from supervisor.status import STATUS_VERSION, write_status

# The host's own drain deadline is drain_grace_s; this covers its exit after that deadline.
DRAIN_MARGIN_S = 5.0
HOST_FLAG_KEYS = ("liquid_memory", "liquid_memory_env", "station_kv_session")
HOST_REASON_KEYS = ("liquid_memory_reason", "reason")
FORCED_EXIT = 130


def child_argv(name: str) -> list[str]:
    return [sys.executable, "-m", "gnosis_daemon.cli", name]


def host_capabilities(health: dict[str, Any]) -> dict[str, Any]:
    """The host's effective liquid-memory state, as its /health reports it."""
    caps = {key: health[key] for key in HOST_FLAG_KEYS if key in health}
    for key in HOST_REASON_KEYS:
        if health.get(key):
            caps["reason"] = health[key]
            break
    return caps


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.log = get_logger("supervisor")
        self.notifier = Notifier(settings.notify_socket, self.log)
        self.started_at = time.time()
        self.ready = False  # both children served once (READY=1 sent)
        self.exit_code = 0
        self._shutdown = trio.Event()
        self._stopped = False
        self._fatal: str | None = None
        self._refusal: dict[str, Any] | None = None  # the station's, while it is REFUSED
        self._changed = trio.Event()
        self._last_flags: Any = None
        self._last_summary = ""
        self._nursery: trio.Nursery | None = None
        # Read once at start: a bad keys file stops the daemon here (see serve), not later.
        self._probe_key = probe_api_key(settings)
        env = settings.child_environ()
        policy = RestartPolicy.from_settings(settings)
        common: dict[str, Any] = dict(health_interval_s=settings.health_interval_s,
                                      health_timeout_s=settings.health_timeout_s,
                                      failures_before_kill=settings.health_failures_before_kill)
        sock, frame = settings.station_socket, settings.max_frame_bytes
        self.station = self._child(ChildSpec(
            "station", child_argv("station"), env,
            ready_probe=functools.partial(station_hello, sock, frame),
            health_probe=functools.partial(station_health, sock, frame, settings.engine_stall_s,
                                           settings.tokenizer_stall_s),
            start_timeout_s=settings.station_start_timeout_s,
            stop_timeout_s=settings.stop_timeout_s, before_spawn=self._clear_refusal_file,
            **common), policy, permanent_exits=frozenset({REFUSED_EXIT}))
        self.host = self._child(ChildSpec(
            "host", child_argv("host"), env,
            ready_probe=self._host_probe, health_probe=self._host_probe,
            start_timeout_s=settings.host_start_timeout_s,
            stop_timeout_s=settings.drain_grace_s + DRAIN_MARGIN_S, **common), policy)
        self.children = (self.station, self.host)

    def _child(self, spec: ChildSpec, policy: RestartPolicy,
               permanent_exits: frozenset[int] = frozenset()) -> Child:
        machine = ChildMachine(spec.name, policy, listener=self._on_state, logger=self.log,
                               permanent_exits=permanent_exits)
        return Child(spec, machine, self.log, on_info=self._on_info)

    def _clear_refusal_file(self) -> None:
        """Before every station spawn: an earlier station's refusal must not describe this
        one while it loads (the host reads the file when it cannot reach the station)."""
        path = self.settings.station_refusal_file
        try:
            if clear_refusal(path):
                self.log.info("stale_refusal_removed", path=str(path))
        except OSError as exc:
            self.log.warning("stale_refusal_not_removed", path=str(path), error=str(exc))

    def _load_refusal(self) -> dict[str, Any]:
        path = self.settings.station_refusal_file
        refusal = read_refusal(path)
        if refusal is None:  # the exit status is the contract; the file only says why
            reason = (f"the station exited with status {REFUSED_EXIT} (it refuses its model) "
                      f"but left no readable refusal file at {path}")
            refusal = {"model_type": None, "kind": None, "reason": reason, "message": reason,
                       "model": self.settings.model or None, "pid": None, "at": None}
        return refusal

    async def _host_probe(self) -> dict[str, Any]:
        status, body = await host_health(self.settings.host, self.settings.port,
                                         self._probe_key)
        return {"http_status": status, "body": body}

    # -- publishing
    @property
    def state(self) -> str:
        if self._fatal:
            return "fatal"
        if self._stopped:
            return "stopped"
        if self._shutdown.is_set():
            return "stopping"
        if self.station.state is ChildState.REFUSED:
            return "refused"
        if not self.ready:
            return "starting"
        ok = all(c.state is ChildState.RUNNING for c in self.children)
        return "running" if ok else "degraded"

    def _child_status(self, child: Child) -> dict[str, Any]:
        snap = child.machine.snapshot()
        running = child.state is ChildState.RUNNING
        if child is self.station:
            hello = child.ready_info if running else {}
            snap["capabilities"] = {k: v for k, v in (hello.get("capabilities") or {}).items() if v}
            snap["model"] = (hello.get("model") or {}).get("id")
            # The KV tiers' fill (the latest health check's, else hello's) and what the
            # start found: quarantined files, a disk tier that could not be opened.
            health_tier = (child.health_info or {}).get("kv_tier") if running else None
            snap["kv_tier"] = health_tier or hello.get("kv_tier")
            snap["health"] = child.health_info if running else {}
            snap["refused"] = self._refusal if child.state is ChildState.REFUSED else None
        else:
            latest = (child.health_info or child.ready_info) if running else {}
            body = latest.get("body") or {}
            snap["capabilities"] = host_capabilities(body)
            snap["http_status"] = latest.get("http_status")
            snap["health"] = body
        snap["health_failures"] = child.health_failures
        return snap

    def status_document(self) -> dict[str, Any]:
        return {
            "version": STATUS_VERSION,
            "updated_at": time.time(),
            "supervisor": {"pid": os.getpid(), "state": self.state, "ready": self.ready,
                           "started_at": self.started_at, "fatal": self._fatal,
                           "refused": self._refusal,
                           "runtime_dir": self.settings.runtime_dir},
            "children": {c.name: self._child_status(c) for c in self.children},
        }

    def summary(self) -> str:
        """systemd's one-line STATUS=."""
        parts = [self.state]
        for child in self.children:
            m = child.machine
            parts.append(f"{child.name} {m.state.value}"
                         + (f" pid {m.pid}" if m.pid else "") + f" restarts {m.restarts}")
        caps = self._child_status(self.host)["capabilities"]
        if "liquid_memory" in caps:
            lm = "on" if caps["liquid_memory"] else f"off ({caps.get('reason', 'no reason given')})"
            parts.append(f"liquid_memory {lm}")
        if self._refusal is not None:
            parts.append(f"station refused its model: {describe(self._refusal)}")
        return "; ".join(parts)

    def publish(self) -> None:
        try:
            write_status(self.settings.status_file, self.status_document())
        except OSError as exc:
            self.log.error("status_write_failed", path=str(self.settings.status_file), error=str(exc))
        line = self.summary()
        if line != self._last_summary:
            self._last_summary = line
            self.notifier.status(line)

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _on_state(self, machine: ChildMachine, old: ChildState, new: ChildState,
                  why: dict[str, Any]) -> None:
        if machine is self.station.machine:
            if new is ChildState.REFUSED:
                self._refusal = self._load_refusal()
                self.log.error("station_refused", model_type=self._refusal.get("model_type"),
                               kind=self._refusal.get("kind"), reason=self._refusal.get("reason"),
                               model=self._refusal.get("model"),
                               action="not restarted: serve another model or a build that "
                                      "implements it, then restart the unit or "
                                      "`gnosis-daemon restart station`")
            elif old is ChildState.REFUSED:
                self._refusal = None
        self.publish()
        self._poke()

    def _on_info(self, child: Child) -> None:
        flags = [self._child_status(c)["capabilities"] for c in self.children]
        if flags != self._last_flags:  # a capability changed: publish now, not next period
            self._last_flags = flags
            self.publish()

    async def _until(self, predicate: Callable[[], bool]) -> None:
        while True:
            changed = self._changed
            if predicate():
                return
            await changed.wait()

    # -- tasks
    async def run(self) -> int:
        runtime = Path(self.settings.runtime_dir)
        prepare_runtime_dir(runtime)  # it holds the station's socket: nobody else may connect
        self.log.info("supervisor_start", pid=os.getpid(), runtime_dir=str(runtime),
                      notify=self.notifier.enabled, watchdog_usec=self.settings.watchdog_usec)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._watch_signals, signals)
                try:  # first: a second supervisor must not touch the first one's files
                    await nursery.start(serve_control, self.settings.control_socket,
                                        self._control)
                except ControlError as exc:
                    self.log.error("supervisor_refused", error=str(exc))
                    print(f"gnosis-daemon: {exc}", file=sys.stderr)
                    nursery.cancel_scope.cancel()
                    return 1
                self.publish()
                nursery.start_soon(self._periodic)
                if self.settings.watchdog_usec:
                    nursery.start_soon(self._watchdog, self.settings.watchdog_usec / 2e6)
                await self._main(nursery)
                nursery.cancel_scope.cancel()
        self.log.info("supervisor_exit", code=self.exit_code, state=self.state)
        return self.exit_code

    def _fatal_child(self) -> Child | None:
        return next((c for c in self.children if c.state is ChildState.FATAL), None)

    def _ended(self) -> bool:
        return self._shutdown.is_set() or self._fatal_child() is not None

    async def _main(self, nursery: trio.Nursery) -> None:
        for child in self.children:  # in order: the host needs the station's socket
            nursery.start_soon(child.run)
            # A REFUSED station will not serve, but the host still starts: it answers
            # /health and every /v1 route with the refusal's reason.
            await self._until(lambda: self._ended() or child.state in (ChildState.RUNNING,
                                                                       ChildState.REFUSED))
            if self._ended():
                break
        if not self._ended():
            self.ready = True
            self.log.info("supervisor_ready", station_pid=self.station.machine.pid,
                          host_pid=self.host.machine.pid)
            self.notifier.ready(self.summary())
            self.publish()
        await self._until(self._ended)
        failed = self._fatal_child()
        if failed is not None and not self._shutdown.is_set():
            self._fatal = f"{failed.name} failed {failed.machine.fast_failures} times in a row"
            self.exit_code = 1
            self.log.error("supervisor_giving_up", child=failed.name, reason=self._fatal)
        await self._stop_all()

    async def _stop_all(self) -> None:
        self._shutdown.set()
        self.notifier.stopping(self.summary())
        self.publish()
        # The host first: it drains in-flight requests, which need the station to finish.
        await self.host.stop(self.settings.drain_grace_s + DRAIN_MARGIN_S)
        await self.station.stop(self.settings.stop_timeout_s)
        self._stopped = not self._fatal
        self.publish()

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not self._shutdown.is_set():
                self.log.info("supervisor_signal", signal=name, action="graceful shutdown")
                self._shutdown.set()
                self._poke()
            else:
                self.log.warning("supervisor_signal", signal=name, action="force: SIGKILL children")
                self.exit_code = FORCED_EXIT
                for child in self.children:
                    child.force_kill()

    async def _periodic(self) -> None:
        while True:
            await trio.sleep(self.settings.health_interval_s)
            self.publish()

    async def _watchdog(self, interval_s: float) -> None:
        # The watchdog guards the supervisor's own loop; children are its job, so a child
        # in backoff is no reason for systemd to kill the whole unit. Only FATAL is. A
        # REFUSED station is not either: a unit restarted for it would only refuse again.
        while True:
            if self._fatal_child() is None:
                self.notifier.watchdog()
            await trio.sleep(interval_s)

    async def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "status":
            return {"ok": True, "status": self.status_document()}
        child = self.station if request["child"] == "station" else self.host
        if self._shutdown.is_set():
            return {"ok": False, "error": "the supervisor is shutting down"}
        if not child.started:
            return {"ok": False, "error": f"{child.name} has not been started yet"}
        assert self._nursery is not None
        pid = child.machine.pid
        timeout = (self.settings.stop_timeout_s if child is self.station
                   else self.settings.drain_grace_s + DRAIN_MARGIN_S)
        self.log.info("child_restart_requested", child=child.name, pid=pid)
        self._nursery.start_soon(child.request_restart, timeout)
        return {"ok": True, "child": child.name, "pid": pid, "state": child.state.value}


def serve(settings: Settings) -> int:
    configure_logging("supervisor", settings.log_level, settings.log_format)
    try:
        supervisor = Supervisor(settings)
    except KeyFileError as exc:
        get_logger("supervisor").error("bad_api_keys_file", error=str(exc))
        print(f"gnosis-daemon: {exc}", file=sys.stderr)
        return 2
    return trio.run(supervisor.run)
