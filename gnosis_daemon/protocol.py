"""The station wire protocol: msgpack maps over a Unix stream socket.

Torch-free: the station, the host and the supervisor all import it. The exact fields are
documented in docs/protocol.md; this module is the single source of truth for the framing and
the error codes, ``gnosis_daemon.wire`` for ``generate``'s arguments and events.

Request frame::

    {"v": 1, "id": 7, "op": "generate", "args": {...}, "rid": "req-..."}

Reply frames carry the request's ``id``. A streaming op sends zero or more ``event`` frames
and then exactly one final frame, ``result`` or ``error``::

    {"id": 7, "kind": "event",  "data": {...}}
    {"id": 7, "kind": "result", "data": {...}}
    {"id": 7, "kind": "error",  "error": {"code": "bad_request", "message": "...", "retryable": false}}

Large arrays travel as msgpack ``bin`` with dtype and shape beside them (``pack_array``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024


class ErrorCode(enum.StrEnum):
    UNKNOWN_OP = "unknown_op"  # the capability probe's "404"
    BAD_REQUEST = "bad_request"
    NOT_FOUND = "not_found"
    CAPACITY = "capacity"  # retryable: no free KV blocks
    CONTEXT_OVERFLOW = "context_overflow"
    CANCELLED = "cancelled"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


RETRYABLE = frozenset({ErrorCode.CAPACITY, ErrorCode.SHUTTING_DOWN})


class Capability(enum.StrEnum):
    GENERATE = "generate"
    FORWARD = "forward"
    DECODE_NEXT = "decode_next"
    EMBED = "embed"
    KV_SESSION = "kv_session"
    PAGED_KV = "paged_kv"
    PREFIX_CACHE = "prefix_cache"
    CONTINUOUS_BATCHING = "continuous_batching"
    KV_PERSISTENCE = "kv_persistence"
    # generate's match_session: the station loads the tenant's saved session sharing the
    # longest prefix with the prompt (a feature of generate + kv_session, not an op)
    KV_SESSION_MATCH = "kv_session_match"
    # generate's pins: prefixes kept as TTL-pinned sessions, exempt from the budgets while
    # live (a feature of generate + kv_session)
    KV_SESSION_PINS = "kv_session_pins"
    # generate's grammar (structured output, forced tool calls): a feature of generate
    STRUCTURED_OUTPUT = "structured_output"


# Ops that belong to a capability: a station without it answers unknown_op. The station
# serves what its op registry (station/serving/op_registry.py) holds; this is the same mapping for
# the host and supervisor, which import no station code, and a test keeps the two equal.
OP_CAPABILITY: dict[str, Capability] = {
    "generate": Capability.GENERATE,
    "forward": Capability.FORWARD,
    "decode_next": Capability.DECODE_NEXT,
    "embed": Capability.EMBED,
    "kv_session.save": Capability.KV_SESSION,
    "kv_session.load": Capability.KV_SESSION,
    "kv_session.delete": Capability.KV_SESSION,
    "kv_session.list": Capability.KV_SESSION,
}
BASE_OPS = frozenset({"hello", "health", "tokenize", "detokenize", "cancel", "stats"})


class OpError(Exception):
    """The one error type of the station: a request cannot be served as asked.

    ``code`` is the protocol error code the error frame carries. Raised by op parsers,
    the server, the engine and its calls alike, so an error crosses the station unchanged
    from where it is found to the wire.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.value!r}, {self.message!r})"


class ProtocolError(OpError):
    """A frame broke the protocol. ``fatal`` means the byte stream itself is unusable."""

    def __init__(self, code: ErrorCode, message: str, *, request_id: Any = None,
                 fatal: bool = False) -> None:
        super().__init__(code, message)
        self.request_id = request_id
        self.fatal = fatal


@dataclass(frozen=True, slots=True)
class Request:
    id: int | str
    op: str
    args: dict[str, Any]
    rid: str | None = None


