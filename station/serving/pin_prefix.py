"""How many of a prompt's tokens each of generate's ``pins`` keeps (the tokenizer's thread).

A pin without ``messages`` keeps the whole prompt, as ``save_session`` does. A pin with
``messages`` (a chat prompt) keeps the prefix the chat template writes for the first
``messages`` messages, then, when ``parts`` > 0, message[``messages``] cut to its first
``parts`` content parts (a string content is one part: it is kept whole), or with ``chars``
that message with its content cut to its first ``chars`` characters (a breakpoint inside a
message), with the request's ``tools`` and no generation prompt. That rendering is tokenized, its longest
common token prefix with the prompt taken and rounded down to whole KV blocks: a template
that ends a turn with other tokens than the next turn begins with still shares everything
before them. ``messages: 0, parts: 0`` is the tools and template preamble alone.

A pin that cannot be computed is not an error of the request: its ``PinPlan`` carries the
reason, which the prefill event reports (``station.engine.pinning``).
"""

from __future__ import annotations

from gnosis_daemon.protocol import OpError
from gnosis_daemon.tokens import common_prefix_len
from gnosis_daemon.wire import GenerateArgs, Pin
from station.core.pins import PinPlan, no_block
from station.model.loader import LoadedModel
from station.serving.chat import render_chat


def pin_plans(loaded: LoadedModel, args: GenerateArgs, prompt_ids: list[int],
              block_size: int) -> tuple[PinPlan, ...]:
    """One plan per pin of ``args``, in order."""
    return tuple(_plan(loaded, args, pin, prompt_ids, block_size) for pin in args.sessions.pins)


def _plan(loaded: LoadedModel, args: GenerateArgs, pin: Pin, prompt_ids: list[int],
          block_size: int) -> PinPlan:
    if pin.messages is None:
        n = len(prompt_ids)
    else:
        messages = list(args.messages or ())
        parts = pin.parts or 0
        within = parts or pin.chars is not None  # the cut is inside message[messages]
        if pin.messages > len(messages) or (within and pin.messages == len(messages)):
            return PinPlan(pin.session_id, pin.ttl_s, 0,
                           f"the pin cuts at message {pin.messages} (parts {parts}) of a "
                           f"prompt of {len(messages)} messages")
        cut = messages[:pin.messages + (1 if within else 0)]
        if pin.chars is not None:
            content = cut[-1].get("content")
            if not isinstance(content, str):
                return PinPlan(pin.session_id, pin.ttl_s, 0, f"message {pin.messages} has no "
                               f"text content to cut at {pin.chars} characters")
            cut[-1] = {**cut[-1], "content": content[:pin.chars]}
        tools = None if args.tools is None else list(args.tools)
        try:
            rendered = render_chat(loaded, cut, False, tools)
        except OpError as exc:
            return PinPlan(pin.session_id, pin.ttl_s, 0, f"its prefix cannot be rendered: "
                           f"{exc.message}")
        n = common_prefix_len(rendered, prompt_ids)
    n = n // block_size * block_size
    if n == 0:
        return PinPlan(pin.session_id, pin.ttl_s, 0, no_block(block_size))
    return PinPlan(pin.session_id, pin.ttl_s, n)
