"""What a ``generate`` streams back: the ``prefill`` and ``tokens`` events, then its result.

The station builds each (``station.serving.stream``) and writes it with ``to_wire``; the
host reads each with ``from_wire``. A field an older station does not send reads as its
default (a station that ignores the session arguments sends no ``saved``: False). A failed
request ends with the protocol's error frame instead (``gnosis_daemon.protocol``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, TypedDict

from gnosis_daemon.wire import read
from gnosis_daemon.wire.pins import PinReport, reports_from_wire
from gnosis_daemon.wire.read import WireMap, bad


class TopLogprob(TypedDict):
    token_id: int
    token: str  # its text, or ``bytes:\xNN...`` when its bytes are not whole UTF-8 characters
    bytes: list[int]
    logprob: float | None  # None: the prompt's first token


class LogprobEntry(TopLogprob):
    """One token's logprob and its most likely alternatives (most likely first)."""

    top_logprobs: list[TopLogprob]


def _entries(data: WireMap, name: str) -> tuple[LogprobEntry, ...] | None:
    value = read.optional(data, name, list)
    if value is None:
        return None
    if any(not isinstance(e, dict) for e in value):
        raise bad(f"event field {name!r} must be a list of logprob maps")
    return tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillReport:
    """What the prompt's prefill did: its tokens, those whose KV was reused, the session
    it started from (or why none) and the save it was asked for."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache or a session
    session_loaded: bool = False
    session_id: str | None = None  # the session the prompt started from, when one was
    session_tokens: int = 0  # of cached_tokens: served by that session
    session_tier: str | None = None  # where that session's KV was: "pool" | "host" | "disk"
    session_error: str | None = None  # why no session was loaded
    saved: bool = False  # save_session pinned the prompt's full blocks
    save_error: str | None = None
    pins: tuple[PinReport, ...] = ()  # one per pin of generate's ``pins``, in order


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillEvent(PrefillReport):
    """The ``prefill`` event: once, when the prompt's prefill ends, before any token."""

    TYPE: ClassVar[str] = "prefill"
    prompt_logprobs: tuple[LogprobEntry, ...] | None = None  # one per prompt token, when asked

    @classmethod
    def of(cls, report: PrefillReport,
           prompt_logprobs: tuple[LogprobEntry, ...] | None = None) -> PrefillEvent:
        return cls(**{f.name: getattr(report, f.name) for f in fields(PrefillReport)},
                   prompt_logprobs=prompt_logprobs)

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {"type": self.TYPE}
        out.update((f.name, getattr(self, f.name)) for f in fields(PrefillReport))
        out["pins"] = [pin.to_wire() for pin in self.pins]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(self.prompt_logprobs)
        return out

    @classmethod
    def from_wire(cls, data: WireMap) -> PrefillEvent:
        return cls(prompt_tokens=read.integer(data, "prompt_tokens", 0),
                   cached_tokens=read.integer(data, "cached_tokens", 0),
                   session_loaded=read.boolean(data, "session_loaded", False),
                   session_id=read.optional(data, "session_id", str),
                   session_tokens=read.integer(data, "session_tokens", 0),
                   session_tier=read.optional(data, "session_tier", str),
                   session_error=read.optional(data, "session_error", str),
                   saved=read.boolean(data, "saved", False),
                   save_error=read.optional(data, "save_error", str),
                   pins=reports_from_wire(data),
                   prompt_logprobs=_entries(data, "prompt_logprobs"))


@dataclass(frozen=True, slots=True, kw_only=True)
class TokensEvent:
    """A ``tokens`` event: the ids one step sampled and the text they completed (never half
    a UTF-8 character; text that may start a stop string waits). A last event with no ids
    may carry the held-back text. ``index``: the choice (sent with ``n > 1`` only)."""

    TYPE: ClassVar[str] = "tokens"
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[LogprobEntry, ...] | None = None  # aligned with token_ids, when asked
    index: int | None = None

    @property
    def choice(self) -> int:
        return self.index or 0

    def to_wire(self) -> dict[str, object]:
        return self.wire(list(self.token_ids), self.text, self.logprobs, self.index)

    @classmethod
    def wire(cls, token_ids: list[int], text: str,
             logprobs: tuple[LogprobEntry, ...] | None = None,
             index: int | None = None) -> dict[str, object]:
        """The event's wire map from its fields, without building the event: the station
        sends one a token a stream, on the trio thread every stream's steps share."""
        out: dict[str, object] = {"type": cls.TYPE, "token_ids": token_ids, "text": text}
        if logprobs is not None:
            out["logprobs"] = list(logprobs)
        if index is not None:
            out["index"] = index
        return out

    @classmethod
    def from_wire(cls, data: WireMap) -> TokensEvent:
        return cls(token_ids=read.int_list(data, "token_ids") or (),
                   text=read.text(data, "text", ""), logprobs=_entries(data, "logprobs"),
                   index=read.optional(data, "index", int))


