"""``/v1/chat/completions`` and ``/v1/completions``: one station ``generate`` per request.

Both paths (liquid and native, chosen by ``LiquidMemory.prepare``) read the station's
stream the same way: the first event is the ``prefill`` event, which fixes the liquid
outcome, so the ``X-Thoth-Liquid-*`` headers are known before any body byte; a streamed
response waits for it before answering, so a context overflow, a full KV pool or a lost
station still gets its HTTP status instead of a 200 with an error inside.

A prompt that cannot fit is refused here, before the station sees it: its characters are
compared with ``max_model_len * max_token_chars`` (the most characters one token stands for,
from the station's ``hello``), and its size with the station's frame limit, so a 16 MiB
prompt costs the host one length check instead of costing the station a tokenization, or
every tenant the station connection that an oversized frame would end.
"""

from __future__ import annotations

import functools

import json
import time
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import trio
from quart import Response

from gnosis_daemon.client import StationConnection, StationError
from gnosis_daemon.wire import GenerateEvent, GenerateResult, PrefillEvent, TokensEvent
from host.gather import gather
from host.generic_tools import generic_messages
from gnosis_daemon.settings import Settings
from host import errors, formatting, liquid, openai_api, retention, sse
from host.choices import PromptChoices
from host.errors import ApiError
from host.liquid import LiquidOutcome
from host.liquid_memory import LiquidMemory, Prepared
from host.metrics import RequestRecord
from host.station_link import StationLink
from host.sse_body import gnosis as _gnosis
from host.sse_body import max_calls as _max_calls
from host.sse_body import next_event as _next
from host.sse_body import note_result as _note_result
from host.sse_body import result_of, station_error, stream_body
from host.sse_body import total as _total
from host.tool_calls import forced_grammar, parse_tool_calls


