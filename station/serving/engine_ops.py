"""Socket ops served by engine calls: argument checks (trio thread) and the trio bridge.

``kv_session.save|load|delete|list``, ``forward``, ``decode_next`` and ``embed`` change or
read engine state (sessions, blocks, the model), so they run on the engine thread between
steps (``PagedEngine.call``, by the ``EngineCalls`` method the op registry names). Here their
arguments are checked (the ``parse_*`` parsers of ``station.serving.op_registry``), so a bad one is
a ``bad_request`` frame before the engine sees anything, and ``EngineCall`` carries the
engine's answer back to the trio task that waits for it: one request frame in, one final
frame out.

``embed`` of texts tokenizes them first, on a worker thread (its parser returns a
``Tokenizing``); its texts are only measured here (the size bound of ``station.serving.ops``).
Cancelling a call (``EngineCall.cancel``) makes the engine drop it at its next step boundary
and free what it held.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import trio

from gnosis_daemon.protocol import ErrorCode, OpError
from gnosis_daemon.wire import Sampling
from station.model.loader import LoadedModel
from station.serving.ops import OpContext, Tokenizing, arg, bad, check_text_size, codec, token_list

if TYPE_CHECKING:
    from station.engine.loop import PagedEngine

MAX_EMBED_INPUTS = 256
DECODE_NEXT_SAMPLING = ("temperature", "top_p", "top_k", "seed")


def _session_id(args: dict[str, Any]) -> str:
    session_id = arg(args, "session_id", str)
    if not session_id:
        raise bad("argument 'session_id' must be a non-empty string")
    return session_id


def _tokens(loaded: LoadedModel, args: dict[str, Any], name: str = "tokens") -> list[int]:
    return token_list(loaded, args, name, [])


def parse_kv_save(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any]:
    prefix_len = arg(args, "prefix_len", int)
    if prefix_len < 0:
        raise bad("argument 'prefix_len' must be >= 0")
    seq_id = arg(args, "seq_id", str, None, nullable=True)
    if seq_id is not None and "tokens" in args:
        raise bad("kv_session.save takes 'tokens' or 'seq_id', not both")
    kwargs: dict[str, Any] = {"session_id": _session_id(args), "prefix_len": prefix_len,
                              "tenant": arg(args, "tenant", str, "")}
    if seq_id is not None:
        kwargs["seq_id"] = seq_id
    else:
        kwargs["tokens"] = _tokens(ctx.loaded, args)  # none at all: only prefix_len 0 (the probe)
    return kwargs


def parse_session_id(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any]:
    return {"session_id": _session_id(args)}


def parse_kv_delete(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any]:
    """One session (``session_id``, ``tenant``: only if it is that tenant's), or ``all``
    of a ``tenant``'s; ``forget``: out of the prefix cache too."""
    tenant = arg(args, "tenant", str, None, nullable=True)
    every = arg(args, "all", bool, False)
    kwargs: dict[str, Any] = {"tenant": tenant, "forget": arg(args, "forget", bool, False),
                              "every": every}
    if every:
        if tenant is None:
            raise bad("argument 'all' needs 'tenant' (whose sessions to delete)")
        if args.get("session_id") is not None:
            raise bad("kv_session.delete takes 'session_id' or 'all', not both")
    else:
        kwargs["session_id"] = _session_id(args)
    return kwargs


def parse_kv_list(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any]:
    return {"include_tokens": arg(args, "include_tokens", bool, False),
            "tenant": arg(args, "tenant", str, None, nullable=True)}


def parse_forward(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any]:
    return {"tokens": _tokens(ctx.loaded, args),
            "seq_id": arg(args, "seq_id", str, None, nullable=True),
            "tenant": arg(args, "tenant", str, ""),
            "load_session": arg(args, "load_session", str, None, nullable=True) or None,
            "release": arg(args, "release", bool, False)}


def parse_decode_next(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any]:
    """The sampling controls decode_next takes, read and checked as generate's are."""
    sampling = Sampling.from_wire({k: args[k] for k in DECODE_NEXT_SAMPLING if k in args})
    return {"seq_id": arg(args, "seq_id", str),
            **{k: getattr(sampling, k) for k in DECODE_NEXT_SAMPLING}}


def parse_embed(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any] | Tokenizing:
    """``{"token_lists": [...]}``, or the texts' encoding into it on a worker thread."""
    loaded = ctx.loaded
    if ("texts" in args) == ("tokens" in args):
        raise bad("embed takes exactly one of 'texts' or 'tokens'")
    inputs = arg(args, "texts" if "texts" in args else "tokens", list)
    if not 1 <= len(inputs) <= MAX_EMBED_INPUTS:
        raise bad(f"embed takes 1 to {MAX_EMBED_INPUTS} inputs")
    if "texts" in args:
        if any(not isinstance(t, str) for t in inputs):
            raise bad("argument 'texts' must be a list of strings")
        for i, text in enumerate(inputs):
            check_text_size(loaded, len(text), f"input {i}")
        return Tokenizing(functools.partial(encode_embed_texts, loaded, list(inputs)))
    token_lists = []
    for item in inputs:
        if not isinstance(item, list):
            raise bad("argument 'tokens' must be a list of lists of ints")
        token_lists.append(token_list(loaded, {"tokens": item}, "tokens"))
    return _checked_inputs(loaded, token_lists)


def encode_embed_texts(loaded: LoadedModel, texts: list[str]) -> dict[str, Any]:
    """Worker thread: the texts' token ids (the tokenizer's special tokens added)."""
    return _checked_inputs(loaded, codec(loaded).encode_many(texts, True, keep=False))


def _checked_inputs(loaded: LoadedModel, token_lists: list[list[int]]) -> dict[str, Any]:
    for i, ids in enumerate(token_lists):
        if not ids:
            raise bad(f"input {i} has no tokens")
        if len(ids) > loaded.max_model_len:
            raise OpError(ErrorCode.CONTEXT_OVERFLOW, f"input {i} has {len(ids)} tokens, more "
                          f"than max_model_len {loaded.max_model_len}")
    return {"token_lists": token_lists}


class EngineCall:
    """One in-flight engine call, seen from trio: the engine's answer or a server-made error.

    ``done`` is the callback the engine was given, and the key ``cancel_call`` knows it by.
    """

    def __init__(self, token: trio.lowlevel.TrioToken, engine: PagedEngine) -> None:
        self._token = token
        self._engine = engine
        self._event = trio.Event()
        self._result: dict[str, Any] | None = None
        self._error: OpError | None = None

    @property
    def finished(self) -> bool:
        return self._event.is_set()

    def done(self, result: dict[str, Any] | None, error: OpError | None) -> None:
        """Engine thread: hand the answer to trio (never blocks)."""
        try:
            self._token.run_sync_soon(self._set, result, error)
        except trio.RunFinishedError:
            pass  # trio is gone (shutdown): nobody is left to tell

    def fail(self, code: ErrorCode, message: str) -> None:
        """Trio thread: end the call with a server-made error (shutdown)."""
        self._set(None, OpError(code, message))

    def cancel(self, code: ErrorCode = ErrorCode.CANCELLED,
               message: str = "request cancelled") -> bool:
        """Trio thread: end the call now with ``code`` and stop the work behind it (the
        engine drops it at its next step boundary). False if it had already ended."""
        if self.finished:
            return False
        self.fail(code, message)
        self._engine.cancel_call(self.done)
        return True

    def _set(self, result: dict[str, Any] | None, error: OpError | None) -> None:
        if not self._event.is_set():
            self._result, self._error = result, error
            self._event.set()

    async def wait(self) -> dict[str, Any]:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
