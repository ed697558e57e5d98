"""The sampling controls of ``/v1/chat/completions`` and ``/v1/completions`` beyond
temperature and top-p: OpenAI's ``presence_penalty``, ``frequency_penalty`` and
``logit_bias``; vLLM's extensions ``min_p``, ``repetition_penalty``, ``stop_token_ids`` and
``min_tokens``. Each is checked the way OpenAI (or vLLM) bounds it, a bad value raising
``ApiError`` 400 naming the field, and reaches the station's ``generate`` only when it
changes something (a default value adds no argument)."""

from __future__ import annotations

import re
from typing import Any

from gnosis_daemon.wire import BIAS_MAX, MAX_LOGIT_BIAS, PENALTY_MAX
from host import errors
from host.fields import bounded_int, number

# stop_token_ids (vLLM has no bound): enough for any model's special tokens, small in a frame.
MAX_STOP_TOKEN_IDS = 1024
MAX_INT32 = 2**31 - 1
_TOKEN_KEY = re.compile(r"-?[0-9]{1,19}")


def sampling_controls(body: dict[str, Any], args: dict[str, Any], max_tokens: int | None) -> None:
    """Check the controls in ``body`` and put the ones that act into ``args``."""
    for key in ("presence_penalty", "frequency_penalty"):
        value = number(body, key, -PENALTY_MAX, PENALTY_MAX, low_open=False, default=0.0)
        if value:
            args[key] = value
    min_p = number(body, "min_p", 0.0, 1.0, low_open=False, default=0.0)
    if min_p:
        args["min_p"] = min_p
    repetition = number(body, "repetition_penalty", 0.0, float("inf"), low_open=True, default=1.0)
    if repetition != 1.0:
        args["repetition_penalty"] = repetition
    bias = logit_bias(body.get("logit_bias"))
    if bias:
        args["logit_bias"] = bias
    stop_ids = stop_token_ids(body.get("stop_token_ids"))
    if stop_ids:
        args["stop_token_ids"] = stop_ids
    min_tokens = bounded_int(body, "min_tokens", 0, MAX_INT32)
    if min_tokens:
        if max_tokens is not None and min_tokens > max_tokens:
            raise errors.invalid_value("min_tokens", f"must be less than or equal to "
                                       f"max_tokens={max_tokens}, but got {min_tokens}.")
        args["min_tokens"] = min_tokens


def logit_bias(value: Any) -> dict[int, float]:
    """``{"<token id>": bias}`` -> ``{token id: bias}`` (the station's form)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise errors.invalid_type("logit_bias", "an object", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise errors.invalid_value("logit_bias", f"too many entries. Expected at most "
                                   f"{MAX_LOGIT_BIAS}, but got {len(value)} instead.")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not _TOKEN_KEY.fullmatch(key) or not 0 <= int(key) <= MAX_INT32:
            shown = key if len(key) <= 32 else key[:32] + "..."
            raise errors.invalid_value("logit_bias", f"keys must be token ids (non-negative "
                                       f"integers as strings), but got {shown!r}.")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise errors.invalid_type(f"logit_bias.{key}", "a decimal", bias)
        if not -BIAS_MAX <= bias <= BIAS_MAX:
            raise errors.invalid_value("logit_bias", f"the bias of token {key} must be in "
                                       f"[{-BIAS_MAX:g}, {BIAS_MAX:g}], but got {bias}.")
        out[int(key)] = float(bias)
    return out


def stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                          for t in value):
        raise errors.invalid_type("stop_token_ids", "an array of integers", value)
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise errors.invalid_value("stop_token_ids", f"array too long. Expected an array with "
                                   f"maximum length {MAX_STOP_TOKEN_IDS}, but got an array with "
                                   f"length {len(value)} instead.")
    if any(not 0 <= t <= MAX_INT32 for t in value):
        raise errors.invalid_value("stop_token_ids", f"token ids must be integers in "
                                   f"[0, {MAX_INT32}].")
    return list(value)
