"""Compiling a request's grammar under a time bound, cancellable, off the tokenizer threads.

``GrammarCompiles`` (one per station server, trio side) answers ``await compile(spec)``
with the xgrammar ``CompiledGrammar`` of a checked spec:

1. from the model's ``Grammars`` cache when it was compiled before;
2. else the spec is compiled first in a grammar worker process
   (``station.sampling.grammar_worker``): past ``grammar_compile_timeout_s`` the worker is
   killed and the request is refused (``bad_request`` naming the setting); when the
   request is cancelled meanwhile (its client left, the station stops) the worker is killed
   too, so no compile outlives its request. Up to ``WORKERS`` compile at once; a killed one
   is replaced at the next compile. A worker takes seconds to start (``import xgrammar``
   imports torch), at the first grammar that is not cached; the bound counts from its
   start's end;
3. a spec that compiled in time is compiled in the station on the grammar thread
   (``trio.to_thread`` with a limiter of its own, never the tokenizer threads' limiter);
   xgrammar releases the GIL meanwhile.

A spec's size is bounded before any of this (``grammar_max_nodes``, checked by the parser).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import trio

from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode, OpError
from station.sampling.grammar import Grammars

log = get_logger(__name__)

WORKERS = 2  # grammar worker processes compiling at once
_START_TIMEOUT_S = 60.0  # a worker's start: python, xgrammar, the tokenizer info


class _Worker:
    """One worker process and the bytes it wrote that are not a whole line yet."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    async def send(self, value: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(json.dumps(value).encode() + b"\n")

    async def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            data = await self.process.stdout.receive_some(65536)
            if not data:
                raise OpError(ErrorCode.INTERNAL, "the grammar compile worker exited "
                              f"(status {self.process.poll()})")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


class GrammarCompiles:
    """The station's grammar compiles (trio thread); see the module docstring."""

    def __init__(self, loaded: Any, timeout_s: float, workers: int = WORKERS) -> None:
        self.loaded = loaded
        self.timeout_s = timeout_s
        self._idle: list[_Worker] = []
        self._workers = trio.CapacityLimiter(workers)
        self._thread = trio.CapacityLimiter(1)
        self._info: str | None = None  # the tokenizer info, serialized once
        self.killed = 0  # workers killed (past the bound, or their request cancelled)
        self.timed_out = 0  # of which past the bound
        self.probed = 0  # specs compiled in a worker in time

    async def _grammars(self) -> Grammars:
        """The model's ``Grammars``: made once on a thread (building xgrammar's view of the
        vocabulary takes a while for a large one), never waiting behind a compile."""
        from station.sampling.grammar import grammars_for

        made = getattr(self.loaded, "grammars", None)
        return made if made is not None else await trio.to_thread.run_sync(grammars_for, self.loaded)

    async def compile(self, spec: dict[str, Any]) -> Any:
        grammars = await self._grammars()
        found = grammars.cached(spec)
        if found is not None:
            return found
        async with self._workers:
            await self._probe(grammars, spec)
        return await trio.to_thread.run_sync(grammars.compile, spec, limiter=self._thread,
                                             abandon_on_cancel=True)

    async def _probe(self, grammars: Grammars, spec: dict[str, Any]) -> None:
        worker = self._idle.pop() if self._idle else await self._start(grammars)
        kept = False
        try:
            started = time.monotonic()
            with trio.move_on_after(self.timeout_s):
                await worker.send({"spec": spec})
                reply = await worker.receive()
                kept = True
            if not kept:
                self.timed_out += 1
                log.warning("grammar_compile_timeout", timeout_s=self.timeout_s,
                            waited_s=round(time.monotonic() - started, 3))
                raise OpError(ErrorCode.BAD_REQUEST, f"argument 'grammar' did not compile "
                              f"within {self.timeout_s:g} s (the grammar_compile_timeout_s "
                              f"bound); make it smaller")
        finally:
            if kept:
                self._idle.append(worker)
            else:  # past the bound, cancelled, or broken: the compile must not go on
                self.killed += 1
                worker.kill()
                with trio.CancelScope(shield=True):
                    await worker.process.wait()
        self.probed += 1
        if not reply.get("ok"):
            raise OpError(ErrorCode.BAD_REQUEST,
                          f"argument 'grammar' cannot be compiled: {reply.get('error')}")

    async def _start(self, grammars: Grammars) -> _Worker:
        if self._info is None:
            self._info = await trio.to_thread.run_sync(grammars.serialized_info)
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "station.sampling.grammar_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        worker = _Worker(process)
        ready = False
        try:
            with trio.fail_after(_START_TIMEOUT_S):
                await worker.send({"tokenizer_info": self._info})
                await worker.receive()
                ready = True
        except trio.TooSlowError:
            raise OpError(ErrorCode.INTERNAL, "the grammar compile worker did not start") from None
        finally:
            if not ready:  # cancelled (its request went away) or broken
                self.killed += 1
                worker.kill()
                with trio.CancelScope(shield=True):
                    await worker.process.wait()
        return worker

    def figures(self) -> dict[str, int]:
        """For the station's ``stats``: compiles in a worker, past the bound, workers killed."""
        return {"probed": self.probed, "timed_out": self.timed_out, "workers_killed": self.killed,
                "workers_idle": len(self._idle)}

    def close(self) -> None:
        """Kill the idle workers (the station stops)."""
        for worker in self._idle:
            worker.kill()
        self._idle.clear()
