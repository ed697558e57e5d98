"""The request fields of choices and logprobs: ``n`` (and ``best_of``), chat's ``logprobs`` /
``top_logprobs``, completions' ``logprobs`` / ``echo``, and several prompts in one
``/v1/completions`` request. Checked the way OpenAI bounds them (``ApiError`` 400 naming
the field), turned into the station's ``generate`` arguments: ``n``, ``logprobs`` (top
alternatives per sampled token), ``prompt_logprobs`` (the same for the prompt: echo)."""

from __future__ import annotations

from typing import Any

from gnosis_daemon.wire import MAX_CHOICES, MAX_LOGPROBS
from host import errors
from host.fields import is_int, present

# n: choices per prompt, MAX_CHOICES; chat's top_logprobs and completions' logprobs (OpenAI
# takes 5 there, vLLM 20), MAX_LOGPROBS: the station's bounds.
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_INT32 = 2**31 - 1


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_int(value):
        raise errors.invalid_type(key, "an integer", value)
    if not low <= value <= high:
        raise errors.invalid_value(key, f"must be in [{low}, {high}], but got {value}.")
    return value


def choices_n(body: dict[str, Any]) -> int:
    """``n`` in [1, 16]; ``best_of`` (completions) only equal to it (no server-side ranking)."""
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    best_of = body.get("best_of")
    if best_of is not None:
        if not is_int(best_of):
            raise errors.invalid_type("best_of", "an integer", best_of)
        if best_of != n:
            raise errors.unsupported("best_of", f"must equal n ({n}) on this server, but got "
                                     f"{best_of}.")
    return n


def chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise errors.invalid_type("logprobs", "a boolean", logprobs)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not logprobs:  # 0 without logprobs is the default: it changes nothing
        raise errors.invalid_value("top_logprobs", "requires 'logprobs' to be true.")
    return {"logprobs": top or 0} if logprobs else {}


def text_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise errors.invalid_type("echo", "a boolean", echo)
    if present(body, "logprobs") and isinstance(body["logprobs"], bool):
        raise errors.invalid_type("logprobs", "an integer", body["logprobs"])
    k = _int(body, "logprobs", 0, MAX_LOGPROBS)
    if k is None:
        return {}
    return {"logprobs": k, **({"prompt_logprobs": k} if echo else {})}


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def _tokens(ids: list[int], param: str) -> dict[str, Any]:
    low, high = min(ids), max(ids)
    if low < 0:
        raise errors.invalid_value(param, f"token ids must be non-negative integers, but got "
                                   f"{low}.")
    if high > MAX_INT32:
        raise errors.invalid_value(param, f"token ids must be below the vocabulary size "
                                   f"{MAX_INT32 + 1}, but got {high}.")
    return {"tokens": list(ids)}


def prompt_list(prompt: Any) -> list[dict[str, Any]]:
    """``prompt``: a string, token ids, or a list of either -> each prompt's args."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if _token_ids(prompt):
        return [_tokens(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and not any(is_int(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise errors.invalid_value("prompt", f"array too long. Expected at most "
                                       f"{MAX_PROMPTS} prompts, but got {len(prompt)}.")
        out = []
        for i, item in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                out.append({"prompt": item})
            elif _token_ids(item):
                out.append(_tokens(item, where))
            else:
                raise errors.invalid_type(where, "a string or an array of token ids", item)
        return out
    raise errors.invalid_type("prompt", "a string, an array of strings, an array of token "
                              "ids, or an array of arrays of token ids", prompt)
