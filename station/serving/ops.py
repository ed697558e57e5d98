"""Argument checking and the text ops (tokenize, detokenize) of the station protocol.

Every check raises ``OpError`` with the protocol error code, so the server turns any bad
argument into one error frame and the connection keeps working.

Threads: the checks that cost no more than the frame's own decoding run on the trio thread
(types, ranges, lengths, the size bound below): the ``parse_*`` functions, which the op
registry (``station.serving.op_registry``) names as parsers. Everything that runs the tokenizer or
the chat template (``tokenize``, ``detokenize``, ``GeneratePlan.encode``) takes time in
proportion to its input, so the server runs it on a worker thread: a parser that needs it
returns a ``Tokenizing``.

The size bound: ``LoadedModel.max_token_chars`` is the most characters one token can stand
for, so a text longer than ``max_model_len * max_token_chars`` characters cannot fit the
context whatever its tokens: it is refused with ``context_overflow`` before anything
tokenizes it. Chat messages count their roles' and contents' characters (the template
writes both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

from gnosis_daemon.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, Capability, ErrorCode, OpError
from gnosis_daemon.settings import Settings
from gnosis_daemon.grammar_spec import GrammarSpecError, check_grammar
from station.core.requests import MAX_LOGIT_BIAS, SamplingParams

MAX_CHOICES = 16  # generate's n (station.engine.forks)
MAX_LOGPROBS = 20  # top alternatives per token (station.sampling.logprobs)
from station.model.loader import LoadedModel
from station.serving.chat import (check_messages, check_tools, codec, json_chars, messages_chars,
                                  render_chat)

_MISSING = object()
# The range of a seed: an int64 or a uint64 (what msgpack carries); the generator takes
# its 64 bits, so a negative seed is the same as that seed plus 2**64.
SEED_MIN, SEED_END = -(2**63), 2**64


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


def number(args: dict[str, Any], name: str, default: float) -> float:
    """A finite int or float argument, as a float (NaN or infinity would poison sampling)."""
    value = float(arg(args, name, (int, float), default))
    if not math.isfinite(value):
        raise bad(f"argument {name!r} must be a finite number")
    return value


def seed_arg(args: dict[str, Any], name: str = "seed") -> int | None:
    seed = arg(args, name, int, None, nullable=True)
    if seed is not None and not SEED_MIN <= seed < SEED_END:
        raise bad(f"argument {name!r} must be in [-2**63, 2**64)")
    return seed


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
        raise OpError(ErrorCode.CONTEXT_OVERFLOW, f"argument {name!r} has {len(value)} tokens, "
                      f"more than max_model_len {loaded.max_model_len}")
    tokens = int_list({name: value}, name)
    check_token_range(loaded, tokens, name)
    return tokens


def check_token_range(loaded: LoadedModel, tokens: list[int], name: str) -> None:
    vocab = loaded.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise bad(f"argument {name!r} has token ids outside [0, {vocab})")


def logit_bias_arg(loaded: LoadedModel, args: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: a map of token id (an int, or its decimal string as JSON writes it)
    to a finite bias in [-100, 100], at most ``MAX_LOGIT_BIAS`` entries."""
    value = arg(args, "logit_bias", dict, {})
    if len(value) > MAX_LOGIT_BIAS:
        raise bad(f"argument 'logit_bias' has {len(value)} entries, more than {MAX_LOGIT_BIAS}")
    pairs = []
    for key, bias in value.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isascii() and key.lstrip("-").isdigit() and len(key) < 20:
            token = int(key)
        if token is None or bias is None:
            raise bad("argument 'logit_bias' must map token ids (ints or decimal strings) "
                      "to numbers")
        pairs.append((token, number({"logit_bias": bias}, "logit_bias", 0.0)))
    check_token_range(loaded, [t for t, _ in pairs], "logit_bias")
    if len({t for t, _ in pairs}) != len(pairs):
        raise bad("argument 'logit_bias' names a token twice")
    return tuple(pairs)


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
class GenerateArgs:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    tenant: str
    load_session: str | None
    match_session: bool
    save_session: str | None
    save_final_session: str | None = None
    grammar: Any = None  # an xgrammar CompiledGrammar (station.sampling.grammar)
    choices: dict[str, Any] | None = None  # n, logprobs, prompt_logprobs (choices_args)


