"""The station process: load the model on its one torch thread, then serve the socket.

``serve`` is the entry point of ``gnosis-daemon station``; ``StationServer``
(``station.serving.server``) serves the socket once the model, the engine and the disk tier are up.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from typing import Any

import trio

from gnosis_daemon.logs import configure_logging, get_logger
from gnosis_daemon.settings import Settings
from station.runtime.model_loader import LoadedModel, ModelLoadError, load_model
from station.runtime.engine import PagedEngine
from station.runtime.kv_io_process import KVIOProcess
from station.runtime.kv_tier_start import open_tier
from station.serving.kv_events import KVEventPublisher, start_publisher
from station.serving.server import StationServer

log = get_logger(__name__)


class _StopRequested(BaseException):
    """SIGTERM/SIGINT arrived before the socket server took over signals."""


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise _StopRequested(signum)


class _TorchThread:
    """The one thread of the station process that runs torch: it loads the model, builds
    the engine, restores the disk tier, then runs the engine loop until shutdown.

    Why one thread: libgomp keeps an OpenMP thread pool per thread that ever ran a parallel
    region. With two such threads (say, the main thread loading the model and an engine
    thread decoding) it manages more threads than there are CPUs and throttles its
    spin-waits, so every parallel op pays a futex wake-up: on a 2-core host the batched
    decode step measured 30-40% slower than the same step on the process's only torch
    thread. The trio thread never runs a parallel torch op.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Set before the boot result is handed over; read by the main thread after it.
        self.tier_report: dict[str, Any] = {}
        self.kv_events: KVEventPublisher | None = None
        self._booted: queue.Queue[tuple[LoadedModel, PagedEngine] | BaseException] = queue.Queue()
        self.thread = threading.Thread(target=self._main, name="station-torch", daemon=True)

    def boot(self) -> tuple[LoadedModel, PagedEngine]:
        """Start the thread and wait for the model and engine (its errors re-raised here)."""
        self.thread.start()
        booted = self._booted.get()  # interruptible: SIGTERM raises _StopRequested here
        if isinstance(booted, BaseException):
            raise booted
        return booted

    def _main(self) -> None:
        try:
            # The tier's I/O process imports torch while the model loads.
            io = KVIOProcess(self.settings.log_level, self.settings.log_format,
                             self.settings.kv_io_nice) if self.settings.kv_persistence else None
            # Bound before the load, so routers reconnect while the model loads.
            self.kv_events = start_publisher(self.settings)
            loaded = load_model(self.settings)
            log.info("model_loaded", model=loaded.served_id, path=loaded.path,
                     loaded_from=loaded.loaded_from, device=str(loaded.device),
                     dtype=str(loaded.dtype), fingerprint=loaded.fingerprint[:16])
            engine = PagedEngine(loaded, self.settings)
            if self.kv_events is not None:
                self.kv_events.attach(engine)  # AllBlocksCleared: a new pool
            # Never raises for what is on disk: bad files are quarantined and counted. The
            # tier's index is rebuilt from its files; no KV is read until a request asks.
            self.tier_report = open_tier(engine, self.settings, io)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self._booted.put(exc)
            return
        self._booted.put((loaded, engine))
        engine.run_here()


def serve(settings: Settings) -> int:
    """Entry point of ``gnosis-daemon station``: returns the process exit status."""
    configure_logging("station", settings.log_level, settings.log_format)
    torch_thread = _TorchThread(settings)
    # A stop request while the model loads (minutes for a 7B model) is a clean exit too;
    # trio's signal receiver takes over once the socket is up.
    previous = {sig: signal.signal(sig, _exit_cleanly) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        loaded, engine = torch_thread.boot()
    except ModelLoadError as exc:
        log.error("model_load_failed", error=str(exc))
        return 1
    except _StopRequested:
        log.info("station_stopped_while_loading")
        if torch_thread.thread.is_alive():
            # Nothing is served or saved yet; do not let interpreter teardown race a load
            # that is still running torch code on the other thread.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        server = StationServer(settings, loaded, engine)
        server.kv_tier = torch_thread.tier_report
        trio.run(server.serve)
    finally:
        # Ends the engine loop (the torch thread returns) and flushes the write-behind:
        # every saved session is on disk when the station exits cleanly.
        engine.shutdown()
        # shutdown joins the loop's thread only once run_here has registered it; a stop
        # that comes right after boot can beat that, so join the torch thread here.
        torch_thread.thread.join()
        if torch_thread.kv_events is not None:
            torch_thread.kv_events.close()
    log.info("station_stopped")
    return 0
