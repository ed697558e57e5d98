"""The station's socket server: connections, dispatch through the op registry, draining.

Resource handling: the socket file is private from birth (``gnosis_daemon.unix_sockets``). Each
connection owns a nursery with one task per request it hands on; when the connection ends
(EOF, error, undecodable frame) every request it still has is aborted in the engine.

Dispatch: each op's entry in the op registry (``station.serving.op_registry``) gives its parser and
handler and says where the handler runs. The trio thread only decodes frames, runs parsers
(in time bounded by the frame), answers inline ops and moves answers; tokenizer and
chat-template work (``tokenize``, ``detokenize``, a text or chat prompt, ``embed`` texts)
runs on worker threads (``_text_work``, at most ``TEXT_THREADS`` at once), and the model runs
on the engine thread. A request whose arguments are being tokenized is in
``Connection.preparing`` and can be cancelled there; so is one whose grammar is being
compiled (``station.sampling.grammar_compile``: in a worker process, then on the grammar
thread, never on the tokenizer threads), and cancelling it kills its compile's process.

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
import signal
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from gnosis_daemon.logs import bind_request, get_logger
from gnosis_daemon.protocol import (
    ErrorCode,
    FrameDecoder,
    OpError,
    ProtocolError,
    Request,
    error_frame,
    parse_request,
    result_frame,
)
from gnosis_daemon.settings import Settings
from gnosis_daemon.unix_sockets import bind_socket, remove_socket
from station.serving import engine_ops, ops
from station.serving.connection import Connection, Preparing
from station.core.requests import Failed
from station.sampling.grammar_compile import GrammarCompiles
from station.model.loader import LoadedModel
from station.serving.op_registry import STATION_OPS, OpRegistry, OpSpec, RunsOn
from station.serving.ops import Tokenizing
from station.serving.stream import EventRelay, GenerateStream

if TYPE_CHECKING:
    from station.engine.loop import PagedEngine

log = get_logger(__name__)

_SHUTDOWN_GRACE_S = 5.0  # time for final frames to reach clients after SIGTERM
# Worker threads for tokenizer work. The Rust tokenizer releases the GIL, so these run
# beside the trio thread; two keep one huge input from queueing every other request
# without taking every core from the engine thread.
TEXT_THREADS = 2


class StationServer:
    """Serves the ops of ``registry`` (the station's own unless a test passes another)."""

    def __init__(self, settings: Settings, loaded: LoadedModel, engine: PagedEngine,
                 registry: OpRegistry = STATION_OPS) -> None:
        self.settings = settings
        self.loaded = loaded
        self.engine = engine
        self.registry = registry
        self.started = time.monotonic()
        self.capabilities = registry.advertised(engine.capabilities(),
                                                settings.disabled_capabilities)
        self._connections: set[Connection] = set()
        self._numbers = itertools.count(1)
        self.shutting_down = False
        self.text_threads = TEXT_THREADS
        self._text_limiter = trio.CapacityLimiter(TEXT_THREADS)
        self.grammar_compiles = GrammarCompiles(loaded, settings.grammar_compile_timeout_s)
        # The tokenizer jobs running on worker threads now, with when each began (health's
        # ``serving`` figures: every worker on an old job is a stuck station).
        self.text_jobs: dict[object, float] = {}
        self._relay: EventRelay | None = None  # engine events to trio, made by the first stream

    # What the start found in the KV disk tier (``station.tier.start.open_tier``), set by
    # ``serve``; hello and health publish it so a rejected or foreign tier is never silent.
    kv_tier: dict[str, Any] | None = None
    # The start check's figures (``station.plan.start_check``), set by ``serve``; None when
    # the engine was built without one (in-process embedders and tests).
    start_check: dict[str, Any] | None = None

    @property
    def num_connections(self) -> int:
        return len(self._connections)

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
            self.grammar_compiles.close()
            remove_socket(path, identity)

    async def _drain(self) -> None:
        """End every in-flight request with shutting_down and let the frames go out."""
        self.shutting_down = True
        for conn in list(self._connections):
            for gen in list(conn.generates.values()):
                self.engine.abort(gen.engine_id)
                gen.inject(Failed(gen.engine_id, OpError(ErrorCode.SHUTTING_DOWN,
                                                         "the station is shutting down")))
            for call in list(conn.calls.values()):
                call.cancel(ErrorCode.SHUTTING_DOWN, "the station is shutting down")
            for prep in list(conn.preparing.values()):
                prep.cancel(ErrorCode.SHUTTING_DOWN, "the station is shutting down")
        with trio.move_on_after(_SHUTDOWN_GRACE_S):
            while any(conn.generates or conn.calls or conn.preparing or conn.writing
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
                nursery.start_soon(conn.write_queued)
                await self._read_loop(conn, nursery)
                nursery.cancel_scope.cancel()
        finally:
            self._connections.discard(conn)
            for gen in conn.generates.values():
                self.engine.abort(gen.engine_id)
                gen.close()
            conn.generates.clear()
            conn.close()
            # Its held sequences and their blocks, and its engine calls still in
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

    # -- dispatch: the op's entry in the registry says how it is served
    async def _dispatch(self, conn: Connection, message: Any, nursery: trio.Nursery) -> None:
        try:
            req = parse_request(message)
        except ProtocolError as exc:
            await conn.send(error_frame(exc.request_id, exc.code, exc.message))
            return
        with bind_request(req.rid):
            await self._reply(conn, req, functools.partial(self._start, conn, req, nursery))

    async def _reply(self, conn: Connection, req: Request,
                     work: Callable[[], Awaitable[dict[str, Any] | None]]) -> None:
        """Send the result frame of ``await work()`` (None: the request was handed on and
        answers later), or the error frame of what it raised."""
        try:
            result = await work()
        except OpError as exc:
            await conn.send(error_frame(req.id, exc.code, exc.message))
            return
        except Exception as exc:  # a bug in one op must not end the connection
            log.exception("op_failed", op=req.op)
            await conn.send(error_frame(req.id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            return
        if result is not None:
            await conn.send(result_frame(req.id, result))

    def _spec(self, op: str) -> OpSpec:
        """The op's entry, if this station serves it now; else the error that says why."""
        spec = self.registry.get(op)
        if spec is not None and spec.capability is not None \
                and spec.capability not in self.capabilities:
            raise OpError(ErrorCode.UNKNOWN_OP, f"op {op!r} is not available on this station")
        if self.shutting_down and not (spec is not None and spec.while_stopping):
            raise OpError(ErrorCode.SHUTTING_DOWN, "the station is shutting down")
        if spec is None:
            raise OpError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")
        return spec

    async def _start(self, conn: Connection, req: Request,
                     nursery: trio.Nursery) -> dict[str, Any] | None:
        """Answer an inline op, or check the request and hand it to its thread."""
        spec = self._spec(req.op)
        if spec.runs_on is RunsOn.INLINE:
            return spec.handler(self, conn, spec.parse(self, req.args))
        if conn.in_flight(req.id):
            raise ops.bad(f"request id {req.id!r} is already in flight on this connection")
        args = spec.parse(self, req.args)
        if spec.runs_on is RunsOn.WORKER:
            assert not isinstance(args, Tokenizing), "a worker op tokenizes in its handler"
            self._prepare(conn, req, nursery, functools.partial(spec.handler, self.loaded, args))
        elif isinstance(args, Tokenizing):
            self._prepare(conn, req, nursery, args.work,
                          then=functools.partial(self._submit, spec, conn, req, nursery),
                          tokenizing=args)
        else:
            self._submit(spec, conn, req, nursery, args)
        return None

    # -- worker threads (tokenizer work)
    def _prepare(self, conn: Connection, req: Request, nursery: trio.Nursery,
                 work: Callable[[], Any], then: Callable[[Any], None] | None = None,
                 tokenizing: Tokenizing | None = None) -> None:
        """Run ``work()`` on a worker thread (then its ``tokenizing.finish``, after its
        grammar is compiled); the result is the reply, or goes on to ``then``. Until then
        the request is in ``conn.preparing`` (cancellable there, its compile with it)."""
        prep = conn.preparing[req.id] = Preparing()
        nursery.start_soon(self._run_prepared, conn, req, prep, work, then, tokenizing)

    async def _run_prepared(self, conn: Connection, req: Request, prep: Preparing,
                            work: Callable[[], Any], then: Callable[[Any], None] | None,
                            tokenizing: Tokenizing | None = None) -> None:
        async def prepared() -> dict[str, Any] | None:
            with prep.scope:
                result = await self._text_work(work)
                if tokenizing is not None and tokenizing.finish is not None:
                    compiled = None
                    if tokenizing.grammar is not None:  # never on the tokenizer threads
                        compiled = await self.grammar_compiles.compile(tokenizing.grammar)
                    result = tokenizing.finish(result, compiled)
            if prep.error is not None:  # cancelled, or the station is stopping
                raise OpError(*prep.error)
            del conn.preparing[req.id]
            if then is None:
                return result
            then(result)  # handed on: it answers itself
            return None

        with bind_request(req.rid):
            try:
                await self._reply(conn, req, prepared)
            finally:
                if conn.preparing.get(req.id) is prep:
                    del conn.preparing[req.id]

    async def _text_work(self, work: Callable[[], Any]) -> Any:
        """``work()`` on a worker thread. Cancelling abandons it: the thread finishes on its
        own (its limiter slot stays taken until then) and its result is dropped."""
        return await trio.to_thread.run_sync(self._timed, work, limiter=self._text_limiter,
                                             abandon_on_cancel=True)

    def _timed(self, work: Callable[[], Any]) -> Any:
        """``work()`` on its worker thread, in ``text_jobs`` while it runs (an abandoned job
        too: it holds its worker until it ends)."""
        token = object()
        self.text_jobs[token] = time.monotonic()
        try:
            return work()
        finally:
            del self.text_jobs[token]

    # -- the engine thread
    def _submit(self, spec: OpSpec, conn: Connection, req: Request, nursery: trio.Nursery,
                args: Any) -> None:
        """Hand an engine op to the engine: a streaming op as a request it schedules, any
        other as a call. One task each, so the calls of one connection (many held
        sequences' decode_next) reach the same engine step together."""
        token = trio.lowlevel.current_trio_token()
        if spec.streaming:
            if self._relay is None or self._relay.token is not token:
                if self._relay is not None:
                    self.engine.turn_done.remove(self._relay.turn_done)
                self._relay = EventRelay(token)  # one per trio run: every stream's events
                self.engine.turn_done.append(self._relay.turn_done)
            engine_id = f"{req.rid or 'gen'}:{conn.number}:{req.id}"
            gen = spec.handler(req.id, engine_id, args, self.loaded.tokenizer,
                               self.loaded.eos_token_ids, self._relay)
            gen.route(conn, self.engine)
            self.engine.add_request(gen.engine_request(), gen.on_event)
            conn.generates[req.id] = gen
            nursery.start_soon(self._run_generate, conn, req, gen)
            return
        call = engine_ops.EngineCall(token, self.engine)
        self.engine.call(spec.handler, conn.number, call.done, **args)
        conn.calls[req.id] = call
        nursery.start_soon(self._run_engine_call, conn, req, call)

    async def _run_generate(self, conn: Connection, req: Request, gen: GenerateStream) -> None:
        with bind_request(req.rid):
            try:
                await gen.pump()
            finally:
                if conn.generates.get(req.id) is gen:
                    del conn.generates[req.id]

    async def _run_engine_call(self, conn: Connection, req: Request,
                               call: engine_ops.EngineCall) -> None:
        with bind_request(req.rid):
            try:
                await self._reply(conn, req, call.wait)
            finally:
                if conn.calls.get(req.id) is call:
                    del conn.calls[req.id]

