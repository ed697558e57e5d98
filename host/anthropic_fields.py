"""Checks of one field of an Anthropic Messages request (``host.anthropic_api``): types,
ranges, unknown names and ``cache_control``. Each raises ``ApiError`` 400 whose message
starts with the field's path (``messages.0.content.1.type: ...``), as Anthropic's
validation errors do."""

from __future__ import annotations

from typing import Any

from gnosis_daemon.wire import MAX_STOP_CHARS, MAX_STOP_STRINGS
from host import errors
from host.errors import ApiError

MAX_INT32 = 2**31 - 1
TTLS = ("5m", "1h")  # cache_control ttl classes, longest first is the only order allowed
CACHE_FIELDS = frozenset({"type", "ttl"})


def bad(path: str, problem: str) -> ApiError:
    """Anthropic's 400: the message names the field first, as its validation errors do."""
    return ApiError(400, f"{path}: {problem}", errors.INVALID_REQUEST, path)


def cache_control(value: Any, where: str) -> str | None:
    """A block's ``cache_control``: its TTL class, None when the block has none."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad(where, "Input should be a valid dictionary")
    for key in value:
        if key not in CACHE_FIELDS:
            raise bad(f"{where}.{key}"[:128], "Extra inputs are not permitted")
    if value.get("type") != "ephemeral":
        raise bad(f"{where}.type", f"Input should be 'ephemeral', but got {value.get('type')!r}")
    ttl = value.get("ttl", "5m")
    if ttl not in TTLS:
        raise bad(f"{where}.ttl", f"Input should be '5m' or '1h', but got {ttl!r}")
    return str(ttl)


def user_id(metadata: Any) -> str | None:
    """``metadata.user_id`` names the liquid-memory session, as OpenAI's ``user`` does."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise bad("metadata", "Input should be a valid dictionary")
    known(metadata, {"user_id"}, "metadata")
    return string(metadata, "user_id", "metadata") or None


def stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad("stop_sequences", "Input should be a valid list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise bad("stop_sequences", f"at most {MAX_STOP_STRINGS} stop sequences are "
                  f"accepted, but got {len(value)}.")
    for i, text in enumerate(value):
        if not text:
            raise bad(f"stop_sequences.{i}", "a stop sequence must not be empty.")
        if len(text) > MAX_STOP_CHARS:
            raise bad(f"stop_sequences.{i}", f"at most {MAX_STOP_CHARS} characters, but got "
                      f"{len(text)}.")
    return tuple(value)


def known(obj: dict[str, Any], allowed: Any, where: str) -> None:
    """Refuse a key ``allowed`` lacks; a null one is absent (a client's dump of a block)."""
    for key, value in obj.items():
        if key not in allowed and value is not None:
            raise bad(f"{where}.{key}"[:128], "Extra inputs are not permitted")


def string(obj: dict[str, Any], key: str, where: str, *, required: bool = False) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise bad(f"{where}.{key}", "Field required")
        return None
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", "Input should be a valid string")
    return value


def integer(body: dict[str, Any], key: str, low: int, *, required: bool = False) -> int | None:
    value = body.get(key)
    if value is None:
        if required:
            raise bad(key, "Field required")
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(key, "Input should be a valid integer")
    if not low <= value <= MAX_INT32:
        raise bad(key, f"Input should be between {low} and {MAX_INT32}, but got {value}")
    return value


def number(body: dict[str, Any], key: str, low: float, high: float, default: float, *,
            low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad(key, "Input should be a valid number")
    if value < low or (low_open and value == low) or value > high:
        bound = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
        raise bad(key, f"Input should be {bound}, but got {value}")
    return float(value)