@dataclass(frozen=True, slots=True)
class GeneratePlan:
    """A checked ``generate`` whose prompt may still be text to encode (``encode``, on a
    worker thread); ``finish`` turns it into ``GenerateArgs`` once the ids are known."""

    prompt_ids: list[int] | None  # given as tokens
    prompt: str | None
    add_special_tokens: bool
    messages: list[dict[str, str]] | None
    max_tokens: int
    params: SamplingParams  # max_tokens=1 until ``finish`` caps it by the prompt's room
    stop: tuple[str, ...]
    tenant: str
    load_session: str | None
    match_session: bool
    save_session: str | None
    save_final_session: str | None
    tools: list[dict[str, Any]] | None = None
    grammar: dict[str, Any] | None = None  # checked (gnosis_daemon.grammar_spec), not compiled
    choices: dict[str, Any] | None = None  # n, logprobs, prompt_logprobs (choices_args)

    @property
    def needs_encoding(self) -> bool:
        """Work for a worker thread: a prompt to encode, or a grammar to compile."""
        return self.prompt_ids is None or self.grammar is not None

    def encode(self, loaded: LoadedModel) -> list[int]:
        if self.prompt_ids is not None:
            return self.prompt_ids
        if self.messages is not None:
            return render_chat(loaded, self.messages, True, self.tools)
        assert self.prompt is not None
        return codec(loaded).encode(self.prompt, self.add_special_tokens)

    def finish(self, loaded: LoadedModel, prompt_ids: list[int], grammar: Any = None) -> GenerateArgs:
        """``grammar``: the compiled ``self.grammar`` (None without one)."""
        # max_tokens is capped by the context left; whether the prompt fits at all is the
        # engine's one check (SequenceLimits), with the same codes for every op.
        room = max(1, loaded.max_model_len - len(prompt_ids))
        return GenerateArgs(
            prompt_ids=prompt_ids, params=replace(self.params, max_tokens=min(self.max_tokens, room)),
            stop=self.stop, tenant=self.tenant, load_session=self.load_session,
            match_session=self.match_session,
            save_session=self.save_session, save_final_session=self.save_final_session,
            grammar=grammar, choices=self.choices)


def plan_generate(loaded: LoadedModel, settings: Settings, args: dict[str, Any]) -> GeneratePlan:
    """Every check of ``generate`` that needs no tokenizer (trio thread)."""
    sources = [k for k in ("tokens", "prompt", "messages") if k in args]
    if len(sources) != 1:
        raise bad("generate takes exactly one of 'tokens', 'prompt' or 'messages'")
    prompt_ids = prompt = messages = tools = None
    add_special = True
    if sources[0] == "tokens":
        prompt_ids = token_list(loaded, args, "tokens")
    elif sources[0] == "prompt":
        add_special = arg(args, "add_special_tokens", bool, True)
        prompt = arg(args, "prompt", str)
        check_text_size(loaded, len(prompt), "prompt")
    else:
        messages = check_messages(args["messages"])
        tools = check_tools(args.get("tools"))
        check_text_size(loaded, messages_chars(messages) + json_chars(tools), "messages")
    if args.get("tools") is not None and messages is None:
        raise bad("argument 'tools' needs 'messages' (the chat template renders them)")
    max_tokens = arg(args, "max_tokens", int, settings.max_tokens_default)
    if max_tokens < 1:
        raise bad("argument 'max_tokens' must be at least 1")
    stop = arg(args, "stop", (list, str), [])
    stop = [stop] if isinstance(stop, str) else stop
    if any(not isinstance(s, str) for s in stop):
        raise bad("argument 'stop' must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"argument 'stop' takes at most {MAX_STOP_STRINGS} strings of at most "
                  f"{MAX_STOP_CHARS} characters")
    stop_ids = arg(args, "stop_token_ids", list, [])
    if len(stop_ids) > loaded.vocab_size:
        raise bad(f"argument 'stop_token_ids' has more ids than the vocabulary's {loaded.vocab_size}")
    stop_ids = int_list({"stop_token_ids": stop_ids}, "stop_token_ids")
    check_token_range(loaded, stop_ids, "stop_token_ids")
    try:
        params = SamplingParams(
            max_tokens=1,
            temperature=number(args, "temperature", 1.0),
            top_p=number(args, "top_p", 1.0),
            top_k=arg(args, "top_k", int, 0),
            seed=seed_arg(args),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=arg(args, "ignore_eos", bool, False),
            min_p=number(args, "min_p", 0.0),
            presence_penalty=number(args, "presence_penalty", 0.0),
            frequency_penalty=number(args, "frequency_penalty", 0.0),
            repetition_penalty=number(args, "repetition_penalty", 1.0),
            logit_bias=logit_bias_arg(loaded, args),
            min_tokens=arg(args, "min_tokens", int, 0),
        )
    except ValueError as exc:
        raise bad(f"argument {exc}") from None
    if params.min_tokens > max_tokens:
        raise bad(f"argument 'min_tokens' ({params.min_tokens}) must be at most max_tokens "
                  f"({max_tokens})")
    return GeneratePlan(
        prompt_ids=prompt_ids, prompt=prompt, add_special_tokens=add_special, messages=messages,
        max_tokens=max_tokens, params=params, stop=tuple(s for s in stop if s),
        tenant=arg(args, "tenant", str, ""),
        load_session=arg(args, "load_session", str, None, nullable=True),
        match_session=arg(args, "match_session", bool, False),
        save_session=arg(args, "save_session", str, None, nullable=True),
        save_final_session=arg(args, "save_final_session", str, None, nullable=True),
        tools=tools, grammar=grammar_arg(args, settings.grammar_max_nodes, stop),
        choices=choices_args(args),
    )


