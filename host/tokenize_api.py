"""vLLM's token endpoints, for token-aware routers (vllm-router's ``kv_aware``, llm-d's
precise prefix-cache scorer): ``POST /tokenize``, ``POST /detokenize``,
``POST /v1/chat/completions/render`` and ``GET /kv_event_sources``.

Every token id comes from the station's own tokenizer and chat template (its ``tokenize`` /
``detokenize`` ops, base ops every station version serves), so a router sees exactly the
ids a completion's prefill caches: the ids the station's KV events publish (see
``station.serving.kv_events`` and docs/api.md, "Token-aware routing").
"""

from __future__ import annotations

import socket
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from quart import Response

from gnosis_daemon.client import StationError, is_unknown_op
from gnosis_daemon.settings import Settings
from host import errors, openai_api, sse
from host.completions import json_response
from host.errors import ApiError
from host.generic_tools import generic_messages
from host.fields import as_object, check_known, default_only, is_bool, is_list, present
from host.request_scope import current
from host.station_link import StationLink

TOKENIZE_TEXT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt",
                                  "continue_final_message", "add_special_tokens", "tools",
                                  "return_token_strs", "chat_template", "chat_template_kwargs",
                                  "mm_processor_kwargs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def register(app: Any, settings: Settings, link: StationLink,
             read_body: Callable[[], Awaitable[Any]]) -> None:
    """The routes, on the host's app (``host.app.create_app``; ``read_body``: its JSON
    body reader)."""

    def _served(model: Any) -> dict[str, Any]:
        """The station's model card (hello), after checking a request's ``model``."""
        try:
            link.current()
        except StationError as exc:
            raise errors.from_station(exc, "model") from None
        if model is not None and model != link.model_id:
            raise errors.model_not_found(model)
        return (link.hello or {}).get("model") or {}

    @app.post("/tokenize")
    async def route_tokenize() -> Response:
        body = await read_body()
        args, param = parse_tokenize(body)
        card = _served(body.get("model"))
        tokens = await station_tokens(link, args, param, current().request_id)
        return json_response(tokenize_response(tokens, card.get("max_model_len", 0)))

    @app.post("/detokenize")
    async def route_detokenize() -> Response:
        body = await read_body()
        args = parse_detokenize(body)
        _served(body.get("model"))
        text = await station_text(link, args, current().request_id)
        return json_response({"prompt": text})

    @app.post("/v1/chat/completions/render")
    async def route_render_chat() -> Response:
        body = await read_body()
        args = render_args(body)
        _served(body.get("model"))
        tokens = await station_tokens(link, args, "messages", current().request_id)
        return json_response(render_response(tokens, link.model_id or "",
                                                          current().request_id))

    @app.get("/kv_event_sources")
    async def route_kv_event_sources() -> Response:
        # Keyed like /v1 (host.app); built from the settings alone, never from the request.
        sources = kv_event_sources(settings.kv_events_endpoint,
                                   settings.kv_events_replay_endpoint,
                                   settings.kv_events_advertise_host or socket.gethostname())
        return Response(sse.encode_json(sources), 200, content_type="application/json")



