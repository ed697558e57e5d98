"""Parsing the host's /health answer: hypercorn keeps the connection open after
``Connection: close``, so the probe must know when a response is complete."""

from __future__ import annotations

import pytest

from supervisor.probes import ProbeFailed, connect_address, parse_response, response_complete

HEAD = b"HTTP/1.1 503 \r\ncontent-type: application/json\r\ncontent-length: 16\r\n\r\n"


def test_content_length_decides_completeness():
    assert not response_complete(HEAD[:-2])
    assert not response_complete(HEAD + b'{"status":')
    assert response_complete(HEAD + b'{"status":"bad"}')
    assert parse_response(HEAD + b'{"status":"bad"}') == (503, {"status": "bad"})


def test_chunked_body():
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\n{\"a\":\r\n2\r\n1}\r\n0\r\n\r\n")
    assert response_complete(raw)
    assert parse_response(raw) == (200, {"a": 1})


def test_non_json_body_and_garbage():
    raw = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 3\r\n\r\nbad"
    assert parse_response(raw) == (502, {})
    with pytest.raises(ProbeFailed, match="not an HTTP response"):
        parse_response(b"SSH-2.0-OpenSSH\r\n\r\n")
    with pytest.raises(ProbeFailed, match="incomplete"):
        parse_response(b"HTTP/1.1 200 OK\r\n")


@pytest.mark.parametrize("bind, expected", [("0.0.0.0", "127.0.0.1"), ("::", "::1"),
                                            ("127.0.0.1", "127.0.0.1"), ("[::1]", "::1")])
def test_wildcard_binds_are_reached_on_loopback(bind, expected):
    assert connect_address(bind) == expected
