"""Hypothesis strategies for the station's socket protocol.

Two kinds of input:

- **frames** that msgpack can encode: requests with random ops (known and not) and random
  arguments of random types (huge ints, NaN and infinities, bytes, nested maps and arrays,
  ext types), broken envelopes (wrong ``v``, ``id`` of every type, ``args`` that is not a
  map) and messages that are not maps at all. Each has an expected reply id: the frame's
  ``id`` when it is an int or a string, else ``None``.
- **undecodable bytes**: byte strings built by hand that no valid frame starts with, or that
  declare or carry more than ``max_frame_bytes``: the reserved byte 0xc1, strings that are
  not UTF-8, map keys that are arrays or maps, malformed timestamps, nesting deeper than the
  unpacker's stack, container headers past the limit, a string past it. Each may follow a few valid frames of ops
  the station answers inline, so the answers to those come first.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
from hypothesis import strategies as st

from tests.fuzz.conftest import MAX_FRAME_BYTES

KNOWN_OPS = ("hello", "health", "stats", "tokenize", "detokenize", "cancel", "generate",
             "forward", "decode_next", "embed", "kv_session.save", "kv_session.load",
             "kv_session.delete", "kv_session.list")
# Ops answered on the trio thread before the next frame is decoded (answers keep their order).
INLINE_OPS = ("hello", "health", "stats")
ARG_NAMES = ("tokens", "prompt", "messages", "text", "texts", "max_tokens", "temperature", "top_p",
             "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "tenant", "load_session",
             "save_session", "save_final_session", "add_special_tokens", "add_generation_prompt",
             "skip_special_tokens", "target", "session_id", "prefix_len", "seq_id", "release",
             "include_tokens", "role", "content", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logit_bias", "min_tokens", "grammar", "tools", "pins",
             "match_session", "forget", "all")
INT_EDGES = (0, 1, -1, 258, 259, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -2**63)
FLOAT_EDGES = (math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 1e-300)


def ints() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-2, 300), st.sampled_from(INT_EDGES), st.integers(-2**63, 2**64 - 1))


LEAVES = st.one_of(
    st.none(), st.booleans(), ints(), st.floats(), st.sampled_from(FLOAT_EDGES),
    st.text(max_size=16), st.sampled_from(("", "<|im_end|>", "\x00", "🦀", "user", "x" * 200)),
    st.binary(max_size=16),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**32), st.integers(0, 999_999_999)),
)
KEYS = st.one_of(st.text(max_size=8), st.integers(-5, 5), st.none(), st.booleans(),
                 st.binary(max_size=4), st.floats(allow_nan=False))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)), max_leaves=10)


def token_lists() -> st.SearchStrategy[list[Any]]:
    return st.lists(st.one_of(st.integers(0, 258), ints()), max_size=24)


def _plausible(name: str) -> st.SearchStrategy[Any]:
    """A value of the right shape for argument ``name`` (valid or nearly)."""
    if name in ("tokens", "stop_token_ids"):
        return token_lists()
    if name in ("texts",):
        return st.lists(st.text(max_size=20), max_size=4)
    if name == "messages":
        return st.lists(st.fixed_dictionaries({"role": st.sampled_from(("user", "system", "x")),
                                               "content": st.text(max_size=20)}), max_size=3)
    if name in ("prompt", "text", "tenant", "load_session", "save_session", "save_final_session",
                "session_id", "seq_id"):
        return st.one_of(st.text(max_size=20), st.sampled_from(("fuzz-session", "")))
    if name == "logit_bias":
        return st.dictionaries(st.one_of(st.integers(-1, 300), st.text(max_size=4)),
                               st.one_of(st.floats(-101, 101), ints()), max_size=4)
    if name == "grammar":
        return st.one_of(
            st.sampled_from(({"type": "json_object"}, {"type": "regex", "regex": "[ab]{1,3}"},
                             {"type": "ebnf", "ebnf": "root ::= ("}, {"type": "json_schema"})),
            st.fixed_dictionaries({"type": st.sampled_from(("json_schema", "structural_tag")),
                                   "schema": VALUES, "structural_tag": VALUES}),
            st.builds(lambda schema: {"type": "json_schema", "schema": schema},
                      st.dictionaries(st.sampled_from(("type", "enum", "not", "items", "$ref",
                                                       "properties", "format")), VALUES,
                                      max_size=3)))
    if name == "pins":
        return st.lists(st.one_of(VALUES, st.fixed_dictionaries(
            {"session_id": st.one_of(st.text(max_size=8), st.sampled_from(("fuzz-pin", ""))),
             "ttl_s": st.one_of(st.floats(-1, 3e6), st.sampled_from(FLOAT_EDGES), ints())},
            optional={"messages": st.one_of(st.integers(-1, 4), ints()),
                      "parts": st.one_of(st.integers(-1, 2), ints())})), max_size=9)
    if name == "tools":
        return st.lists(st.one_of(VALUES, st.builds(
            lambda name, params: {"type": "function",
                                  "function": {"name": name, "parameters": params}},
            st.text(max_size=6), VALUES)), max_size=2)
    if name in ("max_tokens", "top_k", "prefix_len", "target", "seed", "min_tokens"):
        return st.one_of(st.integers(-1, 8), ints())
    if name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):
        return st.one_of(st.floats(0, 2), st.sampled_from(FLOAT_EDGES), ints())
    return st.booleans()


@st.composite
def args_maps(draw: st.DrawFn) -> dict[Any, Any]:
    names = draw(st.lists(st.sampled_from(ARG_NAMES), max_size=5, unique=True))
    args: dict[Any, Any] = {n: draw(st.one_of(_plausible(n), _plausible(n), VALUES)) for n in names}
    if draw(st.integers(0, 4)) == 0:
        args.update(draw(st.dictionaries(KEYS, VALUES, max_size=3)))
    return args


@dataclass
class Frame:
    message: Any
    expected_id: Any  # the id every reply to it carries (None: the frame had no usable id)
    op: Any = None

    @property
    def payload(self) -> bytes:
        return msgpack.packb(self.message, use_bin_type=True)

    def describe(self, limit: int = 300) -> str:
        return repr(self.message)[:limit]


def _usable_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


@st.composite
def frames(draw: st.DrawFn, request_id: int) -> Frame:
    """One frame; a well-formed envelope carries ``request_id`` (unique on its connection)."""
    shape = draw(st.integers(0, 19))
    if shape == 0:  # not a map
        return Frame(draw(st.one_of(LEAVES, st.lists(VALUES, max_size=3))), None)
    op = draw(st.one_of(st.sampled_from(KNOWN_OPS), st.sampled_from(KNOWN_OPS),
                        st.sampled_from(("", "HELLO", "kv_session.", "generate ", "__init__")),
                        st.text(max_size=12), VALUES))
    message: dict[Any, Any] = {"v": 1, "id": request_id, "op": op, "args": draw(args_maps())}
    if shape == 1:
        message["v"] = draw(st.one_of(st.sampled_from((0, 2, "1", None, 1.5)), VALUES))
    elif shape == 2:
        message["id"] = draw(st.one_of(st.sampled_from((None, True, 1.0, b"1", [1], {"a": 1})),
                                       st.text(max_size=8).map(lambda t: f"s{request_id}{t}"),
                                       st.sampled_from((2**64 - 1 - request_id, -2**63 + request_id))))
    elif shape == 3:
        message["args"] = draw(VALUES)
    elif shape == 4:
        message["rid"] = draw(VALUES)
    elif shape == 5:
        del message[draw(st.sampled_from(("v", "id", "op", "args")))]
    elif shape == 6:
        message.update(draw(st.dictionaries(KEYS, VALUES, max_size=3)))
    expected = message.get("id") if _usable_id(message.get("id")) else None
    return Frame(message, expected, op)


def _str_header(n: int) -> bytes:
    return b"\xdb" + struct.pack(">I", n)


def _frame_with_args_bytes(raw_args: bytes) -> bytes:
    """A hello frame whose args value is ``raw_args`` (raw msgpack bytes)."""
    head = msgpack.packb({"v": 1, "id": 7, "op": "hello"}, use_bin_type=True)
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("args") + raw_args


UNDECODABLE = (
    ("reserved byte 0xc1", b"\xc1"),
    ("str that is not UTF-8", b"\xa3\xff\xfe\xfd"),
    ("args key not UTF-8", _frame_with_args_bytes(b"\x81\xa2\xc3\x28\x01")),
    ("map key is an array", b"\x81\x91\x01\x01"),
    ("map key is a map", b"\x81\x80\x01"),
    ("args map key is an array", _frame_with_args_bytes(b"\x81\x92\x01\x02\xc0")),
    ("timestamp of 2 bytes", b"\xd5\xff\x00\x00"),
    ("array nested past the stack", b"\x91" * 5000 + b"\x01"),
    ("map nested past the stack", b"\x81\xa1k" * 5000 + b"\x01"),
    ("str longer than a frame", _str_header(MAX_FRAME_BYTES + 1) + b"s" * (MAX_FRAME_BYTES + 1)),
    ("array of 2^32-1 elements", b"\xdd\xff\xff\xff\xff"),
    ("map of 2^32-1 entries", b"\xdf\xff\xff\xff\xff"),
)


@dataclass
class BadBytes:
    prefix: list[Frame]  # valid inline frames sent first, in the same write
    name: str
    payload: bytes

    def describe(self) -> str:
        shown = self.payload[:24].hex(" ")
        return (f"{len(self.prefix)} valid frame(s), then {self.name}: {shown}"
                f"{' ...' if len(self.payload) > 24 else ''} ({len(self.payload)} bytes)")


@st.composite
def bad_bytes(draw: st.DrawFn) -> BadBytes:
    name, payload = draw(st.sampled_from(UNDECODABLE))
    prefix = [Frame({"v": 1, "id": i, "op": draw(st.sampled_from(INLINE_OPS)), "args": {}}, i)
              for i in range(draw(st.integers(0, 2)))]
    return BadBytes(prefix, name, payload + draw(st.binary(max_size=8)))


def oversized_array() -> bytes:
    """A complete, well-formed frame one array of small ints past ``max_frame_bytes``."""
    count = MAX_FRAME_BYTES + 1
    return b"\x84" + msgpack.packb("v") + b"\x01" + msgpack.packb("id") + b"\x01" + \
        msgpack.packb("op") + msgpack.packb("tokenize") + msgpack.packb("args") + b"\x81" + \
        msgpack.packb("tokens") + b"\xdd" + struct.pack(">I", count) + b"\x01" * count
