"""Checks of one JSON field of an OpenAI request: types, ranges, unknown names, and fields
accepted only at their default value. Each raises ``ApiError`` 400 naming the field."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from host import errors

_ECHO_MAX = 64  # characters of a refused field's name quoted back


def as_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise errors.invalid(f"The request body must be a JSON object, but got "
                             f"{errors._json_type(body)} instead.")
    return body


def check_known(obj: dict[str, Any], allowed: Iterable[str], prefix: str = "") -> None:
    """Refuse the first field that is not in ``allowed``, the way OpenAI does."""
    allowed = frozenset(allowed)
    for key in obj:
        if key not in allowed:
            raise unrecognized(prefix + key)


def unrecognized(name: str) -> errors.ApiError:
    shown = name if len(name) <= _ECHO_MAX else name[:_ECHO_MAX] + "..."
    return errors.invalid(f"Unrecognized request argument supplied: {shown}", shown,
                          "unknown_parameter")


def default_only(body: dict[str, Any], key: str, type_ok: Callable[[Any], bool],
                  expected: str, is_default: Callable[[Any], bool], prefix: str = "") -> None:
    """A field this server does not implement: accepted only when null or its default."""
    value = body.get(key)
    if value is None:
        return
    if not type_ok(value):
        raise errors.invalid_type(prefix + key, expected, value)
    if not is_default(value):
        raise errors.unsupported(prefix + key, "is not supported by this server (only its "
                                 "default value is accepted).")


def typed(body: dict[str, Any], key: str, type_ok: Callable[[Any], bool], expected: str,
           prefix: str = "") -> None:
    value = body.get(key)
    if value is not None and not type_ok(value):
        raise errors.invalid_type(prefix + key, expected, value)


def present(body: dict[str, Any], key: str) -> bool:
    return body.get(key) is not None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_list(value: Any) -> bool:
    return isinstance(value, list)


def is_dict(value: Any) -> bool:
    return isinstance(value, dict)


def is_str_or_dict(value: Any) -> bool:
    return isinstance(value, (str, dict))


def is_str_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def bounded_int(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_int(value):
        raise errors.invalid_type(key, "an integer", value)
    if value < low:
        raise errors.invalid_value(key, f"integer below minimum value. Expected a value >= "
                                   f"{low}, but got {value} instead.")
    if value > high:
        raise errors.invalid_value(key, f"integer above maximum value. Expected a value <= "
                                   f"{high}, but got {value} instead.")
    return value


def number(body: dict[str, Any], key: str, low: float, high: float, *, low_open: bool,
            default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.invalid_type(key, "a decimal", value)
    if value < low or (low_open and value == low):
        bound = ">" if low_open else ">="
        raise errors.invalid_value(key, f"decimal below minimum value. Expected a value "
                                   f"{bound} {low:g}, but got {value} instead.")
    if value > high:
        raise errors.invalid_value(key, f"decimal above maximum value. Expected a value <= "
                                   f"{high:g}, but got {value} instead.")
    return float(value)
