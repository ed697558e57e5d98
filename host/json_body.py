"""Decode a request body into JSON the rest of the host can trust.

Three things ``json.loads`` lets through (or raises on) would become a 500 later, so they are
answered 400 here, naming what is wrong:

- nesting deeper than ``MAX_DEPTH``: the C decoder raises ``RecursionError`` past the
  interpreter's recursion limit, and anything shallower is measured on the decoded value
  with an explicit stack, so no walk of the body ever recurses deeper than ``MAX_DEPTH``.
  (Counting brackets on the raw bytes needs the strings skipped, and every pattern that
  skips JSON strings rescans to the end from each quote of an unterminated one: quadratic
  in the body, minutes of a frozen event loop for one 1 MB body.);
- a lone UTF-16 surrogate (``"\\ud800"``): JSON allows the escape, Python keeps it in the
  ``str``, and it cannot be encoded as UTF-8 for the station's msgpack frame; the error names
  the field path that holds it;
- ``NaN`` and ``Infinity``: not JSON, and they would slip through every range check.
"""

from __future__ import annotations

import json
import re
from typing import Any

from host import errors

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def nesting_depth(value: Any) -> int:
    """The deepest nesting of arrays and objects in a decoded value (0 for a scalar),
    measured with an explicit stack, in one pass over the containers."""
    deepest = 0
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return deepest


def _too_deep(depth: str) -> errors.ApiError:
    return errors.invalid(f"The JSON body nests arrays and objects {depth} levels deep; at "
                          f"most {MAX_DEPTH} are allowed.")


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
    try:
        value = json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep("more than a thousand") from None
    except (ValueError, UnicodeDecodeError):
        raise errors.malformed_json() from None
    depth = nesting_depth(value)
    if depth > MAX_DEPTH:
        raise _too_deep(str(depth))
    path = lone_surrogate_path(value)
    if path is not None:
        raise errors.invalid_value(path, "the text holds a lone UTF-16 surrogate (an unpaired "
                                         "\\ud800-\\udfff escape), which is not valid Unicode.")
    return value
