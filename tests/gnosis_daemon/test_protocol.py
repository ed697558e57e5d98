from __future__ import annotations

import msgpack
import numpy as np
import pytest

from gnosis_daemon import protocol
from gnosis_daemon.protocol import ErrorCode, FrameDecoder, ProtocolError, parse_request


def test_frames_round_trip_through_decoder_in_pieces():
    payload = (protocol.request_frame(1, "hello") + protocol.request_frame("a", "tokenize", {"text": "hi"}, rid="r1"))
    decoder = FrameDecoder(1024)
    out = []
    for i in range(len(payload)):  # byte at a time: the stream may split anywhere
        out.extend(decoder.feed(payload[i:i + 1]))
    assert [parse_request(m) for m in out] == [
        protocol.Request(id=1, op="hello", args={}, rid=None),
        protocol.Request(id="a", op="tokenize", args={"text": "hi"}, rid="r1"),
    ]


def test_error_frame_marks_retryable_codes():
    frame = msgpack.unpackb(protocol.error_frame(3, ErrorCode.CAPACITY, "no free blocks"))
    assert frame == {"id": 3, "kind": "error",
                     "error": {"code": "capacity", "message": "no free blocks", "retryable": True}}
    frame = msgpack.unpackb(protocol.error_frame(None, "bad_request", "x"))
    assert frame["error"]["retryable"] is False and frame["id"] is None


def test_oversized_frame_is_fatal():
    decoder = FrameDecoder(64)
    with pytest.raises(ProtocolError) as info:
        list(decoder.feed(protocol.encode({"v": 1, "id": 1, "op": "x", "args": {"t": "a" * 200}})))
    assert info.value.fatal and info.value.code == ErrorCode.BAD_REQUEST


def test_undecodable_bytes_are_fatal():
    decoder = FrameDecoder(1024)
    with pytest.raises(ProtocolError) as info:
        list(decoder.feed(b"\xc1\xc1\xc1"))
    assert info.value.fatal


@pytest.mark.parametrize("data", [b"\x81\x91\x01\x01", b"\x81\x81\x01\x01\x01"],
                         ids=["array-key", "map-key"])
def test_a_map_key_that_cannot_be_hashed_is_fatal_not_a_crash(data):
    decoder = FrameDecoder(1024)
    with pytest.raises(ProtocolError) as info:
        list(decoder.feed(data))
    assert info.value.fatal and "unhashable" in info.value.message


@pytest.mark.parametrize(
    ("message", "needle", "request_id"),
    [
        ([1, 2, 3], "must be a map", None),
        ({"v": 1, "op": "hello"}, "'id'", None),
        ({"v": 1, "id": True, "op": "hello"}, "'id'", None),
        ({"v": 2, "id": 4, "op": "hello"}, "protocol version", 4),
        ({"v": 1, "id": 5, "op": ""}, "'op'", 5),
        ({"v": 1, "id": 6, "op": "hello", "args": [1]}, "'args'", 6),
        ({"v": 1, "id": 7, "op": "hello", "rid": 9}, "'rid'", 7),
    ],
)
def test_bad_requests_are_not_fatal_and_keep_their_id(message, needle, request_id):
    with pytest.raises(ProtocolError) as info:
        parse_request(message)
    assert needle in info.value.message
    assert not info.value.fatal
    assert info.value.request_id == request_id


def test_arrays_travel_as_bin_with_dtype_and_shape():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    packed = msgpack.unpackb(protocol.encode(protocol.pack_array(array)))
    assert packed["dtype"] == "float32" and packed["shape"] == [3, 4]
    assert isinstance(packed["data"], bytes)
    np.testing.assert_array_equal(protocol.unpack_array(packed), array)
    with pytest.raises(ProtocolError):
        protocol.unpack_array({"dtype": "float32", "shape": [5], "data": b"\0" * 4})


def test_every_capability_op_names_a_known_capability():
    assert set(protocol.OP_CAPABILITY.values()) <= set(protocol.Capability)
    assert not (set(protocol.OP_CAPABILITY) & protocol.BASE_OPS)


async def test_client_errors_are_not_wrapped_in_exception_groups(tmp_path):
    """A station that answers hello with an error frame: the caller sees StationError itself."""
    import trio

    from gnosis_daemon.client import StationError, StationUnavailable, open_station_client

    path = str(tmp_path / "s.sock")
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(path)
    listener.listen()

    async def fake_station():
        sock, _ = await listener.accept()
        decoder = FrameDecoder(1024)
        while True:
            data = await sock.recv(4096)
            if not data:
                return
            for message in decoder.feed(data):
                request = parse_request(message)
                await sock.send(protocol.error_frame(request.id, ErrorCode.INTERNAL, "boom"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake_station)
        with pytest.raises(StationError) as info:
            async with open_station_client(path):
                pass
        assert info.value.code == "internal" and info.value.message == "boom"
        with pytest.raises(StationUnavailable):
            async with open_station_client(str(tmp_path / "missing.sock")):
                pass
        nursery.cancel_scope.cancel()


def test_an_oversized_array_frame_is_fatal_before_it_is_all_read():
    """Arrays and maps are decoded progressively, so the unpacker's buffer never fills: the
    decoder counts the frame's bytes itself (a list of 5-byte ints, as large as it likes)."""
    decoder = FrameDecoder(1024)
    frame = protocol.request_frame(1, "generate", {"tokens": [70_000] * 1000})
    assert len(frame) > 5000
    fed = 0
    with pytest.raises(ProtocolError) as info:
        for i in range(0, len(frame), 100):
            fed += 100
            list(decoder.feed(frame[i:i + 100]))
    assert info.value.fatal and info.value.code == ErrorCode.BAD_REQUEST
    assert "1024-byte limit" in info.value.message
    assert fed <= 1100  # refused as soon as the frame passed the limit, not at its end


def test_frame_limit_is_exact_and_counts_each_frame_alone():
    def frame_of(size: int) -> bytes:
        base = protocol.request_frame(1, "x", {"t": []})
        frame = protocol.request_frame(1, "x", {"t": [1] * (size - len(base) - 2)})
        assert len(frame) == size
        return frame

    at_limit = frame_of(1024)
    # Many frames in one read, more bytes than the limit in all: each is judged alone.
    out = list(FrameDecoder(1024).feed(at_limit * 5))
    assert out == [msgpack.unpackb(at_limit)] * 5
    with pytest.raises(ProtocolError) as info:
        list(FrameDecoder(1024).feed(at_limit + frame_of(1025)))
    assert "1024-byte limit" in info.value.message


def test_container_headers_longer_than_a_frame_are_refused():
    decoder = FrameDecoder(1024)
    # An array header that claims 2**31 elements: refused from the header alone.
    with pytest.raises(ProtocolError) as info:
        list(decoder.feed(b"\xdd\x80\x00\x00\x00"))
    assert info.value.fatal and "1024-byte limit" in info.value.message
