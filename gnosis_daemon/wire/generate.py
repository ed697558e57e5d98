"""``generate``'s arguments: one frozen class per part, each checked once.

``GenerateArgs.from_wire`` reads a decoded ``args`` map (the types: ``bad_request`` naming the
field) and each dataclass's ``__post_init__`` checks its values' ranges, so a value built in
code is held to the same bounds as one read from a frame. ``to_wire`` writes the fields that
differ from their defaults (a default adds nothing to the frame). What needs the model (token
ids against the vocabulary, a prompt against the context) is the station's to check
(``station.serving.ops``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gnosis_daemon.grammar_spec import GrammarSpecError, check_grammar
from gnosis_daemon.wire import read
from gnosis_daemon.wire.bounds import (BIAS_MAX, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                       MAX_STOP_CHARS, MAX_STOP_STRINGS, PENALTY_MAX, SEED_END,
                                       SEED_MIN)
from gnosis_daemon.wire.chat import Message, Tool, check_messages, check_tools
from gnosis_daemon.wire.pins import Pin, pins_from_wire
from gnosis_daemon.wire.read import WireMap, bad

GrammarSpec = dict[str, object]  # checked by gnosis_daemon.grammar_spec
PROMPT_FIELDS = ("tokens", "prompt", "messages")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """The sampling controls. ``presence_penalty`` / ``frequency_penalty`` act on the
    completion's tokens so far (OpenAI); ``repetition_penalty`` on the prompt's and the
    completion's (vLLM: a positive logit is divided by it, a negative one multiplied);
    ``logit_bias``: (token id, bias) pairs added to the logits; ``min_tokens``: the stop ids
    (eos unless ``ignore_eos``, ``stop_token_ids``) are masked until that many tokens."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise bad("argument 'temperature' must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("argument 'top_p' must be in (0, 1]")
        if self.top_k < 0:
            raise bad("argument 'top_k' must be >= 0")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_END:
            raise bad("argument 'seed' must be in [-2**63, 2**64)")
        if not 0 <= self.min_p <= 1:
            raise bad("argument 'min_p' must be in [0, 1]")
        for name, value in (("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty)):
            if not -PENALTY_MAX <= value <= PENALTY_MAX:
                raise bad(f"argument {name!r} must be in [{-PENALTY_MAX:g}, {PENALTY_MAX:g}]")
        if not 0 < self.repetition_penalty < math.inf:
            raise bad("argument 'repetition_penalty' must be a finite number > 0")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"argument 'logit_bias' has {len(self.logit_bias)} entries, more than "
                      f"{MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if not -BIAS_MAX <= bias <= BIAS_MAX:
                raise bad(f"argument 'logit_bias' gives token {token} the bias {bias}: a bias "
                          f"must be in [{-BIAS_MAX:g}, {BIAS_MAX:g}]")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise bad("argument 'logit_bias' names a token twice")
        if self.min_tokens < 0:
            raise bad("argument 'min_tokens' must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Penalties need the sequence's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @classmethod
    def from_wire(cls, args: WireMap) -> Sampling:
        stop_ids = read.int_list(args, "stop_token_ids") or ()
        return cls(
            temperature=read.number(args, "temperature", 1.0),
            top_p=read.number(args, "top_p", 1.0),
            top_k=read.integer(args, "top_k", 0),
            seed=read.optional(args, "seed", int),
            stop_token_ids=stop_ids,
            ignore_eos=read.boolean(args, "ignore_eos", False),
            min_p=read.number(args, "min_p", 0.0),
            presence_penalty=read.number(args, "presence_penalty", 0.0),
            frequency_penalty=read.number(args, "frequency_penalty", 0.0),
            repetition_penalty=read.number(args, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(args),
            min_tokens=read.integer(args, "min_tokens", 0),
        )

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos", "min_p",
                     "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_tokens"):
            value = getattr(self, name)
            if value != getattr(_SAMPLING_DEFAULTS, name):
                out[name] = value
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        return out


def _logit_bias(args: WireMap) -> tuple[tuple[int, float], ...]:
    """A map of token id (an int, or its decimal string as JSON writes keys) to a number."""
    value = read.optional(args, "logit_bias", dict)
    if not value:
        return ()
    if len(value) > MAX_LOGIT_BIAS:  # before walking a long map
        raise bad(f"argument 'logit_bias' has {len(value)} entries, more than {MAX_LOGIT_BIAS}")
    pairs = []
    for key, bias in value.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isascii() and key.lstrip("-").isdigit() and len(key) < 20:
            token = int(key)
        if token is None or isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad("argument 'logit_bias' must map token ids (ints or decimal strings) "
                      "to numbers")
        pairs.append((token, float(bias)))
    return tuple(pairs)


_SAMPLING_DEFAULTS = Sampling()


@dataclass(frozen=True, slots=True, kw_only=True)
class Choices:
    """``n`` choices forked from one prefill; ``logprobs``: top alternatives per sampled
    token, ``prompt_logprobs``: per prompt token (None: not asked)."""

    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise bad(f"argument 'n' must be in [1, {MAX_CHOICES}], got {self.n}")
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(f"argument {name!r} must be in [0, {MAX_LOGPROBS}] or null, got {value}")

    @property
    def asked(self) -> bool:
        """Anything but one choice without logprobs."""
        return self != _CHOICES_DEFAULTS

    @classmethod
    def from_wire(cls, args: WireMap) -> Choices:
        return cls(n=read.integer(args, "n", 1), logprobs=read.optional(args, "logprobs", int),
                   prompt_logprobs=read.optional(args, "prompt_logprobs", int))

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {"n": self.n} if self.n != 1 else {}
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None:
                out[name] = value
        return out


_CHOICES_DEFAULTS = Choices()


@dataclass(frozen=True, slots=True, kw_only=True)
class Sessions:
    """KV sessions: start from one (``load_session``, or with ``match_session`` the
    tenant's saved session sharing the longest prefix), save the prompt's KV when its
    prefill ends (``save_session``) or the prompt and completion's when it ends
    (``save_final_session``), keep prefixes of the prompt as TTL ``pins`` (capability
    ``kv_session_pins``). ``tenant`` isolates the prefix cache and the sessions."""

    tenant: str = ""
    load_session: str | None = None
    match_session: bool = False
    save_session: str | None = None
    save_final_session: str | None = None
    pins: tuple[Pin, ...] = ()

    @property
    def asked(self) -> bool:
        """A session argument is set (capability ``kv_session``)."""
        return bool(self.load_session or self.match_session or self.save_session
                    or self.save_final_session or self.pins)

    @classmethod
    def from_wire(cls, args: WireMap) -> Sessions:
        return cls(tenant=read.text(args, "tenant", ""),
                   load_session=read.optional(args, "load_session", str),
                   match_session=read.boolean(args, "match_session", False),
                   save_session=read.optional(args, "save_session", str),
                   save_final_session=read.optional(args, "save_final_session", str),
                   pins=pins_from_wire(args))

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {"tenant": self.tenant} if self.tenant else {}
        for name in ("load_session", "save_session", "save_final_session"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        if self.match_session:
            out["match_session"] = True
        if self.pins:
            out["pins"] = [pin.to_wire() for pin in self.pins]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateArgs:
    """The ``args`` of a ``generate`` frame (docs/protocol.md lists each field).

    The prompt is exactly one of ``tokens``, ``prompt`` (text; ``add_special_tokens``
    applies) or ``messages`` (with ``tools``, rendered by the chat template). ``max_tokens``
    None: the station's ``max_tokens_default``. ``stop`` strings end the text; empty ones
    are dropped. ``grammar`` constrains the output and takes no ``stop``.
    """

    tokens: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    add_special_tokens: bool = True
    tools: tuple[Tool, ...] | None = None
    grammar: GrammarSpec | None = None
    max_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    choices: Choices = field(default_factory=Choices)
    sessions: Sessions = field(default_factory=Sessions)

    def __post_init__(self) -> None:
        given = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise bad("generate takes exactly one of 'tokens', 'prompt' or 'messages'")
        if self.tools is not None and self.messages is None:
            raise bad("argument 'tools' needs 'messages' (the chat template renders them)")
        if self.messages is None and any(p.messages is not None for p in self.sessions.pins):
            raise bad("argument 'pins' messages needs a 'messages' prompt")
        if self.max_tokens is not None:
            self.token_budget(self.max_tokens)
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise bad(f"argument 'stop' takes at most {MAX_STOP_STRINGS} strings of at most "
                      f"{MAX_STOP_CHARS} characters")
        if self.grammar is not None and self.stop:
            raise bad("argument 'stop' cannot be used with 'grammar': a stop string would end "
                      "the output before the grammar is complete")

    def token_budget(self, default: int) -> int:
        """``max_tokens``, else ``default``: at least 1, and at least ``min_tokens``."""
        budget = default if self.max_tokens is None else self.max_tokens
        if budget < 1:
            raise bad("argument 'max_tokens' must be at least 1")
        if self.sampling.min_tokens > budget:
            raise bad(f"argument 'min_tokens' ({self.sampling.min_tokens}) must be at most "
                      f"max_tokens ({budget})")
        return budget

    @classmethod
    def from_wire(cls, args: WireMap, *,
                  grammar_max_nodes: int | None = None) -> GenerateArgs:
        """``args`` as decoded from a frame; fields it does not name are ignored.
        ``grammar_max_nodes``: the most JSON values a grammar spec may hold."""
        if sum(name in args for name in PROMPT_FIELDS) != 1:
            raise bad("generate takes exactly one of 'tokens', 'prompt' or 'messages'")
        messages = check_messages(args["messages"]) if "messages" in args else None
        tools = check_tools(args.get("tools"))
        stop = args.get("stop", [])
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or any(not isinstance(s, str) for s in stop):
            raise bad("argument 'stop' must be a string or a list of strings")
        return cls(
            tokens=read.int_list(args, "tokens") if "tokens" in args else None,
            prompt=read.required(args, "prompt", str) if "prompt" in args else None,
            messages=tuple(messages) if messages is not None else None,
            add_special_tokens=read.boolean(args, "add_special_tokens", True),
            tools=tuple(tools) if tools is not None else None,
            grammar=_grammar(args, grammar_max_nodes),
            max_tokens=read.optional(args, "max_tokens", int),
            sampling=Sampling.from_wire(args), stop=tuple(s for s in stop if s),
            choices=Choices.from_wire(args), sessions=Sessions.from_wire(args))

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.tokens is not None:
            out["tokens"] = list(self.tokens)
        elif self.prompt is not None:
            out["prompt"] = self.prompt
            if not self.add_special_tokens:
                out["add_special_tokens"] = False
        elif self.messages is not None:
            out["messages"] = list(self.messages)
            if self.tools is not None:
                out["tools"] = list(self.tools)
        if self.grammar is not None:
            out["grammar"] = self.grammar
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.stop:
            out["stop"] = list(self.stop)
        return out | self.sampling.to_wire() | self.choices.to_wire() | self.sessions.to_wire()


def _grammar(args: WireMap, max_nodes: int | None) -> GrammarSpec | None:
    if args.get("grammar") is None:
        return None
    try:
        return check_grammar(args["grammar"], max_nodes)
    except GrammarSpecError as exc:
        raise bad(f"argument 'grammar' {exc}") from None
