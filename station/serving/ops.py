"""Argument checking and the text ops (tokenize, detokenize) of the station protocol.

Every check raises ``OpError`` with the protocol error code, so the server turns any bad
argument into one error frame and the connection keeps working.

Threads: the checks that cost no more than the frame's own decoding run on the trio thread
(types, ranges, lengths, the size bound below): the ``parse_*`` functions, which the op
registry (``station.serving.op_registry``) names as parsers. Everything that runs the tokenizer or
the chat template (``tokenize``, ``detokenize``, ``encode_prompt``) takes time in
proportion to its input, so the server runs it on a worker thread: a parser that needs it
returns a ``Tokenizing``.

The size bound: ``LoadedModel.max_token_chars`` is the most characters one token can stand
for, so a text longer than ``max_model_len * max_token_chars`` characters cannot fit the
context whatever its tokens: it is refused with ``context_overflow`` before anything
tokenizes it. Chat messages count their roles' and contents' characters (the template
writes both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from gnosis_daemon.protocol import Capability, ErrorCode, OpError
from gnosis_daemon.settings import Settings
from gnosis_daemon.wire import GenerateArgs
from gnosis_daemon.wire.chat import json_chars, messages_chars
from station.core.pins import PinPlan
from station.core.requests import GenerationRequest, SamplingParams
from station.model.loader import LoadedModel
from station.serving.chat import check_messages, check_tools, codec, render_chat
from station.serving.pin_prefix import pin_plans

_MISSING = object()


class OpContext(Protocol):
    """What a parser may read: the station's model, settings and advertised flags."""

    loaded: LoadedModel
    settings: Settings
    capabilities: dict[str, bool]


@dataclass(frozen=True, slots=True)
class Tokenizing:
    """A parser's answer when the checked arguments need the tokenizer first: ``work()``
    runs on a worker thread and returns them (raising ``OpError`` as a parser would). With
    ``finish``, ``work()`` returns what ``finish(result, compiled)`` turns into them once
    ``grammar`` (a checked spec, or None) is compiled (``station.sampling.grammar_compile``:
    in bounded time, off the tokenizer threads)."""

    work: Callable[[], Any]
    grammar: dict[str, Any] | None = None
    finish: Callable[[Any, Any], Any] | None = None


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


def token_list(loaded: LoadedModel, args: dict[str, Any], name: str,
               default: Any = _MISSING) -> list[int]:
    """Token ids: at most ``max_model_len`` of them (checked before anything else, so a
    long list costs nothing), each in ``[0, vocab_size)``."""
    value = arg(args, name, list, default)
    if len(value) > loaded.max_model_len:
        raise _too_many(loaded, name, len(value))
    tokens = int_list({name: value}, name)
    check_token_range(loaded, tokens, name)
    return tokens


def check_prompt_ids(loaded: LoadedModel, tokens: tuple[int, ...], name: str) -> None:
    """Already ints: at most ``max_model_len`` of them, each in ``[0, vocab_size)``."""
    if len(tokens) > loaded.max_model_len:
        raise _too_many(loaded, name, len(tokens))
    check_token_range(loaded, tokens, name)


def _too_many(loaded: LoadedModel, name: str, n: int) -> OpError:
    return OpError(ErrorCode.CONTEXT_OVERFLOW, f"argument {name!r} has {n} tokens, more than "
                   f"max_model_len {loaded.max_model_len}")


def check_token_range(loaded: LoadedModel, tokens: list[int] | tuple[int, ...], name: str) -> None:
    vocab = loaded.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise bad(f"argument {name!r} has token ids outside [0, {vocab})")


# -- the size bound (trio thread: lengths only)
def text_char_limit(loaded: LoadedModel) -> int | None:
    """Characters beyond which no text fits ``max_model_len`` tokens (None: no bound known)."""
    if not loaded.max_token_chars:
        return None
    return loaded.max_model_len * loaded.max_token_chars


def check_text_size(loaded: LoadedModel, chars: int, what: str) -> None:
    limit = text_char_limit(loaded)
    if limit is not None and chars > limit:
        raise OpError(ErrorCode.CONTEXT_OVERFLOW,
                      f"{what} has {chars} characters: at most {loaded.max_token_chars} "
                      f"characters per token, it cannot fit the model's "
                      f"{loaded.max_model_len}-token context ({limit} characters at most)")


def parse_tokenize(ctx: OpContext, args: dict[str, Any]) -> dict[str, Any]:
    """Check a ``tokenize`` (sizes included); ``tokenize`` does the work."""
    has_text, has_messages = "text" in args, "messages" in args
    if has_text == has_messages:
        raise bad("tokenize takes exactly one of 'text' or 'messages'")
    if has_messages:
        messages = check_messages(args["messages"])
        add_gen = arg(args, "add_generation_prompt", bool, True)
        tools = check_tools(args.get("tools"))
        check_text_size(ctx.loaded, messages_chars(messages) + json_chars(tools), "messages")
        return {"messages": messages, "add_generation_prompt": add_gen, "tools": tools}
    text = arg(args, "text", str)
    add_special = arg(args, "add_special_tokens", bool, False)
    check_text_size(ctx.loaded, len(text), "text")
    return {"text": text, "add_special_tokens": add_special}


