"""The station process: load the model, start the engine, serve the Unix socket.

Resource handling: the socket file is private from birth (``station.socket_file``). Each
connection owns a nursery with one task per streaming request; when the connection ends
(EOF, error, undecodable frame) every request it still has is aborted in the engine.

Threads: the trio thread only decodes frames, checks arguments (in time bounded by the
frame) and moves answers; tokenizer and chat-template work (``tokenize``, ``detokenize``,
a text or chat prompt, ``embed`` texts) runs on worker threads (``_text_work``, at most
``TEXT_THREADS`` at once), and the model runs on the engine thread. A request whose
arguments are being tokenized is in ``Connection.preparing`` and can be cancelled there.

Error handling: a frame that decodes but breaks the protocol gets an error frame and the
connection keeps working; a frame that cannot be decoded (or is too big) gets an error
frame with id null and closes that connection only. SIGTERM/SIGINT stop accepting, end
in-flight requests with ``shutting_down``, remove the socket and exit 0.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trio

import gnosis_daemon
from gnosis_daemon.logs import bind_request, configure_logging, get_logger
from gnosis_daemon.protocol import (
    OP_CAPABILITY,
    PROTOCOL_VERSION,
    Capability,
    ErrorCode,
    FrameDecoder,
    ProtocolError,
    Request,
    error_frame,
    parse_request,
    result_frame,
)
from gnosis_daemon.settings import Settings
from station import engine_ops, ops
from station.connection import Connection, Preparing
from station.engine_api import Engine, EngineEvent, EngineOpError, EventKind, GenerationRequest
from station.model_loader import LoadedModel, ModelLoadError, load_model
from station.ops import OpError
from station.paged_engine import PagedEngine
from station.persist import TierReport, restore_sessions, save_sessions
from station.socket_file import bind_socket, remove_socket
from station.stream import GenerateStream

log = get_logger(__name__)

_SHUTDOWN_GRACE_S = 5.0  # time for final frames to reach clients after SIGTERM
# Worker threads for tokenizer work. The Rust tokenizer releases the GIL, so these run
# beside the trio thread; two keep one huge input from queueing every other request
# without taking every core from the engine thread.
TEXT_THREADS = 2


class StationServer:
    def __init__(self, settings: Settings, loaded: LoadedModel, engine: Engine) -> None:
        self.settings = settings
        self.loaded = loaded
        self.engine = engine
        self.started = time.monotonic()
        self.capabilities = self._capabilities()
        self._connections: set[Connection] = set()
        self._numbers = itertools.count(1)
        self.shutting_down = False
        self._handlers = {"hello": self._hello, "health": self._health, "stats": self._stats}
        self._text_limiter = trio.CapacityLimiter(TEXT_THREADS)

    def _capabilities(self) -> dict[str, bool]:
        flags = {Capability.GENERATE.value: True}
        flags.update({k: True for k, v in self.engine.capabilities().items() if v})
        disabled = self.settings.disabled_capabilities
        return {k: True for k in flags if k not in disabled}

    # -- lifecycle
    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Bind the socket and serve until SIGTERM/SIGINT (then drain and return)."""
        path = self.settings.station_socket
        listener = trio.socket.from_stdlib_socket(bind_socket(path))
        identity = os.stat(path).st_ino
        log.info("station_listening", socket=str(path), model=self.loaded.served_id,
                 device=str(self.loaded.device), capabilities=sorted(self.capabilities))
        try:
            async with trio.open_nursery() as nursery:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    nursery.start_soon(self._accept_loop, listener, nursery)
                    task_status.started()
                    async for signum in signals:
                        log.info("station_stopping", signal=signal.Signals(signum).name)
                        break
                listener.close()  # trio's close wakes the blocked accept (notify_closing)
                await self._drain()
                nursery.cancel_scope.cancel()
        finally:
            listener.close()
            remove_socket(path, identity)

    async def _drain(self) -> None:
        """End every in-flight request with shutting_down and let the frames go out."""
        self.shutting_down = True
        for conn in list(self._connections):
            for gen in list(conn.generates.values()):
                self.engine.abort(gen.engine_id)
                gen.inject(EngineEvent(gen.engine_id, EventKind.ERROR, {
                    "code": ErrorCode.SHUTTING_DOWN.value,
                    "message": "the station is shutting down"}))
            for call in list(conn.calls.values()):
                call.cancel(ErrorCode.SHUTTING_DOWN, "the station is shutting down")
            for prep in list(conn.preparing.values()):
                prep.cancel(ErrorCode.SHUTTING_DOWN, "the station is shutting down")
        with trio.move_on_after(_SHUTDOWN_GRACE_S):
            while any(conn.generates or conn.calls or conn.preparing
                      for conn in self._connections):
                await trio.sleep(0.01)

    async def _accept_loop(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            try:
                client, _ = await listener.accept()
            except trio.ClosedResourceError:
                return  # listener closed: shutting down
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EINVAL):
                    return
                log.warning("accept_failed", error=str(exc))
                await trio.sleep(0.1)
                continue
            nursery.start_soon(self._handle_connection, trio.SocketStream(client))

    # -- connections
    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        conn = Connection(next(self._numbers), stream)
        self._connections.add(conn)
        try:
            async with trio.open_nursery() as nursery:
                await self._read_loop(conn, nursery)
                nursery.cancel_scope.cancel()
        finally:
            self._connections.discard(conn)
            for gen in conn.generates.values():
                self.engine.abort(gen.engine_id)
                gen.close()
            conn.generates.clear()
            conn.closed = True
            # Its host-held sequences and their blocks, and its engine calls still in
            # progress (an embed stops at the engine's next step boundary).
            self.engine.release_owner(conn.number)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _read_loop(self, conn: Connection, nursery: trio.Nursery) -> None:
        decoder = FrameDecoder(self.settings.max_frame_bytes)
        while True:
            try:
                data = await conn.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            try:
                for message in decoder.feed(data):
                    await self._dispatch(conn, message, nursery)
            except ProtocolError as exc:
                assert exc.fatal
                log.warning("bad_frame_closing_connection", connection=conn.number,
                            error=exc.message)
                await conn.send(error_frame(None, exc.code, exc.message))
                return

    async def _dispatch(self, conn: Connection, message: Any, nursery: trio.Nursery) -> None:
        try:
            req = parse_request(message)
        except ProtocolError as exc:
            await conn.send(error_frame(exc.request_id, exc.code, exc.message))
            return
        with bind_request(req.rid):
            try:
                if req.op in OP_CAPABILITY and OP_CAPABILITY[req.op].value not in self.capabilities:
                    raise OpError(ErrorCode.UNKNOWN_OP, f"op {req.op!r} is not available "
                                  "on this station")
                if self.shutting_down and req.op not in ("hello", "health"):
                    raise OpError(ErrorCode.SHUTTING_DOWN, "the station is shutting down")
                if req.op == "generate":
                    self._start_generate(conn, req, nursery)
                    return
                if req.op in engine_ops.ENGINE_OPS:
                    self._start_engine_call(conn, req, nursery)
                    return
                if req.op in ("tokenize", "detokenize"):
                    self._start_text_op(conn, req, nursery)
                    return
                if req.op == "cancel":
                    result = self._cancel(conn, req)
                elif req.op in self._handlers:
                    result = self._handlers[req.op](req)
                else:
                    raise OpError(ErrorCode.UNKNOWN_OP, f"unknown op {req.op!r}")
            except OpError as exc:
                await conn.send(error_frame(req.id, exc.code, exc.message))
                return
            except Exception as exc:  # a bug in one op must not end the connection
                log.exception("op_failed", op=req.op)
                await conn.send(error_frame(req.id, ErrorCode.INTERNAL,
                                            f"{type(exc).__name__}: {exc}"))
                return
            await conn.send(result_frame(req.id, result))

    # -- ops
    # What the start found in the KV disk tier (``persist.TierReport.as_dict()``), set by
    # ``serve``; hello and health publish it so a rejected or foreign tier is never silent.
    kv_tier: dict[str, Any] | None = None

    def _hello(self, req: Request) -> dict[str, Any]:
        loaded, stats = self.loaded, self.engine.stats()
        return {
            "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "version": gnosis_daemon.__version__,
            "model": {"id": loaded.served_id, "path": loaded.path,
                      "fingerprint": loaded.fingerprint, "model_type": loaded.model_type,
                      "max_model_len": loaded.max_model_len, "vocab_size": loaded.vocab_size,
                      "eos_token_ids": list(loaded.eos_token_ids),
                      "max_token_chars": loaded.max_token_chars,
                      "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch.")},
            "capabilities": dict(self.capabilities),
            "kv_pool": {"block_size": int(self.engine.block_size),
                        "blocks_total": int(stats.get("blocks_total", 0)),
                        "blocks_free": int(stats.get("blocks_free", 0))},
            "kv_tier": self.kv_tier,
        }

    def _health(self, req: Request) -> dict[str, Any]:
        stats = self.engine.stats()
        return {"status": "shutting_down" if self.shutting_down else "ok", "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - self.started, 3),
                "running": int(stats.get("running", 0)), "waiting": int(stats.get("waiting", 0)),
                "kv_tier": self.kv_tier}

    def _stats(self, req: Request) -> dict[str, Any]:
        return {**self.engine.stats(), "connections": len(self._connections)}

    def _cancel(self, conn: Connection, req: Request) -> dict[str, Any]:
        target = req.args.get("target")
        if not isinstance(target, (int, str)) or isinstance(target, bool):
            raise ops.bad("argument 'target' must be the id of a request on this connection")
        prep = conn.preparing.get(target)
        if prep is not None:
            return {"cancelled": prep.cancel(ErrorCode.CANCELLED, "request cancelled")}
        call = conn.calls.get(target)
        if call is not None:
            return {"cancelled": call.cancel()}
        gen = conn.generates.get(target)
        if gen is None or gen.done:
            return {"cancelled": False}
        self.engine.abort(gen.engine_id)
        return {"cancelled": True}

    def _check_new_id(self, conn: Connection, req: Request) -> None:
        if conn.in_flight(req.id):
            raise ops.bad(f"request id {req.id!r} is already in flight on this connection")

    async def _text_work(self, work: Any) -> Any:
        """``work()`` on a worker thread. Cancelling abandons it: the thread finishes on its
        own (its limiter slot stays taken until then) and its result is dropped."""
        return await trio.to_thread.run_sync(work, limiter=self._text_limiter,
                                             abandon_on_cancel=True)

    async def _run_prepared(self, conn: Connection, req: Request, prep: Preparing,
                            work: Any, then: Any) -> None:
        """The task of a request in ``conn.preparing``: ``work()`` on a worker thread, then
        ``then(result)`` on trio, whose return value is the result frame (None: ``then``
        has handed the request on and it answers itself)."""
        reply = None
        with bind_request(req.rid):
            try:
                with prep.scope:
                    result = await self._text_work(work)
                if prep.error is not None:  # cancelled, or the station is stopping
                    raise OpError(*prep.error)
                del conn.preparing[req.id]
                reply = then(result)
            except OpError as exc:
                await conn.send(error_frame(req.id, exc.code, exc.message))
                return
            except Exception as exc:  # a bug in one op must not end the connection
                log.exception("op_failed", op=req.op)
                await conn.send(error_frame(req.id, ErrorCode.INTERNAL,
                                            f"{type(exc).__name__}: {exc}"))
                return
            finally:
                if conn.preparing.get(req.id) is prep:
                    del conn.preparing[req.id]
            if reply is not None:
                await conn.send(result_frame(req.id, reply))

    def _start_text_op(self, conn: Connection, req: Request, nursery: trio.Nursery) -> None:
        """tokenize / detokenize: cheap checks here, the tokenizer on a worker thread."""
        self._check_new_id(conn, req)
        plan = ops.plan_tokenize if req.op == "tokenize" else ops.plan_detokenize
        work = plan(self.loaded, req.args)
        prep = conn.preparing[req.id] = Preparing()
        nursery.start_soon(self._run_prepared, conn, req, prep, work, lambda result: result)

    def _start_generate(self, conn: Connection, req: Request, nursery: trio.Nursery) -> None:
        self._check_new_id(conn, req)
        plan = ops.plan_generate(self.loaded, self.settings, req.args)
        if ((plan.load_session or plan.save_session or plan.save_final_session)
                and Capability.KV_SESSION.value not in self.capabilities):
            raise ops.bad("KV session arguments need capability kv_session, which this "
                          "station does not have")
        if not plan.needs_encoding:
            assert plan.prompt_ids is not None
            self._submit_generate(conn, req, nursery, plan.finish(self.loaded, plan.prompt_ids))
            return

        def submit(prompt_ids: list[int]) -> None:
            self._submit_generate(conn, req, nursery, plan.finish(self.loaded, prompt_ids))

        prep = conn.preparing[req.id] = Preparing()
        nursery.start_soon(self._run_prepared, conn, req, prep,
                           functools.partial(plan.encode, self.loaded), submit)

    def _submit_generate(self, conn: Connection, req: Request, nursery: trio.Nursery,
                         gen_args: ops.GenerateArgs) -> None:
        engine_id = f"{req.rid or 'gen'}:{conn.number}:{req.id}"
        gen = GenerateStream(req.id, engine_id, gen_args, self.loaded.tokenizer,
                             self.loaded.eos_token_ids, trio.lowlevel.current_trio_token())
        request = GenerationRequest(engine_id, gen_args.prompt_ids, gen_args.params,
                                    tenant=gen_args.tenant, load_session=gen_args.load_session,
                                    save_session=gen_args.save_session,
                                    save_final_session=gen_args.save_final_session)
        try:
            self.engine.add_request(request, gen.on_event)
        except ValueError as exc:
            raise ops.bad(str(exc)) from None
        except RuntimeError as exc:
            raise OpError(ErrorCode.SHUTTING_DOWN, str(exc)) from None
        except EngineOpError as exc:  # capacity: the waiting queue is full
            raise OpError(ErrorCode(exc.code), exc.message) from None
        conn.generates[req.id] = gen
        nursery.start_soon(self._run_generate, conn, req, gen)

    async def _run_generate(self, conn: Connection, req: Request, gen: GenerateStream) -> None:
        with bind_request(req.rid):
            try:
                await gen.pump(conn.send, self.engine)
            finally:
                if conn.generates.get(req.id) is gen:
                    del conn.generates[req.id]

    def _start_engine_call(self, conn: Connection, req: Request, nursery: trio.Nursery) -> None:
        """Ops served on the engine thread: one task each, so calls of one connection
        (many host-held sequences' decode_next) reach the same engine step together.
        ``embed`` of texts is handed to the engine by its task, once tokenized."""
        self._check_new_id(conn, req)
        kwargs = engine_ops.parse(self.loaded, req.op, req.args)
        call = engine_ops.EngineCall(trio.lowlevel.current_trio_token(), self.engine)
        texts = kwargs.pop("texts", None)
        if texts is None:
            self._submit_call(conn, req, call, kwargs)
        conn.calls[req.id] = call
        nursery.start_soon(self._run_engine_call, conn, req, call, texts)

    def _submit_call(self, conn: Connection, req: Request, call: engine_ops.EngineCall,
                     kwargs: dict[str, Any]) -> None:
        try:
            self.engine.call(engine_ops.ENGINE_OPS[req.op], conn.number, call.done, **kwargs)
        except RuntimeError as exc:
            raise OpError(ErrorCode.SHUTTING_DOWN, str(exc)) from None
        except EngineOpError as exc:  # capacity: the waiting queue is full
            raise OpError(ErrorCode(exc.code), exc.message) from None
        call.submitted = True

    async def _run_engine_call(self, conn: Connection, req: Request,
                               call: engine_ops.EngineCall, texts: list[str] | None) -> None:
        with bind_request(req.rid):
            try:
                try:
                    if texts is not None:
                        with trio.CancelScope() as call.scope:
                            kwargs = await self._text_work(functools.partial(
                                engine_ops.encode_embed_texts, self.loaded, texts))
                        call.scope = None
                        if not call.finished:  # else cancelled meanwhile: wait() says so
                            self._submit_call(conn, req, call, kwargs)
                    result = await call.wait()
                except OpError as exc:
                    await conn.send(error_frame(req.id, exc.code, exc.message))
                    return
                except Exception as exc:  # a bug in one op must not end the connection
                    log.exception("op_failed", op=req.op)
                    await conn.send(error_frame(req.id, ErrorCode.INTERNAL,
                                                f"{type(exc).__name__}: {exc}"))
                    return
                await conn.send(result_frame(req.id, result))
            finally:
                if conn.calls.get(req.id) is call:
                    del conn.calls[req.id]


