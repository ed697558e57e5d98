"""OpenAI request validation (pure: no I/O, no station).

``parse_chat`` / ``parse_completion`` turn a decoded JSON body into a ``CompletionRequest``
whose ``station_args`` are the station's ``generate`` arguments, or raise ``ApiError`` with
OpenAI's error body. The answers are shaped by ``host.formatting``.

Field policy (docs/api.md lists every field):

- implemented fields are validated, ranges included, so every value the station receives is
  one it can take (integers that fit its msgpack frame and its sampler);
- the sampling controls (penalties, ``logit_bias``, vLLM's ``min_p``,
  ``repetition_penalty``, ``stop_token_ids``, ``min_tokens``) are checked in
  ``host.sampling_fields``;
- ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format`` and the tool
  fields of messages are checked in ``host.tool_fields``;
- fields OpenAI defines that would change the answer and are not implemented
  (``functions``, ``suffix``...) are refused with ``unsupported_value`` naming the field,
  unless the value equals the default, which changes nothing;
- fields OpenAI defines that do not change the answer (``metadata``, ``store``,
  ``service_tier``...) are type-checked and have no effect;
- any other field is refused the way OpenAI refuses it ("Unrecognized request argument"),
  so a typo or another server's extension is never silently dropped.
"""

from __future__ import annotations

import functools
import json
import operator
from dataclasses import dataclass, replace
from typing import Any

from gnosis_daemon.wire import MAX_STOP_CHARS, SEED_MIN
from host import errors
from host.fields import (
    as_object,
    bounded_int,
    check_known,
    default_only,
    is_bool,
    is_list,
    is_str,
    is_str_dict,
    is_str_or_dict,
    number,
    present,
    typed,
)
from host.choice_fields import chat_logprobs, choices_n, prompt_list, text_logprobs
from host.sampling_fields import sampling_controls
from host.tool_fields import ToolRequest, message_tool_fields, response_format, tool_request

CHAT = "chat"
TEXT = "text"
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP = 4
# Fields that name a liquid-memory session, first present wins (OpenAI's prompt_cache_key
# and user are such names; session_id is this server's own).
SESSION_FIELDS = ("session_id", "prompt_cache_key", "user")
# The header routers hash to keep a conversation on one replica (vllm-router's
# consistent_hash, HAProxy/nginx hash on it); it names the session when the body does not.
SESSION_HEADER = "X-Session-Id"
# The largest max_tokens / top_k accepted: far past any context, and an int32 everywhere.
MAX_INT32 = 2**31 - 1
# seed is an int64, as in OpenAI's API (the station also takes a uint64); the station folds
# it into its generator's 64 bits.
SEED_MAX = 2**63 - 1
# Token ids before the station's vocab_size is known (the host checks that bound too).
MAX_TOKEN_ID = MAX_INT32

# Fields both endpoints implement.
_SAMPLING = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
    "stream_options", "ignore_eos", "session_id", "prompt_cache_key", "user", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "repetition_penalty",
    "stop_token_ids", "min_tokens", "prompt_cache_retention"})
# vLLM / SGLang extension fields that routers (vllm-router) add to every request they
# forward, at these values: accepted only at them (each would change the answer otherwise).
ROUTER_DEFAULTS = {"no_stop_trim": False, "continue_final_message": False,
                   "skip_special_tokens": True, "separate_reasoning": True,
                   "stream_reasoning": True, "return_hidden_states": False,
                   "include_reasoning": True}
_SAMPLING = _SAMPLING | frozenset(ROUTER_DEFAULTS)
CHAT_FIELDS = _SAMPLING | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
    "function_call", "parallel_tool_calls", "response_format", "prediction", "audio",
    "modalities", "web_search_options", "reasoning_effort", "verbosity", "metadata", "store",
    "service_tier", "safety_identifier"}