def tokenize(loaded: LoadedModel, checked: dict[str, Any]) -> dict[str, Any]:
    if "messages" in checked:
        return {"tokens": render_chat(loaded, checked["messages"],
                                      checked["add_generation_prompt"], checked.get("tools"))}
    return {"tokens": codec(loaded).encode(checked["text"], checked["add_special_tokens"])}


def detokenize(loaded: LoadedModel, args: dict[str, Any]) -> dict[str, Any]:
    """Its checks walk every token id, so they run here, with the decoding."""
    tokens = int_list(args, "tokens")
    check_token_range(loaded, tokens, "tokens")
    skip = arg(args, "skip_special_tokens", bool, True)
    return {"text": codec(loaded).decode(tokens, skip)}


# -- generate
@dataclass(frozen=True, slots=True)
class CheckedGenerate:
    """A ``generate`` the station can serve: its wire arguments, every check passed, the
    prompt's token ids, its budget capped by the room the prompt leaves, and its compiled
    grammar (an xgrammar CompiledGrammar, ``station.sampling.grammar``; None without one)."""

    args: GenerateArgs
    prompt_ids: list[int]
    max_tokens: int
    grammar: Any = None
    pins: tuple[PinPlan, ...] = ()  # the prefix each of ``args.sessions.pins`` keeps

    def request(self, request_id: str) -> GenerationRequest:
        """What the engine schedules (``add_request``)."""
        return GenerationRequest(request_id, self.prompt_ids,
                                 SamplingParams.of(self.args.sampling, self.max_tokens),
                                 self.args.sessions, self.args.choices, self.grammar, self.pins)


def check_generate(ctx: OpContext, args: GenerateArgs) -> None:
    """What the wire arguments cannot say alone: token ids against the vocabulary, the
    prompt against the context (tokens) or the size bound (text), and the capabilities
    the arguments need (trio thread: no tokenizer)."""
    loaded = ctx.loaded
    if args.tokens is not None:
        check_prompt_ids(loaded, args.tokens, "tokens")
    elif args.prompt is not None:
        check_text_size(loaded, len(args.prompt), "prompt")
    elif args.messages is not None:
        check_text_size(loaded, messages_chars(args.messages) + json_chars(args.tools), "messages")
    stop_ids = args.sampling.stop_token_ids
    if len(stop_ids) > loaded.vocab_size:
        raise bad(f"argument 'stop_token_ids' has more ids than the vocabulary's {loaded.vocab_size}")
    check_token_range(loaded, stop_ids, "stop_token_ids")
    check_token_range(loaded, [t for t, _ in args.sampling.logit_bias], "logit_bias")
    if args.sessions.asked and Capability.KV_SESSION not in ctx.capabilities:
        raise bad("KV session arguments need capability kv_session, which this station does "
                  "not have")
    if args.grammar is not None and Capability.STRUCTURED_OUTPUT not in ctx.capabilities:
        raise bad("argument 'grammar' needs capability structured_output, which this station "
                  "does not have")


def encode_prompt(loaded: LoadedModel, args: GenerateArgs) -> list[int]:
    """The prompt's token ids (worker thread: the tokenizer or the chat template)."""
    if args.tokens is not None:
        return list(args.tokens)
    if args.messages is not None:
        return render_chat(loaded, list(args.messages), True,
                           None if args.tools is None else list(args.tools))
    assert args.prompt is not None
    return codec(loaded).encode(args.prompt, args.add_special_tokens)


def encode_with_pins(loaded: LoadedModel, args: GenerateArgs,
                     block_size: int) -> tuple[list[int], tuple[PinPlan, ...]]:
    """The prompt's ids and its pins' prefixes (worker thread: both may render the chat)."""
    prompt_ids = encode_prompt(loaded, args)
    return prompt_ids, pin_plans(loaded, args, prompt_ids, block_size)


def ready_generate(loaded: LoadedModel, args: GenerateArgs, budget: int, prompt_ids: list[int],
                   grammar: Any = None, pins: tuple[PinPlan, ...] = ()) -> CheckedGenerate:
    """``args`` with its prompt's ids, compiled grammar and pins' prefixes. Its ``budget``
    (``max_tokens``) is capped by the context left; whether the prompt fits at all is the
    engine's one check (``SequenceLimits``), with the same codes for every op."""
    room = max(1, loaded.max_model_len - len(prompt_ids))
    return CheckedGenerate(args, prompt_ids, min(budget, room), grammar, pins)


def parse_generate(ctx: OpContext, raw: dict[str, Any]) -> CheckedGenerate | Tokenizing:
    """The wire arguments, checked once (``GenerateArgs.from_wire``) and against this
    station (``check_generate``); a prompt given as text is encoded, a grammar compiled, on
    a worker thread."""
    loaded, settings = ctx.loaded, ctx.settings
    args = GenerateArgs.from_wire(raw, grammar_max_nodes=settings.grammar_max_nodes)
    budget = args.token_budget(settings.max_tokens_default)
    check_generate(ctx, args)
    bs = settings.kv_block_size
    if args.tokens is not None and args.grammar is None:  # (a pin needs no template here)
        ids = list(args.tokens)
        return ready_generate(loaded, args, budget, ids, pins=pin_plans(loaded, args, ids, bs))
    # The prompt is encoded on a worker thread; the grammar is compiled after, off it.
    return Tokenizing(lambda: encode_with_pins(loaded, args, bs), args.grammar,
                      lambda encoded, compiled: ready_generate(loaded, args, budget, encoded[0],
                                                               compiled, encoded[1]))
