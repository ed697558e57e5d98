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
- ``NaN`` and ``Infinity``: not JSON, and they would slip through every range check;
- an integer outside what a msgpack frame carries (-2**63 .. 2**64 - 1), anywhere in the
  body (a schema's ``minimum``, ``const``, ``enum`` or ``default``, a tool call's
  arguments): packing it for the station raised ``OverflowError``, a 500; the error names
  the field path that holds it.
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


# What a msgpack frame can carry: a signed or an unsigned 64-bit integer.
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 64 - 1


def _unfit(value: Any) -> str | None:
    """Why a scalar cannot travel to the station, or None."""
    if isinstance(value, str):
        if not value.isascii() and _SURROGATE.search(value):
            return ("the text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                    "escape), which is not valid Unicode.")
    elif isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        return (f"the integer has {value.bit_length()} bits; at most 64-bit integers "
                f"({INT_MIN} to {INT_MAX}) are accepted.")
    return None


def unfit_path(value: Any, path: str = "") -> tuple[str, str] | None:
    """(the path, why) of the first value (or key) the station's frames cannot carry: a
    string with a lone surrogate or an integer past 64 bits; else ``None``. Only called on
    a decoded body, whose depth is at most ``MAX_DEPTH``."""
    if isinstance(value, dict):
        for key, item in value.items():
            if why := _unfit(key):
                # The key itself is the bad text: name it with the surrogate escaped.
                shown = key.encode("utf-8", "backslashreplace").decode("ascii", "replace")
                return (f"{path}.{shown}" if path else shown), why
            found = unfit_path(item, f"{path}.{key}" if path else key)
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = unfit_path(item, f"{path}[{index}]")
            if found:
                return found
    elif why := _unfit(value):
        return path or "body", why
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
    unfit = unfit_path(value)
    if unfit is not None:
        raise errors.invalid_value(*unfit)
    return value