TEXT_FIELDS = _SAMPLING | {"prompt", "best_of", "echo", "suffix"}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                            "function_call", "refusal", "audio"})
PART_FIELDS = frozenset({"type", "text"})
STREAM_OPTION_FIELDS = frozenset({"include_usage", "include_obfuscation"})


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    kind: str  # CHAT | TEXT
    model: str | None
    stream: bool
    include_usage: bool
    station_args: dict[str, Any]  # the station's `generate` args
    prompt_param: str  # "messages" | "prompt": where a context overflow is blamed
    # A named liquid-memory session: session_id, else prompt_cache_key, else user.
    session_name: str | None = None
    # Characters of prompt text (message contents, or the completion prompt): the host
    # refuses a prompt that cannot fit the context before the station tokenizes it.
    prompt_chars: int = 0
    tools: ToolRequest | None = None  # tools to render and calls to parse (chat only)
    # Where a grammar the station refuses is blamed (response_format / tool_choice).
    grammar_param: str | None = None
    # Several prompts (/v1/completions): each one's prompt args ({"prompt"} or {"tokens"}),
    # None for one prompt (station_args holds it).
    prompts: tuple[dict[str, Any], ...] | None = None
    echo: bool = False  # /v1/completions: the prompt's text before the completion's
    # prompt_cache_retention: None / "in_memory" (the prompt's KV as any session's) or "24h"
    # (the whole prompt pinned for cache_retention_24h_s: host.retention).
    retention: str | None = None

    def __post_init__(self) -> None:
        assert self.kind in (CHAT, TEXT), self.kind
        assert not self.include_usage or self.stream


def parse_chat(body: Any) -> CompletionRequest:
    body = as_object(body)
    check_known(body, CHAT_FIELDS)
    messages = body.get("messages")
    if messages is None:
        raise errors.missing("messages")
    if not isinstance(messages, list):
        raise errors.invalid_type("messages", "an array", messages)
    if not messages:
        raise errors.invalid_value("messages", "empty array. Expected an array with minimum "
                                   "length 1, but got an empty array instead.")
    args: dict[str, Any] = {"messages": [_message(m, f"messages[{i}]")
                                         for i, m in enumerate(messages)]}
    args.update(chat_logprobs(body))
    default_only(body, "functions", is_list, "an array", lambda v: not v)
    # Without functions (the only way here) "none" and "auto" both mean: answer in text.
    default_only(body, "function_call", is_str_or_dict, "a string or an object",
                  lambda v: v in ("none", "auto"))
    tools = tool_request(body)
    grammar = response_format(body.get("response_format"))
    grammar_param = "response_format" if grammar else None
    if grammar and tools is not None:
        raise errors.invalid_value("response_format", "cannot be combined with tools on this "
                                   "server (send tool_choice 'none', or no tools).")
    if grammar:
        args["grammar"] = grammar
    if tools is not None:
        args["tools"] = tools.tools
        grammar_param = "tool_choice" if tools.forced else None
    default_only(body, "modalities", is_list, "an array", lambda v: v == ["text"])
    for key in ("prediction", "audio", "web_search_options", "reasoning_effort", "verbosity"):
        if present(body, key):
            raise errors.unsupported(key, "is not supported by this server.")
    # OpenAI fields that do not change the answer: checked, then without effect here.
    typed(body, "metadata", is_str_dict, "an object of strings")
    typed(body, "store", is_bool, "a boolean")
    typed(body, "service_tier", is_str, "a string")
    typed(body, "safety_identifier", is_str, "a string")
    max_tokens = bounded_int(body, "max_completion_tokens", 1, MAX_INT32)
    if max_tokens is None:
        max_tokens = bounded_int(body, "max_tokens", 1, MAX_INT32)
    chars = sum(len(m["content"]) + (len(json.dumps(m["tool_calls"])) if m.get("tool_calls") else 0)
                for m in args["messages"]) + (len(json.dumps(tools.tools)) if tools else 0)
    req = _finish(CHAT, body, args, max_tokens, "messages", chars)
    return replace(req, tools=tools, grammar_param=grammar_param)