def create_engine(loaded: LoadedModel, settings: Settings) -> PagedEngine:
    return PagedEngine(loaded, settings)


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

    def __init__(self, settings: Settings, tier: Path) -> None:
        self.settings = settings
        self.tier = tier
        # Set before the boot result is handed over; read by the main thread after it.
        self.tier_report = TierReport(str(tier), enabled=settings.kv_persistence)
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
            loaded = load_model(self.settings)
            log.info("model_loaded", model=loaded.served_id, path=loaded.path,
                     loaded_from=loaded.loaded_from, device=str(loaded.device),
                     dtype=str(loaded.dtype), fingerprint=loaded.fingerprint[:16])
            engine = create_engine(loaded, self.settings)
            if self.settings.kv_persistence:
                # Never raises for what is on disk: a bad tier is moved aside and reported.
                self.tier_report = restore_sessions(engine, self.tier)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self._booted.put(exc)
            return
        self._booted.put((loaded, engine))
        engine.run_here()


def serve(settings: Settings) -> int:
    """Entry point of ``gnosis-daemon station``: returns the process exit status."""
    configure_logging("station", settings.log_level, settings.log_format)
    tier = settings.effective_state_dir / "kv-sessions"
    torch_thread = _TorchThread(settings, tier)
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
        server.kv_tier = torch_thread.tier_report.as_dict()
        trio.run(server.serve)
    finally:
        engine.shutdown()  # ends the engine loop: the torch thread returns
        # shutdown joins the loop's thread only once run_here has registered it; a stop
        # that comes right after boot can beat that, so join the torch thread here.
        torch_thread.thread.join()
        if settings.kv_persistence:
            try:
                save_sessions(engine, tier)
            except Exception:  # a full or read-only disk: the previous tier stays whole
                log.exception("kv_sessions_save_failed", path=str(tier))
    log.info("station_stopped")
    return 0