def parse_tokenize(body: Any) -> tuple[dict[str, Any], str]:
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest`` -> the station's
    ``tokenize`` args and the field a station refusal is blamed on."""
    body = as_object(body)
    _model(body)
    if present(body, "messages"):
        check_known(body, TOKENIZE_CHAT_FIELDS)
        if present(body, "prompt"):
            raise errors.invalid_value("prompt", "cannot be combined with messages.")
        chat = openai_api.parse_chat({"messages": body["messages"],
                                      **({"tools": body["tools"]} if present(body, "tools") else {})})
        args: dict[str, Any] = {"messages": chat.station_args["messages"]}
        if "tools" in chat.station_args:
            args["tools"] = chat.station_args["tools"]
        add_gen = body.get("add_generation_prompt", True)
        if not isinstance(add_gen, bool):
            raise errors.invalid_type("add_generation_prompt", "a boolean", add_gen)
        args["add_generation_prompt"] = add_gen
        # The template writes the special tokens it wants; vLLM's chat default is false.
        default_only(body, "add_special_tokens", is_bool, "a boolean", lambda v: v is False)
        default_only(body, "continue_final_message", is_bool, "a boolean", lambda v: v is False)
        default_only(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object",
                     lambda v: not v)
        default_only(body, "mm_processor_kwargs", lambda v: isinstance(v, dict), "an object",
                     lambda v: not v)
        if present(body, "chat_template"):
            raise errors.unsupported("chat_template", "is not supported by this server (the "
                                     "model's own template is used).")
        _no_token_strs(body)
        return args, "messages"
    check_known(body, TOKENIZE_TEXT_FIELDS)
    prompt = body.get("prompt")
    if prompt is None:
        raise errors.missing("prompt")
    if not isinstance(prompt, str):
        raise errors.invalid_type("prompt", "a string", prompt)
    add_special = body.get("add_special_tokens", True)  # vLLM's default for a prompt
    if not isinstance(add_special, bool):
        raise errors.invalid_type("add_special_tokens", "a boolean", add_special)
    _no_token_strs(body)
    return {"text": prompt, "add_special_tokens": add_special}, "prompt"


def parse_detokenize(body: Any) -> dict[str, Any]:
    body = as_object(body)
    check_known(body, DETOKENIZE_FIELDS)
    _model(body)
    tokens = body.get("tokens")
    if tokens is None:
        raise errors.missing("tokens")
    if not is_list(tokens) or not all(isinstance(t, int) and not isinstance(t, bool)
                                      and 0 <= t <= openai_api.MAX_TOKEN_ID for t in tokens):
        raise errors.invalid_type("tokens", "an array of token ids", tokens)
    return {"tokens": tokens, "skip_special_tokens": True}


def render_args(body: Any) -> dict[str, Any]:
    """A chat completion request (what a router forwards) -> the station's ``tokenize`` args
    for the prompt that completion would prefill: its messages, tools and generation prompt."""
    chat = openai_api.parse_chat(body)
    args = {"messages": chat.station_args["messages"], "add_generation_prompt": True}
    if "tools" in chat.station_args:
        args["tools"] = chat.station_args["tools"]
    return args


async def station_tokens(link: StationLink, args: dict[str, Any], param: str,
                         request_id: str) -> list[int]:
    """The station's ``tokenize`` answer; errors as OpenAI's. On a model with the generic
    tool format the tools, calls and results are written into the messages, as a chat
    completion's are (``host.generic_tools``)."""
    if "messages" in args and ((link.hello or {}).get("model") or {}).get("tool_parser") == "generic":
        tools = args.get("tools")
        args = {k: v for k, v in args.items() if k != "tools"}
        args["messages"] = generic_messages(args["messages"], tools)
    try:
        result = await link.current().request("tokenize", args, rid=request_id)
    except StationError as exc:
        if is_unknown_op(exc):
            raise no_tokenizer(exc.message) from None
        raise errors.from_station(exc, param) from None
    return list(result["tokens"])


async def station_text(link: StationLink, args: dict[str, Any], request_id: str) -> str:
    try:
        result = await link.current().request("detokenize", args, rid=request_id)
    except StationError as exc:
        if is_unknown_op(exc):
            raise no_tokenizer(exc.message) from None
        raise errors.from_station(exc, "tokens") from None
    return result["text"]


def no_tokenizer(detail: str) -> ApiError:
    """A station that cannot tokenize for us: a clear 501, never a guess at the ids."""
    return ApiError(501, f"The model station does not serve tokenization ({detail}): token "
                    "ids cannot be computed by this server.", errors.INVALID_REQUEST, None,
                    "station_unsupported")


def tokenize_response(tokens: list[int], max_model_len: int) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``."""
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
            "token_strs": None}


def render_response(tokens: list[int], model: str, request_id: str) -> dict[str, Any]:
    """vLLM's render answer (a ``GenerateRequest`` of the rendered prompt): ``token_ids``
    is what routers read."""
    return {"request_id": request_id, "token_ids": tokens, "features": None, "model": model,
            "stream": False}


def kv_event_sources(endpoint: str, replay_endpoint: str, advertise_host: str,
                     topic: str = "") -> list[dict[str, Any]]:
    """vLLM's ``GET /kv_event_sources``: a bare array, one source per data-parallel rank.

    A bound wildcard (``tcp://*:5557``, ``0.0.0.0``, ``[::]``) is advertised with
    ``advertise_host`` (``kv_events_advertise_host``, else this machine's host name): a name
    the operator configured, never one a request supplies (a forged ``Host`` header would
    send a router's subscription elsewhere)."""
    if not endpoint:
        return []
    return [{"data_parallel_rank": 0, "endpoint": _connectable(endpoint, advertise_host),
             "replay_endpoint": _connectable(replay_endpoint, advertise_host) or None,
             "topic": topic}]


def _connectable(endpoint: str, advertise_host: str) -> str:
    if not endpoint:
        return ""
    parts = urlsplit(endpoint)
    if parts.hostname in ("*", "0.0.0.0", "::", "") and advertise_host:
        return f"{parts.scheme}://{advertise_host}:{parts.port}"
    return endpoint


def _model(body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.invalid_type("model", "a string", model)


def _no_token_strs(body: dict[str, Any]) -> None:
    default_only(body, "return_token_strs", is_bool, "a boolean", lambda v: v is False)
