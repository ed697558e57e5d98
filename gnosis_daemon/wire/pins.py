"""TTL pins: ``generate``'s ``pins`` argument and what the ``prefill`` event reports of each.

A pin names a prefix of the prompt (the whole prompt, or the chat-template rendering of its
first ``messages`` messages and ``parts`` content parts, or the first ``chars`` characters of
the content, of the next) that the station keeps as
a KV session of the tenant until ``ttl_s`` passes without a hit: the budgets that evict
ordinary sessions do not drop it. The host builds these from Anthropic's ``cache_control``
breakpoints and OpenAI's ``prompt_cache_retention``; the station honours them
(docs/protocol.md, "KV sessions"). Torch-free: both sides import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gnosis_daemon.protocol import OpError
from gnosis_daemon.wire import read
from gnosis_daemon.wire.bounds import MAX_PINS, PIN_TTL_MAX_S
from gnosis_daemon.wire.read import WireMap, bad


@dataclass(frozen=True, slots=True, kw_only=True)
class Pin:
    """One pin. ``messages`` None: the prefix is the whole prompt; else (a ``messages``
    prompt only) the rendering of the first ``messages`` messages, then ``parts`` content
    parts of message[``messages``] (or, with ``chars``, that message with its content cut to
    its first ``chars`` characters: a breakpoint inside a message), without a generation
    prompt."""

    session_id: str
    ttl_s: float
    messages: int | None = None
    parts: int | None = None
    chars: int | None = None

    def __post_init__(self) -> None:
        if not self.session_id:
            raise bad("argument 'pins' needs a non-empty 'session_id' in each pin")
        if not 0 < self.ttl_s <= PIN_TTL_MAX_S or math.isnan(self.ttl_s):
            raise bad(f"argument 'pins' ttl_s must be in (0, {PIN_TTL_MAX_S}], "
                      f"got {self.ttl_s!r}")
        for name, value in (("messages", self.messages), ("parts", self.parts),
                            ("chars", self.chars)):
            if value is not None and value < 0:
                raise bad(f"argument 'pins' {name} must be >= 0, got {value}")
        if (self.parts or self.chars is not None) and self.messages is None:
            raise bad("argument 'pins' parts and chars need messages (they cut message[messages])")
        if self.parts and self.chars is not None:
            raise bad("argument 'pins' takes parts or chars, not both")

    @classmethod
    def from_wire(cls, value: object) -> Pin:
        if not isinstance(value, dict):
            raise bad("argument 'pins' must be a list of maps")
        session_id = _named(lambda: read.optional(value, "session_id", str))
        if session_id is None:
            raise bad("argument 'pins' needs a 'session_id' in each pin")
        if value.get("ttl_s") is None:
            raise bad("argument 'pins' needs a 'ttl_s' in each pin")
        return cls(session_id=session_id,
                   ttl_s=_named(lambda: read.number(value, "ttl_s", 0.0)),
                   messages=_named(lambda: read.optional(value, "messages", int)),
                   parts=_named(lambda: read.optional(value, "parts", int)),
                   chars=_named(lambda: read.optional(value, "chars", int)))

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {"session_id": self.session_id, "ttl_s": self.ttl_s}
        if self.messages is not None:
            out["messages"] = self.messages
        if self.parts is not None:
            out["parts"] = self.parts
        if self.chars is not None:
            out["chars"] = self.chars
        return out


T = TypeVar("T")


def _named(reading: Callable[[], T]) -> T:
    """A pin field's own refusal says which argument holds it: 'pins'."""
    try:
        return reading()
    except OpError as exc:
        raise bad(f"argument 'pins': {exc.message}") from None


def pins_from_wire(args: WireMap) -> tuple[Pin, ...]:
    """``generate``'s ``pins``: absent or null is none; at most ``MAX_PINS``."""
    value = read.optional(args, "pins", list)
    if not value:
        return ()
    if len(value) > MAX_PINS:
        raise bad(f"argument 'pins' has {len(value)} pins, more than {MAX_PINS}")
    pins = tuple(Pin.from_wire(v) for v in value)
    if len({p.session_id for p in pins}) != len(pins):
        raise bad("argument 'pins' names a session_id twice")
    return pins


@dataclass(frozen=True, slots=True, kw_only=True)
class PinReport:
    """What became of one pin when the prefill ended. ``num_tokens``: the prefix's tokens
    (whole KV blocks); ``read_tokens``: of those, the tokens whose KV this request took from
    a live pinned session of the tenant; ``pinned`` False: saved as an ordinary session
    (``reason`` "pin_budget") or not saved (``reason`` says why)."""

    session_id: str
    num_tokens: int
    read_tokens: int
    ttl_s: float
    expires_at: float | None  # unix seconds, while pinned
    pinned: bool
    reason: str | None = None

    def to_wire(self) -> dict[str, object]:
        return {"session_id": self.session_id, "num_tokens": self.num_tokens,
                "read_tokens": self.read_tokens, "ttl_s": self.ttl_s,
                "expires_at": self.expires_at, "pinned": self.pinned, "reason": self.reason}

    @classmethod
    def from_wire(cls, data: object) -> PinReport:
        if not isinstance(data, dict):
            raise bad("event field 'pins' must be a list of maps")
        expires = data.get("expires_at")
        return cls(session_id=read.text(data, "session_id", ""),
                   num_tokens=read.integer(data, "num_tokens", 0),
                   read_tokens=read.integer(data, "read_tokens", 0),
                   ttl_s=read.number(data, "ttl_s", 0.0),
                   expires_at=None if expires is None else read.number(data, "expires_at", 0.0),
                   pinned=read.boolean(data, "pinned", False),
                   reason=read.optional(data, "reason", str))


def reports_from_wire(data: WireMap) -> tuple[PinReport, ...]:
    value = read.optional(data, "pins", list)
    return tuple(PinReport.from_wire(v) for v in value or ())