def parse_completion(body: Any) -> CompletionRequest:
    body = as_object(body)
    check_known(body, TEXT_FIELDS)
    if not present(body, "prompt"):
        raise errors.missing("prompt")
    prompts = prompt_list(body["prompt"])
    args = dict(prompts[0])
    args.update(text_logprobs(body))
    if present(body, "suffix"):
        raise errors.unsupported("suffix", "is not supported by this server.")
    chars = max(len(p.get("prompt", "")) for p in prompts)
    req = _finish(TEXT, body, args, bounded_int(body, "max_tokens", 1, MAX_INT32), "prompt",
                  chars)
    return replace(req, prompts=tuple(prompts) if len(prompts) > 1 else None,
                   echo=bool(body.get("echo")))


def _finish(kind: str, body: dict[str, Any], args: dict[str, Any], max_tokens: int | None,
            prompt_param: str, prompt_chars: int) -> CompletionRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.invalid_type("model", "a string", model)
    for key, default in ROUTER_DEFAULTS.items():
        default_only(body, key, is_bool, "a boolean", functools.partial(operator.is_, default))
    if max_tokens is not None:
        args["max_tokens"] = max_tokens
    # OpenAI's default temperature is 1.0, so an unset temperature samples; 0 is greedy.
    args["temperature"] = number(body, "temperature", 0.0, 2.0, low_open=False, default=1.0)
    args["top_p"] = number(body, "top_p", 0.0, 1.0, low_open=True, default=1.0)
    # vLLM's extension: -1 (vLLM's default) and 0 mean off.
    top_k = bounded_int(body, "top_k", -1, MAX_INT32)
    if top_k is not None and top_k > 0:
        args["top_k"] = top_k
    sampling_controls(body, args, max_tokens)
    n = choices_n(body)
    if n > 1:
        args["n"] = n
    stop = body.get("stop")
    if stop is not None:
        args["stop"] = _stop(stop)
    seed = bounded_int(body, "seed", SEED_MIN, SEED_MAX)
    if seed is not None:
        args["seed"] = seed
    # vLLM's extension: keep decoding past EOS (benchmarks, load drills).
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise errors.invalid_type("ignore_eos", "a boolean", ignore_eos)
        args["ignore_eos"] = ignore_eos
    session_name = None
    for key in SESSION_FIELDS:
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise errors.invalid_type(key, "a string", value)
        session_name = session_name or value or None
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise errors.invalid_type("stream", "a boolean", stream)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise errors.invalid_type("stream_options", "an object", options)
        if not stream:
            raise errors.invalid("The 'stream_options' parameter is only allowed when 'stream' "
                                 "is enabled.", "stream_options", "invalid_value")
        check_known(options, STREAM_OPTION_FIELDS, "stream_options.")
        given = options.get("include_usage")
        if given is not None and not isinstance(given, bool):
            raise errors.invalid_type("stream_options.include_usage", "a boolean", given)
        include_usage = bool(given)
        # OpenAI's padding against length side channels: no effect on the answer.
        typed(options, "include_obfuscation", is_bool, "a boolean", "stream_options.")
    return CompletionRequest(kind, model, stream, include_usage, args, prompt_param, session_name,
                             prompt_chars, retention=check_retention(body))


RETENTIONS = ("in_memory", "24h")