def encode(message: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(message, use_bin_type=True)
    return packed


def request_frame(request_id: int | str, op: str, args: dict[str, Any] | None = None,
                  rid: str | None = None) -> bytes:
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": request_id, "op": op, "args": args or {}}
    if rid:
        frame["rid"] = rid
    return encode(frame)


def event_frame(request_id: Any, data: dict[str, Any]) -> bytes:
    return encode({"id": request_id, "kind": "event", "data": data})


def result_frame(request_id: Any, data: dict[str, Any]) -> bytes:
    return encode({"id": request_id, "kind": "result", "data": data})


def error_frame(request_id: Any, code: ErrorCode | str, message: str) -> bytes:
    code = ErrorCode(code)
    return encode({"id": request_id, "kind": "error",
                   "error": {"code": code.value, "message": message,
                             "retryable": code in RETRYABLE}})


class FrameDecoder:
    """Streaming decoder that bounds every frame's size, whatever its shape.

    ``feed`` yields every complete message. Raises a fatal ``ProtocolError`` when the
    bytes cannot be decoded or one frame exceeds ``max_frame_bytes``: the caller answers
    with an error frame and closes that connection only.

    msgpack's unpacker builds arrays and maps progressively and drops the bytes it has
    consumed, so its buffer limit alone bounds only str/bin values: a frame of a huge array
    of small ints would pass. The size of the frame being decoded is therefore counted here:
    the bytes fed since the end of the last complete message (``Unpacker.tell()``). Bytes are
    fed in slices that never take that count past the limit, so the unpacker's own buffer
    (at most the current frame's bytes) never overflows either.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._unpacker = msgpack.Unpacker(
            raw=False, max_buffer_size=max_frame_bytes, strict_map_key=False,
            max_bin_len=max_frame_bytes, max_str_len=max_frame_bytes,
            max_ext_len=max_frame_bytes,
            # Every element takes at least one byte (a map entry two), so a longer container
            # cannot fit a frame; the bound also caps what a container header alone makes
            # the unpacker allocate.
            max_array_len=max_frame_bytes, max_map_len=max_frame_bytes // 2,
        )
        self._fed = 0  # bytes fed so far
        self._frame_start = 0  # stream offset where the frame being decoded begins
        self.last_frame_bytes = 0

    def _too_big(self) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_REQUEST,
                             f"frame exceeds the {self.max_frame_bytes}-byte limit "
                             "(max_frame_bytes)", fatal=True)

    def feed(self, data: bytes) -> Iterator[Any]:
        view = memoryview(data)
        while True:
            room = self.max_frame_bytes - (self._fed - self._frame_start)
            piece, view = view[:room], view[room:]
            if piece:
                try:
                    self._unpacker.feed(piece)
                except msgpack.BufferFull:
                    raise self._too_big() from None
                self._fed += len(piece)
            yield from self._drain()
            if self._fed - self._frame_start >= self.max_frame_bytes:
                raise self._too_big()  # the frame is unfinished and already at the limit
            if not view:
                return

    def _drain(self) -> Iterator[Any]:
        while True:
            try:
                message = next(self._unpacker)
            except StopIteration:
                return
            except msgpack.BufferFull:
                raise self._too_big() from None
            except (msgpack.UnpackException, msgpack.ExtraData, ValueError) as exc:
                if "exceeds max_" in str(exc):  # a container or value longer than a frame holds
                    raise self._too_big() from None
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable frame: {exc}",
                                    fatal=True) from None
            except Exception as exc:  # noqa: BLE001 - no byte sequence may escape as a crash
                # e.g. a map keyed by an array or a map: msgpack builds the key, and the
                # dict refuses it with TypeError (unhashable). The stream cannot be resynced.
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable frame: "
                                    f"{type(exc).__name__}: {exc}", fatal=True) from None
            end = self._unpacker.tell()
            size, self._frame_start = end - self._frame_start, end
            if size > self.max_frame_bytes:
                raise self._too_big()
            self.last_frame_bytes = size  # the size of the message about to be yielded
            yield message


def parse_request(message: Any) -> Request:
    """Validate one decoded message as a request; raise a non-fatal ProtocolError if not."""
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"a frame must be a map, got {type(message).__name__}")
    request_id = message.get("id")
    if not isinstance(request_id, (int, str)) or isinstance(request_id, bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "frame field 'id' must be an int or a string")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"unsupported protocol version {version!r}; this station speaks "
                            f"{PROTOCOL_VERSION}", request_id=request_id)
    op = message.get("op")
    if not isinstance(op, str) or not op:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "frame field 'op' must be a non-empty string",
                            request_id=request_id)
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "frame field 'args' must be a map",
                            request_id=request_id)
    rid = message.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "frame field 'rid' must be a string",
                            request_id=request_id)
    return Request(id=request_id, op=op, args=args, rid=rid)


def pack_array(array: Any) -> dict[str, Any]:
    """A numpy array as {dtype, shape, data(bin)} (C order)."""
    import numpy as np

    array = np.ascontiguousarray(array)
    return {"dtype": str(array.dtype), "shape": list(array.shape), "data": array.tobytes()}


def unpack_array(packed: dict[str, Any]) -> Any:
    import numpy as np

    try:
        dtype = np.dtype(packed["dtype"])
        shape = tuple(int(d) for d in packed["shape"])
        return np.frombuffer(packed["data"], dtype=dtype).reshape(shape)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"bad packed array: {exc}") from None
