"""Typed reads of one field of a decoded wire map, each refusal a ``bad_request`` naming it.

``bool`` is never an ``int`` or a ``float`` here (msgpack keeps them apart, Python does not).
An absent field and a null one read as the default, unless the field is nullable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from gnosis_daemon.protocol import ErrorCode, OpError

WireMap = Mapping[str, object]  # a decoded msgpack map
T = TypeVar("T")


def bad(message: str) -> OpError:
    return OpError(ErrorCode.BAD_REQUEST, message)


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def checked(name: str, value: object, kinds: tuple[type, ...]) -> object:
    """``value`` when it is one of ``kinds``; the refusal names ``name``."""
    if isinstance(value, bool) and bool not in kinds:
        raise bad(f"argument {name!r} must be {_names(kinds)}, got a bool")
    if not isinstance(value, kinds):
        raise bad(f"argument {name!r} must be {_names(kinds)}, got {type(value).__name__}")
    return value


def required(args: WireMap, name: str, kind: type[T]) -> T:
    if args.get(name) is None:
        raise bad(f"argument {name!r} is required")
    value = checked(name, args[name], (kind,))
    assert isinstance(value, kind)
    return value


def optional(args: WireMap, name: str, kind: type[T]) -> T | None:
    """The field, or None when absent or null."""
    value = args.get(name)
    if value is None:
        return None
    value = checked(name, value, (kind,))
    assert isinstance(value, kind)
    return value


def boolean(args: WireMap, name: str, default: bool) -> bool:
    value = optional(args, name, bool)
    return default if value is None else value


def integer(args: WireMap, name: str, default: int) -> int:
    value = optional(args, name, int)
    return default if value is None else value


def text(args: WireMap, name: str, default: str) -> str:
    value = optional(args, name, str)
    return default if value is None else value


def number(args: WireMap, name: str, default: float) -> float:
    """An int or a float, as a float (its range is its dataclass's to check)."""
    value = args.get(name)
    if value is None:
        return default
    value = checked(name, value, (int, float))
    assert isinstance(value, (int, float))
    return float(value)


def int_list(args: WireMap, name: str) -> tuple[int, ...] | None:
    """A list of ints, or None when absent or null."""
    value = optional(args, name, list)
    if value is None:
        return None
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise bad(f"argument {name!r} must be a list of ints")
    return tuple(value)
