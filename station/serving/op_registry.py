"""The station's ops: one table says, for every op, all the server needs to serve it.

An entry (``OpSpec``) gives the op's name, the capability flag it belongs to (None: a base op
every station has), its argument parser, its handler, where the handler runs and whether the
op streams. ``StationServer`` dispatches by looking the op up here, and the op flags ``hello``
advertises are derived from the same table (``OpRegistry.advertised``): a flag is advertised
only while a registered op carries it, and disabling a flag (``disable_capabilities``) takes
its ops away with it. A station can therefore never advertise an op it does not serve.

A feature flag names what ops can do together rather than an op (``FEATURES``:
``kv_session_match`` is generate's ``match_session`` over kv_session's sessions); it is
advertised only while every flag it needs is, so it cannot outlive its ops either.

Adding an op: write its parser and handler, then add one ``OpSpec`` to ``STATION_OPS``. An op
of the wire protocol also names its capability in ``gnosis_daemon.protocol.OP_CAPABILITY``
(or ``BASE_OPS``): that is what the host knows, and a test checks the two agree.

Parsers run on the trio thread, in time bounded by the frame: ``parse(ctx, args)`` returns
the checked arguments or raises ``OpError``. Work that grows with the input (the tokenizer)
is left to a ``Tokenizing`` the parser returns, which the server runs on a worker thread.

Where the handler runs (``RunsOn``):

- ``INLINE``: the trio thread, at once: ``handler(server, conn, args) -> result``.
- ``WORKER``: a worker thread, cancellable while it runs: ``handler(loaded, args) -> result``.
- ``ENGINE``: the engine thread. A call answered once (``streaming`` false) is a
  ``EngineCalls`` method that ``PagedEngine.call`` runs between steps,
  ``handler(calls, owner, done, **args)``. A streaming op is a request the engine schedules:
  ``handler(frame_id, engine_id, args, tokenizer, eos_ids, relay)`` makes the
  ``GenerateStream`` that turns its engine events into ``event`` frames.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from gnosis_daemon.protocol import Capability
from station.serving import engine_ops, inline_ops, ops
from station.engine.calls import EngineCalls
from station.serving.ops import OpContext
from station.serving.stream import GenerateStream

Parser = Callable[[OpContext, dict[str, Any]], Any]

# feature flag -> the op flags it needs (all advertised, or the feature is not)
FEATURES: dict[str, tuple[str, ...]] = {
    Capability.KV_SESSION_MATCH: (Capability.GENERATE, Capability.KV_SESSION),
    Capability.KV_SESSION_PINS: (Capability.GENERATE, Capability.KV_SESSION),
    Capability.STRUCTURED_OUTPUT: (Capability.GENERATE,),
}


class RunsOn(enum.Enum):
    INLINE = "inline"  # the trio thread: only work the parser has bounded by the frame
    WORKER = "worker"  # a worker thread: tokenizer and chat-template work
    ENGINE = "engine"  # the engine thread: anything that touches the model or the KV pool


@dataclass(frozen=True, slots=True)
class OpSpec:
    name: str
    capability: str | None  # the hello flag this op belongs to; None: a base op
    parse: Parser
    handler: Callable[..., Any]  # its signature depends on ``runs_on`` (module docstring)
    runs_on: RunsOn
    streaming: bool = False  # event frames before the final frame
    while_stopping: bool = False  # still answered while the station shuts down

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an op needs a name")
        if self.capability is not None and not self.capability:
            raise ValueError(f"op {self.name!r}: capability must be None or a flag name")
        if self.streaming and self.runs_on is not RunsOn.ENGINE:
            raise ValueError(f"op {self.name!r}: only an engine op can stream")


class OpRegistry:
    """Ops by name, in the order they were registered."""

    def __init__(self, specs: Iterable[OpSpec] = ()) -> None:
        self._specs: dict[str, OpSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: OpSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"op {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def copy(self) -> OpRegistry:
        return OpRegistry(self._specs.values())

    def get(self, name: str) -> OpSpec | None:
        return self._specs.get(name)

    def __iter__(self) -> Iterator[OpSpec]:
        return iter(self._specs.values())

    def op_flags(self) -> list[str]:
        """Every flag an op carries, once each, in registration order."""
        return list(dict.fromkeys(str(s.capability) for s in self if s.capability is not None))

    def advertised(self, engine_flags: dict[str, bool],
                   disabled: frozenset[str]) -> dict[str, bool]:
        """``hello``'s capabilities: the op flags, the engine's feature flags that are on
        (paged_kv, prefix_cache...: properties, not ops), less the disabled ones, then each
        of ``FEATURES`` whose op flags all made it."""
        op_flags = self.op_flags()
        claimed = sorted(set(op_flags + list(FEATURES)) & set(engine_flags))
        if claimed:
            # Only an op can make its flag true: the failure this table exists to prevent.
            raise ValueError(f"engine feature flags {claimed} name capabilities of ops")
        flags = op_flags + [k for k, on in engine_flags.items() if on]
        advertised = {flag: True for flag in flags if flag not in disabled}
        for feature, needs in FEATURES.items():
            if feature not in disabled and all(need in advertised for need in needs):
                advertised[str(feature)] = True
        return advertised


def _no_args(ctx: OpContext, args: dict[str, Any]) -> None:
    return None  # these ops ignore their arguments


def _checked_by_handler(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any]:
    return args  # its checks walk every token id: they run with the work, on the worker


def _engine(name: str, capability: Capability, parse: Parser,
            handler: Callable[..., Any]) -> OpSpec:
    return OpSpec(name, capability, parse, handler, RunsOn.ENGINE)


STATION_OPS = OpRegistry([
    OpSpec("hello", None, _no_args, inline_ops.hello, RunsOn.INLINE, while_stopping=True),
    OpSpec("health", None, _no_args, inline_ops.health, RunsOn.INLINE, while_stopping=True),
    OpSpec("stats", None, _no_args, inline_ops.stats, RunsOn.INLINE),
    OpSpec("cancel", None, inline_ops.parse_cancel, inline_ops.cancel, RunsOn.INLINE),
    OpSpec("tokenize", None, ops.parse_tokenize, ops.tokenize, RunsOn.WORKER),
    OpSpec("detokenize", None, _checked_by_handler, ops.detokenize, RunsOn.WORKER),
    OpSpec("generate", Capability.GENERATE, ops.parse_generate, GenerateStream, RunsOn.ENGINE,
           streaming=True),
    _engine("kv_session.save", Capability.KV_SESSION, engine_ops.parse_kv_save,
            EngineCalls.kv_save),
    _engine("kv_session.load", Capability.KV_SESSION, engine_ops.parse_session_id,
            EngineCalls.kv_load),
    _engine("kv_session.delete", Capability.KV_SESSION, engine_ops.parse_kv_delete,
            EngineCalls.kv_delete),
    _engine("kv_session.list", Capability.KV_SESSION, engine_ops.parse_kv_list,
            EngineCalls.kv_list),
    _engine("forward", Capability.FORWARD, engine_ops.parse_forward, EngineCalls.forward),
    _engine("decode_next", Capability.DECODE_NEXT, engine_ops.parse_decode_next,
            EngineCalls.decode_next),
    _engine("embed", Capability.EMBED, engine_ops.parse_embed, EngineCalls.embed),
])
