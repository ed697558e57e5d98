"""Socket ops served by engine calls: argument checks (trio thread) and the trio bridge.

``kv_session.save|load|delete|list``, ``forward``, ``decode_next`` and ``embed`` change or
read engine state (sessions, blocks, the model), so they run on the engine thread between
steps (``PagedEngine.call``). Here their arguments are checked, so a bad one is a
``bad_request`` frame before the engine sees anything, and ``EngineCall`` carries the
engine's answer back to the trio task that waits for it: one request frame in, one final
frame out.
"""

from __future__ import annotations

from typing import Any

import trio

from gnosis_daemon.protocol import ErrorCode
from station.engine_api import EngineOpError, SamplingParams
from station.model_loader import LoadedModel
from station.ops import OpError, arg, bad, check_token_range, int_list

# op -> engine call name
ENGINE_OPS = {
    "kv_session.save": "kv_save",
    "kv_session.load": "kv_load",
    "kv_session.delete": "kv_delete",
    "kv_session.list": "kv_list",
    "forward": "forward",
    "decode_next": "decode_next",
    "embed": "embed",
}
MAX_EMBED_INPUTS = 256


def parse(loaded: LoadedModel, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """Checked keyword arguments of the engine call for ``op`` (raises ``OpError``)."""
    return _PARSERS[op](loaded, args)


def _session_id(args: dict[str, Any]) -> str:
    session_id = arg(args, "session_id", str)
    if not session_id:
        raise bad("argument 'session_id' must be a non-empty string")
    return session_id


def _tokens(loaded: LoadedModel, args: dict[str, Any], name: str = "tokens") -> list[int]:
    tokens = int_list(args, name, [])
    check_token_range(loaded, tokens, name)
    return tokens


def _kv_save(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
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
        kwargs["tokens"] = _tokens(loaded, args)  # none at all: only prefix_len 0 (the probe)
    return kwargs


def _kv_load(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
    return {"session_id": _session_id(args)}


def _kv_list(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
    return {"include_tokens": arg(args, "include_tokens", bool, False)}


def _forward(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
    return {"tokens": _tokens(loaded, args), "seq_id": arg(args, "seq_id", str, None, nullable=True),
            "tenant": arg(args, "tenant", str, ""),
            "load_session": arg(args, "load_session", str, None, nullable=True) or None,
            "release": arg(args, "release", bool, False)}


def _decode_next(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
    kwargs = {"seq_id": arg(args, "seq_id", str),
              "temperature": float(arg(args, "temperature", (int, float), 1.0)),
              "top_p": float(arg(args, "top_p", (int, float), 1.0)),
              "top_k": arg(args, "top_k", int, 0),
              "seed": arg(args, "seed", int, None, nullable=True)}
    try:
        SamplingParams(max_tokens=1, **{k: v for k, v in kwargs.items() if k != "seq_id"})
    except ValueError as exc:
        raise bad(str(exc)) from None
    return kwargs


def _embed(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
    if ("texts" in args) == ("tokens" in args):
        raise bad("embed takes exactly one of 'texts' or 'tokens'")
    if "texts" in args:
        texts = arg(args, "texts", list)
        if any(not isinstance(t, str) for t in texts):
            raise bad("argument 'texts' must be a list of strings")
        token_lists = [list(loaded.tokenizer.encode(t, add_special_tokens=True)) for t in texts]
    else:
        lists = arg(args, "tokens", list)
        token_lists = [int_list({"tokens": item}, "tokens") for item in lists]
        for ids in token_lists:
            check_token_range(loaded, ids, "tokens")
    if not 1 <= len(token_lists) <= MAX_EMBED_INPUTS:
        raise bad(f"embed takes 1 to {MAX_EMBED_INPUTS} inputs")
    for i, ids in enumerate(token_lists):
        if not ids:
            raise bad(f"input {i} has no tokens")
        if len(ids) > loaded.max_model_len:
            raise OpError(ErrorCode.CONTEXT_OVERFLOW, f"input {i} has {len(ids)} tokens, more "
                          f"than max_model_len {loaded.max_model_len}")
    return {"token_lists": token_lists}


_PARSERS = {
    "kv_session.save": _kv_save, "kv_session.load": _kv_load,
    "kv_session.delete": _kv_load, "kv_session.list": _kv_list,
    "forward": _forward, "decode_next": _decode_next, "embed": _embed,
}
assert set(_PARSERS) == set(ENGINE_OPS)


class EngineCall:
    """One in-flight engine call, seen from trio: the engine's answer or a server-made error."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._event = trio.Event()
        self._result: dict[str, Any] | None = None
        self._error: EngineOpError | None = None

    def done(self, result: dict[str, Any] | None, error: EngineOpError | None) -> None:
        """Engine thread: hand the answer to trio (never blocks)."""
        try:
            self._token.run_sync_soon(self._set, result, error)
        except trio.RunFinishedError:
            pass  # trio is gone (shutdown): nobody is left to tell

    def fail(self, code: ErrorCode, message: str) -> None:
        """Trio thread: end the call with a server-made error (shutdown)."""
        self._set(None, EngineOpError(code.value, message))

    def _set(self, result: dict[str, Any] | None, error: EngineOpError | None) -> None:
        if not self._event.is_set():
            self._result, self._error = result, error
            self._event.set()

    async def wait(self) -> dict[str, Any]:
        await self._event.wait()
        if self._error is not None:
            try:
                code = ErrorCode(self._error.code)
            except ValueError:
                code = ErrorCode.INTERNAL
            raise OpError(code, self._error.message)
        assert self._result is not None
        return self._result