class OneTokenFrames:
    """One request's ``tokens`` event frames for one token and its text, without logprobs
    or a choice index: ``event_frame(request_id, TokensEvent.wire([token_id], text))``, byte
    for byte, with the part that never changes (the frame's id, kind and the event's type)
    packed once. The station sends one a token a stream: packing only the id and the text
    takes about 0.6 us where the whole map took 2."""

    def __init__(self, request_id: int | str) -> None:
        import msgpack

        # A msgpack map is its size byte, then each key and value in order: the frame
        # {"id", "kind", "data"} whose data {"type", "token_ids", "text"} holds a list of one.
        head = msgpack.Packer(use_bin_type=True)
        self._head = b"".join([b"\x83", head.pack("id"), head.pack(request_id), head.pack("kind"),
                               head.pack("event"), head.pack("data"), b"\x83", head.pack("type"),
                               head.pack(TokensEvent.TYPE), head.pack("token_ids"), b"\x91"])
        self._text_key = head.pack("text")
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def frame(self, token_id: int, text: str) -> bytes:
        pack = self._pack
        frame: bytes = self._head + pack(token_id) + self._text_key + pack(text)
        return frame


GenerateEvent = PrefillEvent | TokensEvent


def event_from_wire(data: WireMap) -> GenerateEvent:
    """A ``generate`` event frame's ``data``, by its ``type``."""
    kind = data.get("type")
    if kind == PrefillEvent.TYPE:
        return PrefillEvent.from_wire(data)
    if kind == TokensEvent.TYPE:
        return TokensEvent.from_wire(data)
    raise bad(f"unknown generate event type {kind!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceResult:
    """How one choice ended: ``stop`` (eos, a stop id or string) or ``length``, its tokens
    (the final eos / stop token included) and text, and its ``save_final_session``."""

    index: int = 0
    finish_reason: str
    completion_tokens: int
    token_ids: tuple[int, ...]
    text: str
    final_saved: bool = False
    final_save_error: str | None = None

    def to_wire(self) -> dict[str, object]:
        return {"finish_reason": self.finish_reason, "completion_tokens": self.completion_tokens,
                "token_ids": list(self.token_ids), "text": self.text,
                "final_saved": self.final_saved, "final_save_error": self.final_save_error}

    @classmethod
    def from_wire(cls, data: WireMap) -> ChoiceResult:
        return cls(index=read.integer(data, "index", 0),
                   finish_reason=read.text(data, "finish_reason", ""),
                   completion_tokens=read.integer(data, "completion_tokens", 0),
                   token_ids=read.int_list(data, "token_ids") or (),
                   text=read.text(data, "text", ""),
                   final_saved=read.boolean(data, "final_saved", False),
                   final_save_error=read.optional(data, "final_save_error", str))


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateResult:
    """The final frame of a ``generate``. With ``n > 1`` the top-level fields are choice 0's
    except ``completion_tokens`` (every choice's), and ``choices`` holds each one."""

    first: ChoiceResult  # choice 0 (its completion_tokens: its own)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    ttft_ms: float | None = None  # from arrival to the first sampled token
    decode_tokens_per_s: float | None = None  # the tokens after the first, over their time
    choices: tuple[ChoiceResult, ...] | None = None  # n > 1 only

    @property
    def finish_reason(self) -> str:
        return self.first.finish_reason

    @property
    def each(self) -> tuple[ChoiceResult, ...]:
        """Every choice, in index order."""
        return self.choices if self.choices is not None else (self.first,)

    def to_wire(self) -> dict[str, object]:
        out = self.first.to_wire() | {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens, "ttft_ms": self.ttft_ms,
            "decode_tokens_per_s": self.decode_tokens_per_s}
        if self.choices is not None:
            out["choices"] = [{"index": c.index, **c.to_wire()} for c in self.choices]
        return out

    @classmethod
    def from_wire(cls, data: WireMap) -> GenerateResult:
        choices = read.optional(data, "choices", list)
        if choices is not None and any(not isinstance(c, dict) for c in choices):
            raise bad("result field 'choices' must be a list of maps")
        each = None if choices is None else tuple(
            sorted((ChoiceResult.from_wire(c) for c in choices), key=lambda c: c.index))
        ttft, rate = data.get("ttft_ms"), data.get("decode_tokens_per_s")
        return cls(
            first=each[0] if each else ChoiceResult.from_wire(data),
            prompt_tokens=read.integer(data, "prompt_tokens", 0),
            completion_tokens=read.integer(data, "completion_tokens", 0),
            cached_tokens=read.integer(data, "cached_tokens", 0),
            ttft_ms=None if ttft is None else read.number(data, "ttft_ms", 0.0),
            decode_tokens_per_s=None if rate is None else read.number(
                data, "decode_tokens_per_s", 0.0),
            choices=each)