def json_response(obj: dict[str, Any], status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    return Response(sse.encode_json(obj), status, headers or {}, content_type="application/json")


async def complete(settings: Settings, link: StationLink, memory: LiquidMemory,
                   req: openai_api.CompletionRequest, record: RequestRecord,
                   tenant: str) -> Response:
    record.stream = req.stream
    try:
        conn = link.current()
    except StationError as exc:
        raise errors.from_station(exc, req.prompt_param) from None
    model_id = link.model_id
    assert model_id is not None
    if req.model is not None and req.model != model_id:
        raise errors.model_not_found(req.model)
    model = (link.hello or {}).get("model") or {}
    req, parser = with_tools(req, model)
    check_grammar_support(req, link.capabilities)
    reqs = per_prompt(req)
    for one in reqs:
        check_prompt_fits(one, model, link.max_frame_bytes)
    # prompt_cache_retention "24h": each prompt pinned whole (refused here when it cannot be).
    pins = [retention.pins(settings, memory, one.retention, tenant, one.station_args)
            for one in reqs]
    record.model = model_id
    fmt = formatting.Formatter(req.kind, model_id, req.include_usage)
    n = req.station_args.get("n", 1)
    name = req.session_name if len(reqs) == 1 else None
    if not req.stream:
        try:
            with trio.fail_after(settings.request_timeout_s):
                runs = await gather([
                    functools.partial(_run, conn, memory, one, record, tenant, name, i, n,
                                      pins[i])
                    for i, one in enumerate(reqs)])
        except StationError as exc:
            raise station_error(exc, req) from None
        except trio.TooSlowError:
            raise errors.timed_out("The completion", settings.request_timeout_s) from None
        out = []
        for prepared, _, result, prompt in runs:
            memory.on_result(prepared, result)
            for choice, part in zip(prompt.choices, prompt.results(result)):
                text, reason, calls = part.text, part.finish_reason, None
                if parser is not None:
                    content, found = parse_tool_calls(text, parser, _max_calls(req))
                    if found:  # else the content is the whole text
                        text, reason, calls = content, "tool_calls", [c.openai() for c in found]
                echo, echo_lps = prompt.echo(req.kind, choice) if req.echo else ("", None)
                lps = choice.logprobs(req.kind, choice.entries if "logprobs" in req.station_args
                                      else None)
                if echo:  # completions only; a tool call's content may be None
                    text = echo + (text or "")
                if echo_lps is not None and lps is not None:
                    lps = {k: echo_lps[k] + lps[k] for k in lps}
                out.append(fmt.choice(text, reason, index=choice.index, logprobs=lps,
                                      tool_calls=calls))
        total = _total([r[2] for r in runs])
        _note_result(record, total)
        usage = formatting.usage(total.prompt_tokens, total.completion_tokens,
                                 total.cached_tokens)
        outcome = runs[0][1]
        return json_response(fmt.completion(None, "", usage, _gnosis(outcome, total),
                                            choices=out), headers=liquid.headers(outcome))
    stack = AsyncExitStack()
    record.closers.append(stack.aclose)
    opened = []
    try:
        for i, one in enumerate(reqs):
            prepared = memory.prepare(one.station_args, tenant=tenant, name=name, pins=pins[i])
            stream = await stack.enter_async_context(
                conn.open_stream("generate", prepared.frame(), rid=record.request_id))
            first = await _next(stream)
            outcome = _outcome(memory, prepared, first, record)
            prompt = PromptChoices(i, n, await _echo_text(conn, one) if req.echo else None)
            opened.append((stream, first, prepared, outcome, prompt))
    except StationError as exc:
        raise station_error(exc, req) from None
    body = stream_body(opened, fmt, memory, record, req, parser)
    response = Response(body, 200, {**sse.HEADERS, **liquid.headers(opened[0][3])})
    response.timeout = None  # a generation may outlast RESPONSE_TIMEOUT (60 s)
    return response


def per_prompt(req: openai_api.CompletionRequest) -> list[openai_api.CompletionRequest]:
    """One request per prompt; with several, each blames its own ``prompt[i]``."""
    if not req.prompts:
        return [req]
    base = {k: v for k, v in req.station_args.items() if k not in ("prompt", "tokens")}
    return [replace(req, station_args={**base, **p}, prompt_param=f"prompt[{i}]",
                    prompt_chars=len(p.get("prompt", "")), prompts=None)
            for i, p in enumerate(req.prompts)]


async def _echo_text(conn: StationConnection, req: openai_api.CompletionRequest) -> str:
    """The prompt's text, echoed before a text completion (token prompts: detokenized)."""
    args = req.station_args
    if "tokens" not in args:
        return args.get("prompt", "")
    result = await conn.request("detokenize", {"tokens": args["tokens"],
                                               "skip_special_tokens": False})
    return result["text"]


def with_tools(req: openai_api.CompletionRequest,
               model: dict[str, Any]) -> tuple[openai_api.CompletionRequest, str | None]:
    """A chat request with tools: (the request, with the grammar that forces a call for
    ``tool_choice`` ``required`` or a named function; the family of the station's tool-call
    parser). A station whose chat template does not render tools, or that names no parser
    (``tool_parser``), cannot take them: 400 on ``tools``."""
    tools = req.tools
    parser = model.get("tool_parser")
    if parser == "generic" and "messages" in req.station_args:  # the host writes the tools
        args = {k: v for k, v in req.station_args.items() if k != "tools"}
        args["messages"] = generic_messages(args["messages"], tools.tools if tools else None)
        req = replace(req, station_args=args)
    if tools is None:
        return req, None
    if parser != "generic" and not model.get("chat_template_tools"):
        raise errors.unsupported("tools", "cannot be used with the served model: its chat "
                                 "template does not render tools.")
    if parser not in ("hermes", "mistral", "llama3", "generic"):
        raise errors.unsupported("tools", "cannot be used with the served model: no tool-call "
                                 "parser is known for it (set the tool_parser setting).")
    if tools.forced:
        grammar = forced_grammar(parser, tools.forced_tools(), one=_max_calls(req) == 1)
        req = replace(req, station_args={**req.station_args, "grammar": grammar})
    return req, parser


def check_grammar_support(req: openai_api.CompletionRequest, capabilities: dict[str, Any]) -> None:
    """A grammar needs a station with ``structured_output`` (an older one would ignore it),
    and no stop strings (one would cut the output short before the grammar is complete)."""
    if "grammar" in req.station_args and req.station_args.get("stop"):
        raise errors.invalid_value("stop", f"cannot be used with {req.grammar_param}: a stop "
                                   f"string would end the output before it is complete.")
    if "grammar" in req.station_args and not capabilities.get("structured_output"):
        raise errors.unsupported(req.grammar_param or "response_format", "cannot be enforced "
                                 "by this server's model station (it lacks structured_output).")


def check_prompt_fits(req: openai_api.CompletionRequest, model: dict[str, Any],
                      max_frame_bytes: int) -> None:
    """Refuse, without the station, token ids outside the vocabulary (the prompt's,
    ``stop_token_ids``, ``logit_bias``'s keys) and a prompt that cannot fit
    ``max_model_len`` (``model``: the station's ``hello["model"]``) or one station frame (a
    frame past the station's limit ends the whole connection, every tenant's requests on it
    included)."""
    tokens = req.station_args.get("tokens")
    vocab_size = model.get("vocab_size")
    if tokens is not None and isinstance(vocab_size, int):
        openai_api.check_token_ids(tokens, vocab_size, req.prompt_param)
    for param in ("stop_token_ids", "logit_bias"):  # a list, or a map keyed by token id
        ids = list(req.station_args.get(param) or ())
        if ids and isinstance(vocab_size, int):
            openai_api.check_token_ids(ids, vocab_size, param)
    max_model_len = model.get("max_model_len")
    if isinstance(max_model_len, int) and tokens is not None and len(tokens) >= max_model_len:
        raise _too_long(req, f"This model's maximum context length is {max_model_len} "
                        f"tokens, but the prompt has {len(tokens)} tokens, which leaves no "
                        f"room for a completion.")
    max_token_chars = model.get("max_token_chars")
    # A station that does not say how long a token can be measures the prompt itself.
    if isinstance(max_model_len, int) and isinstance(max_token_chars, int) \
            and max_token_chars >= 1 and req.prompt_chars > max_model_len * max_token_chars:
        raise _too_long(req, f"This model's maximum context length is {max_model_len} "
                        f"tokens, and one token stands for at most {max_token_chars} "
                        f"characters, so a prompt can hold at most "
                        f"{max_model_len * max_token_chars} characters; this one holds "
                        f"{req.prompt_chars}.")
    check_frame(req, max_frame_bytes)


def check_frame(req: openai_api.CompletionRequest, max_frame_bytes: int) -> None:
    """A generate frame past the station's ``max_frame_bytes`` would end the station
    connection, every tenant's requests on it included: refuse the request instead."""
    args = req.station_args
    texts = [m["content"] for m in args["messages"]] if "messages" in args else \
        [args.get("prompt", "")]
    # Tools, tool calls and a grammar travel as JSON-like maps: measured as their JSON.
    texts += [json.dumps(v) for v in (args.get("tools"), args.get("grammar"),
                                      *(m.get("tool_calls") for m in args.get("messages") or ()))
              if v]
    items = len(args.get("messages") or args.get("tokens") or ())
    prompt = openai_api.frame_estimate(texts, items, max_frame_bytes)
    stop = openai_api.frame_estimate(list(args.get("stop") or ()), 0, max_frame_bytes)
    if prompt + stop + openai_api.FRAME_OVERHEAD < max_frame_bytes:
        return
    if stop > prompt:
        raise errors.invalid_value("stop", f"the stop strings are too long to pass to this "
                                   f"server's model station (its frames hold at most "
                                   f"{max_frame_bytes} bytes).")
    raise _too_long(req, f"The prompt is too large to pass to this server's model station: "
                    f"about {prompt} bytes, and its frames hold at most {max_frame_bytes}.")


def _too_long(req: openai_api.CompletionRequest, message: str) -> ApiError:
    return ApiError(400, message, errors.INVALID_REQUEST, req.prompt_param,
                    "context_length_exceeded")


def _outcome(memory: LiquidMemory, prepared: Prepared, first: GenerateEvent | None,
             record: RequestRecord) -> LiquidOutcome:
    prefill = first if isinstance(first, PrefillEvent) else None
    outcome = memory.on_prefill(prepared, prefill)
    record.liquid_memory = outcome.liquid_memory
    record.liquid_reason = outcome.miss_reason
    record.liquid_tier = outcome.tier
    if prefill is not None:
        retention.note_pins(record, prefill.pins)
        record.prefill_at = time.monotonic()
        record.prompt_tokens = prefill.prompt_tokens
        record.cached_tokens = prefill.cached_tokens
    return outcome


async def _run(conn: StationConnection, memory: LiquidMemory,
               req: openai_api.CompletionRequest, record: RequestRecord, tenant: str,
               name: str | None, prompt_index: int, n: int,
               pins: list[dict[str, Any]] | None = None
               ) -> tuple[Prepared, LiquidOutcome, GenerateResult, PromptChoices]:
    """A whole non-streamed generation: (prepared call, outcome, the station's result, its
    choices with their logprobs)."""
    prepared = memory.prepare(req.station_args, tenant=tenant, name=name, pins=pins)
    prompt = PromptChoices(prompt_index, n)
    async with conn.open_stream("generate", prepared.frame(), rid=record.request_id) as stream:
        first = await _next(stream)
        outcome = _outcome(memory, prepared, first, record)
        event = first
        while event is not None:
            prompt.on_event(event)
            if isinstance(event, TokensEvent):
                record.on_tokens(len(event.token_ids))
            event = await _next(stream)
    result = result_of(stream)
    if req.echo:
        prompt.echo_text = await _echo_text(conn, req)
    return prepared, outcome, result, prompt
