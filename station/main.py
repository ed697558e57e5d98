"""The station process: load the model on its one torch thread, then serve the socket.

``serve`` is the entry point of ``gnosis-daemon station``; ``StationServer``
(``station.serving.server``) serves the socket once the model, the engine and the disk tier are up.

A model the engine refuses (``ModelRefused``: an attention kind it does not implement, a
start check that disagrees with the model's own forward) is permanent, not a crash: the
station logs ``model_refused``, writes ``settings.station_refusal_file`` and exits with
``REFUSED_EXIT`` (78), which the supervisor does not restart (``gnosis_daemon.refusal``).
Any other load error exits 1 and is restarted with backoff.
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
from gnosis_daemon.refusal import clear_refusal, write_refusal
from gnosis_daemon.settings import Settings
from station.model.loader import (
    REFUSED_EXIT,
    LoadedModel,
    ModelLoadError,
    ModelRefused,
    default_model_path,
    load_model,
)
from station.engine.loop import PagedEngine
from station.tier.io.process import KVIOProcess
from station.tier.start import open_tier
from station.plan.start_check import prove_engine
from station.serving.detok import ascii_pieces
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
    spin-waits, so every parallel op pays a futex wake-up, and a batched decode step runs
    markedly slower than the same step on the process's only torch thread. The trio thread
    never runs a parallel torch op.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Set before the boot result is handed over; read by the main thread after it.
        self.tier_report: dict[str, Any] = {}
        self.kv_events: KVEventPublisher | None = None
        self.start_check: dict[str, Any] = {}  # station.plan.start_check, once it passed
        self.model_path: str | None = None  # where the model was loaded from, once it was
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
            self.model_path = str(loaded.path)
            log.info("model_loaded", model=loaded.served_id, path=loaded.path,
                     loaded_from=loaded.loaded_from, mapped=loaded.mapped, device=str(loaded.device),
                     dtype=str(loaded.dtype), fingerprint=loaded.fingerprint[:16])
            engine = PagedEngine(loaded, self.settings)
            ascii_pieces(loaded.tokenizer)  # the detokenizer's shortcut, made before requests come
            # The paged path against the model's own forward, past its longest window:
            # ModelRefused when they disagree (before any router or tier sees the pool).
            self.start_check = prove_engine(engine, self.settings)
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
    # Whatever an earlier station refused, this one has not (yet): a stale file must not
    # describe a station that is loading, or one that fails for another reason.
    _clear_stale_refusal(settings)
    try:
        loaded, engine = torch_thread.boot()
    except ModelRefused as exc:
        return _refused(settings, exc, torch_thread.model_path)
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
        server.start_check = torch_thread.start_check
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


def _clear_stale_refusal(settings: Settings) -> None:
    try:
        if clear_refusal(settings.station_refusal_file):
            log.info("stale_refusal_removed", path=str(settings.station_refusal_file))
    except OSError as exc:  # not ours to remove (another user's dir): the write will say
        log.warning("stale_refusal_not_removed", path=str(settings.station_refusal_file),
                    error=str(exc))


def _default_model() -> str:
    try:
        return str(default_model_path())
    except ModelLoadError:
        return "(the default model)"


def _refused(settings: Settings, exc: ModelRefused, model_path: str | None) -> int:
    """A permanent refusal: log it, publish it in the refusal file, exit ``REFUSED_EXIT``."""
    model = model_path or settings.model or _default_model()
    log.error("model_refused", model_type=exc.model_type, kind=exc.kind, reason=exc.reason,
              model=model, exit_code=REFUSED_EXIT, path=str(settings.station_refusal_file))
    try:
        write_refusal(settings.station_refusal_file, exc.as_dict(), model=model)
    except OSError as exc_write:
        # Still a refusal: the exit status alone keeps the supervisor from restarting it.
        log.error("refusal_write_failed", path=str(settings.station_refusal_file),
                  error=str(exc_write))
    return REFUSED_EXIT
