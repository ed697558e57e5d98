"""Decode a request body into JSON the rest of the host can trust.

Three things ``json.loads`` lets through would become a 500 later, so they are answered
400 here, naming what is wrong:

- nesting deeper than ``MAX_DEPTH``: the decoder (and any walk of its result) recurses once
  per level, so the depth is measured on the raw bytes first, without recursion;
- a lone UTF-16 surrogate (``"\\ud800"``): JSON allows the escape, Python keeps it in the
  ``str``, and it cannot be encoded as UTF-8 for the station's msgpack frame; the error names
  the field path that holds it;
- ``NaN`` and ``Infinity``: not JSON, and they would slip through every range check.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from host import errors

MAX_DEPTH = 64
# A JSON string, escapes included; written so the regex engine never backtracks.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in ``data`` (brackets inside strings are
    text, not nesting)."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return data.count(b"[") + data.count(b"{")  # an upper bound, and small: done
    brackets = _STRING.sub(b'""', data).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of the first string (or key) holding a lone surrogate, else ``None``.
    Only called on a decoded body, whose depth is at most ``MAX_DEPTH``."""
    if isinstance(value, str):
        return None if value.isascii() or not _SURROGATE.search(value) else (path or "body")
    if isinstance(value, dict):
        for key, item in value.items():
            if not key.isascii() and _SURROGATE.search(key):
                # The key itself is the bad text: name it with the surrogate escaped.
                shown = key.encode("utf-8", "backslashreplace").decode("ascii", "replace")
                return f"{path}.{shown}" if path else shown
            found = lone_surrogate_path(item, f"{path}.{key}" if path else key)
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}[{index}]")
            if found:
                return found
    return None


def decode(data: bytes) -> Any:
    """The JSON value of a request body, or ``ApiError`` 400."""
    depth = nesting_depth(data)
    if depth > MAX_DEPTH:
        raise errors.invalid(f"The JSON body nests arrays and objects {depth} levels deep; "
                             f"at most {MAX_DEPTH} are allowed.")
    try:
        value = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise errors.malformed_json() from None
    path = lone_surrogate_path(value)
    if path is not None:
        raise errors.invalid_value(path, "the text holds a lone UTF-16 surrogate (an unpaired "
                                         "\\ud800-\\udfff escape), which is not valid Unicode.")
    return value