def check_retention(body: dict[str, Any]) -> str | None:
    """``prompt_cache_retention``: null or one of ``RETENTIONS``, else 400 naming it."""
    value = body.get("prompt_cache_retention")
    if value is None:
        return None
    if not isinstance(value, str):
        raise errors.invalid_type("prompt_cache_retention", "a string", value)
    if value not in RETENTIONS:
        raise errors.invalid_value("prompt_cache_retention", f"value must be one of "
                                   f"{', '.join(repr(r) for r in RETENTIONS)}, but got {value!r}.")
    return value


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise errors.invalid_type(where, "an object", message)
    check_known(message, MESSAGE_FIELDS, f"{where}.")
    role = message.get("role")
    if role is None:
        raise errors.missing(f"{where}.role")
    if role not in ROLES:
        raise errors.invalid_value(f"{where}.role", f"value must be one of "
                                   f"{', '.join(repr(r) for r in ROLES)}, but got {role!r}.")
    # Each of these would change what the model reads; the chat template here gets only
    # role, content and the tool fields, so they are refused rather than dropped.
    for key in ("name", "function_call", "refusal", "audio"):
        if present(message, key):
            raise errors.unsupported(f"{where}.{key}", "is not supported by this server.")
    tool_fields = message_tool_fields(message, role, where)
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""  # an assistant turn without content (OpenAI allows null there)
    elif isinstance(content, list):
        content = "".join(_text_part(part, f"{where}.content[{i}]")
                          for i, part in enumerate(content))
    elif content is None:
        raise errors.missing(f"{where}.content")
    elif not isinstance(content, str):
        raise errors.invalid_type(f"{where}.content", "a string or an array of text parts",
                                  content)
    # Chat templates know system/user/assistant/tool; OpenAI's "developer" is the system role.
    return {"role": "system" if role == "developer" else role, "content": content, **tool_fields}


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise errors.invalid_type(where, "an object", part)
    if part.get("type") != "text":
        raise errors.invalid_value(f"{where}.type", f"only 'text' content parts are supported, "
                                   f"but got {part.get('type')!r}.")
    check_known(part, PART_FIELDS, f"{where}.")
    text = part.get("text")
    if not isinstance(text, str):
        raise errors.invalid_type(f"{where}.text", "a string", text)
    return text


def check_token_ids(tokens: list[int], vocab_size: int, param: str) -> list[int]:
    """``tokens`` when every id is in ``[0, vocab_size)``, else ``invalid_value`` on ``param``."""
    low, high = min(tokens), max(tokens)
    if low < 0:
        raise errors.invalid_value(param, f"token ids must be non-negative integers, but got "
                                   f"{low}.")
    if high >= vocab_size:
        raise errors.invalid_value(param, f"token ids must be below the vocabulary size "
                                   f"{vocab_size}, but got {high}.")
    return list(tokens)


# msgpack's own bytes around each message or token id, and a frame's fixed fields, counted
# generously.
ITEM_OVERHEAD = 48
FRAME_OVERHEAD = 64 * 1024


def frame_estimate(texts: list[str], items: int, max_frame_bytes: int) -> int:
    """An upper bound of the bytes ``texts`` and ``items`` maps or ints take in a station
    frame. UTF-8 takes at most 4 bytes a character, so texts are encoded to measure them only
    when that bound comes near ``max_frame_bytes``."""
    size = 4 * sum(len(t) for t in texts)
    if size >= max_frame_bytes // 4:
        size = sum(len(t.encode("utf-8")) for t in texts)
    return size + ITEM_OVERHEAD * items


def _stop(stop: Any) -> list[str]:
    listed = not isinstance(stop, str)
    if not listed:
        stop = [stop] if stop else []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise errors.invalid_type("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP:
        raise errors.invalid_value("stop", f"array too long. Expected an array with maximum "
                                   f"length {MAX_STOP}, but got an array with length "
                                   f"{len(stop)} instead.")
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARS:
            raise errors.invalid_value(f"stop[{i}]" if listed else "stop",
                                       f"string too long. Expected a string with maximum length "
                                       f"{MAX_STOP_CHARS}, but got a string with length "
                                       f"{len(text)} instead.")
    return [s for s in stop if s]


def with_session_header(req: CompletionRequest, header: str | None) -> CompletionRequest:
    """``req`` named by the ``X-Session-Id`` header when no body field names it (the body's
    ``session_id`` / ``prompt_cache_key`` / ``user`` wins: it is the more specific)."""
    if req.session_name is not None or header is None or not header.strip():
        return req
    return replace(req, session_name=header.strip())