def choices_args(args: dict[str, Any]) -> dict[str, Any] | None:
    """``n`` (1 to 16 choices), ``logprobs`` / ``prompt_logprobs`` (0 to 20 top
    alternatives, null: none); None when all are defaults."""
    n = arg(args, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"argument 'n' must be in [1, {MAX_CHOICES}], got {n}")
    out = {"n": n}
    for name in ("logprobs", "prompt_logprobs"):
        value = arg(args, name, int, None, nullable=True)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad(f"argument {name!r} must be in [0, {MAX_LOGPROBS}] or null, got {value}")
        out[name] = value
    return out if n > 1 or out["logprobs"] is not None or out["prompt_logprobs"] is not None else None


def grammar_arg(args: dict[str, Any], max_nodes: int | None = None,
                stop: list[str] | tuple[str, ...] = ()) -> dict[str, Any] | None:
    """``grammar``: None, or a spec ``gnosis_daemon.grammar_spec.check_grammar`` accepts
    holding at most ``max_nodes`` JSON values. A grammar with stop strings is refused: a
    stop string would end the output before the grammar is complete."""
    if args.get("grammar") is None:
        return None
    try:
        spec = check_grammar(args["grammar"], max_nodes)
    except GrammarSpecError as exc:
        raise bad(f"argument 'grammar' {exc}") from None
    if any(stop):
        raise bad("argument 'stop' cannot be used with 'grammar': a stop string would end "
                  "the output before the grammar is complete")
    return spec


def parse_generate(ctx: OpContext, args: dict[str, Any]) -> GenerateArgs | Tokenizing:
    """``plan_generate``; a prompt given as text is encoded, a grammar compiled, on a
    worker thread."""
    loaded = ctx.loaded
    plan = plan_generate(loaded, ctx.settings, args)
    if ((plan.load_session or plan.match_session or plan.save_session or plan.save_final_session)
            and Capability.KV_SESSION not in ctx.capabilities):
        raise bad("KV session arguments need capability kv_session, which this station does "
                  "not have")
    if plan.grammar is not None and Capability.STRUCTURED_OUTPUT not in ctx.capabilities:
        raise bad("argument 'grammar' needs capability structured_output, which this station "
                  "does not have")
    if not plan.needs_encoding:
        assert plan.prompt_ids is not None
        return plan.finish(loaded, plan.prompt_ids)
    # The prompt is encoded on a worker thread; the grammar is compiled after, off it.
    return Tokenizing(lambda: plan.encode(loaded), plan.grammar,
                      lambda ids, compiled: plan.finish(loaded, ids, compiled))
