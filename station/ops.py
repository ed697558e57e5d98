"""Argument checking and the cheap ops (tokenize, detokenize) of the station protocol.

Every check raises ``OpError`` with the protocol error code, so the server turns any bad
argument into one error frame and the connection keeps working. Tokenizer calls here run on
the trio thread: they are cheap, and torch never runs here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gnosis_daemon.protocol import ErrorCode
from gnosis_daemon.settings import Settings
from station.engine_api import SamplingParams
from station.model_loader import LoadedModel

_MISSING = object()


class OpError(Exception):
    """An op cannot be served as asked; ``code`` is the protocol error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def bad(message: str) -> OpError:
    return OpError(ErrorCode.BAD_REQUEST, message)


def arg(args: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = _MISSING,
        *, nullable: bool = False) -> Any:
    """``args[name]`` checked against ``kind`` (bool is never an int/float here)."""
    if name not in args or (args[name] is None and default is not _MISSING and not nullable):
        if default is _MISSING:
            raise bad(f"argument {name!r} is required")
        return default
    value = args[name]
    if value is None and nullable:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise bad(f"argument {name!r} must be {_kind_names(kinds)}, got a bool")
    if not isinstance(value, kinds):
        raise bad(f"argument {name!r} must be {_kind_names(kinds)}, got {type(value).__name__}")
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def int_list(args: dict[str, Any], name: str, default: Any = _MISSING) -> list[int]:
    value = arg(args, name, list, default)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise bad(f"argument {name!r} must be a list of ints")
    return list(value)


def check_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad("argument 'messages' must be a non-empty list of {role, content} maps")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise bad(f"messages[{i}] must be a map with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def render_chat(loaded: LoadedModel, messages: list[dict[str, str]],
                add_generation_prompt: bool) -> list[int]:
    """Chat template -> token ids (rendered to text, then encoded without extra specials,
    since the template already writes every special token it wants)."""
    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad(f"model {loaded.served_id!r} has no chat template; send 'prompt' or 'tokens'")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises its own error types for bad roles/orders
        raise bad(f"chat template rejected the messages: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def tokenize(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
    has_text, has_messages = "text" in args, "messages" in args
    if has_text == has_messages:
        raise bad("tokenize takes exactly one of 'text' or 'messages'")
    if has_messages:
        messages = check_messages(args["messages"])
        add_gen = arg(args, "add_generation_prompt", bool, True)
        return {"tokens": render_chat(loaded, messages, add_gen)}
    text = arg(args, "text", str)
    add_special = arg(args, "add_special_tokens", bool, False)
    return {"tokens": list(loaded.tokenizer.encode(text, add_special_tokens=add_special))}


def detokenize(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
    tokens = int_list(args, "tokens")
    check_token_range(loaded, tokens, "tokens")
    skip = arg(args, "skip_special_tokens", bool, True)
    text = loaded.tokenizer.decode(tokens, skip_special_tokens=skip,
                                   clean_up_tokenization_spaces=False)
    return {"text": text}


def check_token_range(loaded: LoadedModel, tokens: list[int], name: str) -> None:
    vocab = loaded.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise bad(f"argument {name!r} has token ids outside [0, {vocab})")


@dataclass(frozen=True, slots=True)
class GenerateArgs:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    tenant: str
    load_session: str | None
    save_session: str | None
    save_final_session: str | None = None


def parse_generate(loaded: LoadedModel, settings: Settings, args: dict[str, Any]) -> GenerateArgs:
    sources = [k for k in ("tokens", "prompt", "messages") if k in args]
    if len(sources) != 1:
        raise bad("generate takes exactly one of 'tokens', 'prompt' or 'messages'")
    if sources[0] == "tokens":
        prompt_ids = int_list(args, "tokens")
        check_token_range(loaded, prompt_ids, "tokens")
    elif sources[0] == "prompt":
        add_special = arg(args, "add_special_tokens", bool, True)
        prompt_ids = list(loaded.tokenizer.encode(arg(args, "prompt", str),
                                                  add_special_tokens=add_special))
    else:
        prompt_ids = render_chat(loaded, check_messages(args["messages"]), True)
    if not prompt_ids:
        raise bad("the prompt has no tokens")
    room = loaded.max_model_len - len(prompt_ids)
    if room <= 0:
        raise OpError(ErrorCode.CONTEXT_OVERFLOW,
                      f"prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                      f"{loaded.max_model_len}-token context")
    max_tokens = arg(args, "max_tokens", int, settings.max_tokens_default)
    if max_tokens < 1:
        raise bad("argument 'max_tokens' must be at least 1")
    stop = arg(args, "stop", (list, str), [])
    stop = [stop] if isinstance(stop, str) else stop
    if any(not isinstance(s, str) for s in stop):
        raise bad("argument 'stop' must be a string or a list of strings")
    seed = arg(args, "seed", int, None, nullable=True)
    try:
        params = SamplingParams(
            max_tokens=min(max_tokens, room),
            temperature=float(arg(args, "temperature", (int, float), 1.0)),
            top_p=float(arg(args, "top_p", (int, float), 1.0)),
            top_k=arg(args, "top_k", int, 0),
            seed=seed,
            stop_token_ids=tuple(int_list(args, "stop_token_ids", [])),
            ignore_eos=arg(args, "ignore_eos", bool, False),
        )
    except ValueError as exc:
        raise bad(str(exc)) from None
    return GenerateArgs(
        prompt_ids=prompt_ids, params=params, stop=tuple(s for s in stop if s),
        tenant=arg(args, "tenant", str, ""),
        load_session=arg(args, "load_session", str, None, nullable=True),
        save_session=arg(args, "save_session", str, None, nullable=True),
        save_final_session=arg(args, "save_final_session", str, None, nullable=True),
    )
