"""Chat arguments of ``generate`` and ``tokenize``: messages (tool calls and tool results
included), tools, and the chat template that renders them.

Their shapes are the wire's (``gnosis_daemon.wire.chat``: a message is ``{role, content}``
plus, optionally, ``tool_calls``, ``tool_call_id`` and ``name``; ``tools`` the OpenAI tool
definitions), given to the template as transformers' ``apply_chat_template(tools=...)``
does. Neither the tools nor a message's tool fields may hold special-token text (a
content's is kept as text, ``station.model.tokenizing``; these are refused instead).

``tool_format`` tells what the model's template does with tools: whether it renders them
at all, and which tool-call parser reads its calls (from the template's text, or the
``tool_parser`` setting); the station publishes both in ``hello``.
"""

from __future__ import annotations

import json
from typing import Any

from gnosis_daemon.protocol import ErrorCode, OpError
from gnosis_daemon.wire.chat import (MESSAGE_KEYS, check_messages, check_tools, json_chars,
                                     messages_chars)
from station.model.loader import LoadedModel
from station.model.tokenizing import Codec

__all__ = ["check_messages", "check_tools", "codec", "json_chars", "messages_chars",
           "render_chat", "template_text", "tool_format"]

TOOL_PARSERS = ("hermes", "mistral", "llama3", "generic")


def bad(message: str) -> OpError:
    return OpError(ErrorCode.BAD_REQUEST, message)


def codec(loaded: LoadedModel) -> Codec:
    if loaded.codec is None:
        loaded.codec = Codec(loaded.tokenizer)
    return loaded.codec


def template_text(loaded: LoadedModel) -> str:
    template = getattr(loaded.tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the default one, and "tool_use"
        template = " ".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def tool_format(loaded: LoadedModel, setting: str = "auto") -> dict[str, Any]:
    """``{"chat_template_tools": bool, "tool_parser": name | None}`` for ``hello``: whether
    the template renders ``tools``, and the parser of its calls (``setting`` when it is not
    ``auto``; ``none``: no parser, tools are refused). A template that renders no tools
    gets the ``generic`` parser: the host writes the tools into the messages instead."""
    text = template_text(loaded)
    renders = "tools" in text
    if setting != "auto":
        return {"chat_template_tools": renders,
                "tool_parser": None if setting == "none" else setting}
    if not renders:  # the host describes the tools in the system prompt (host.generic_tools)
        return {"chat_template_tools": False, "tool_parser": "generic" if text else None}
    parser = None
    if "<tool_call>" in text:
        parser = "hermes"
    elif "[TOOL_CALLS]" in text:
        parser = "mistral"
    elif "<|python_tag|>" in text or ("ipython" in text and "parameters" in text):
        parser = "llama3"
    return {"chat_template_tools": renders, "tool_parser": parser if renders else None}


def render_chat(loaded: LoadedModel, messages: list[dict[str, Any]],
                add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Chat template -> token ids. The template writes every control token it wants, so
    nothing is added; special-token text inside a content is encoded as text
    (``station.model.tokenizing``). A role, a message's tool fields and the tools must
    not hold special-token text at all."""
    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad(f"model {loaded.served_id!r} has no chat template; send 'prompt' or 'tokens'")
    text_codec = codec(loaded)
    for i, message in enumerate(messages):
        if text_codec.has_special_text(message["role"]):
            raise bad(f"messages[{i}].role holds special-token text")
        for key in MESSAGE_KEYS:
            if key in message and text_codec.has_special_text(json.dumps(message[key],
                                                                         ensure_ascii=False)):
                raise bad(f"messages[{i}].{key} holds special-token text")
    if tools:
        if "tools" not in template_text(loaded):
            raise bad(f"the chat template of model {loaded.served_id!r} does not render tools")
        if text_codec.has_special_text(json.dumps(tools, ensure_ascii=False)):
            raise bad("argument 'tools' holds special-token text")

    def render(msgs: list[dict[str, Any]]) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tools=tools or None, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja raises its own types for bad roles/orders
            raise bad(f"chat template rejected the messages: {exc}") from None

    return text_codec.encode_chat(messages, render)
