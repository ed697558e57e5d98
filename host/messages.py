"""``POST /v1/messages``: Anthropic's Messages API, on the chat completions' path.

The request (``host.anthropic_api``) becomes the chat path's ``CompletionRequest``: the
same tools handling (``completions.with_tools``), the same checks before the station
(grammar, context, frame), and the same liquid-memory plan (``LiquidMemory.prepare``: the
tenant's sessions matched, the prompt saved), so a conversation hits the same KV whichever
dialect it came in. Each ``cache_control`` breakpoint is a TTL pin (``host.cache_pins``);
where pins cannot be asked for (liquid memory off, a station without ``kv_session_pins``)
the request runs without them and its ``_gnosis.cache_pins`` says why (Anthropic treats a
breakpoint as a hint too: a prefix it does not cache is simply not counted).

A streamed answer, like a streamed chat completion, waits for the station's first event
before its headers go out, so a full pool or a lost station still gets its HTTP status.
Every error on these routes has Anthropic's body (``anthropic_format.error_body``): the
host's error handlers answer OpenAI's, and ``_anthropic_errors`` reshapes it on the way
out, auth and 429 included.
"""

from __future__ import annotations

import json
import time
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any, AsyncIterator

import trio
from quart import Response, g, request
from quart_trio import QuartTrio

from gnosis_daemon.client import StationConnection, StationError, StationStream
from gnosis_daemon.settings import Settings
from gnosis_daemon.wire import GenerateResult, PrefillEvent, TokensEvent
from host import anthropic_api, cache_pins, errors, liquid, openai_api, sse
from host.anthropic_api import AnthropicRequest
from host.anthropic_format import (MessageFormatter, error_body, event, matched_stop,
                                   stop_reason, tool_use)
from host.anthropic_format import usage as message_usage
from host.completions import check_grammar_support, check_prompt_fits, json_response, with_tools
from host.errors import ApiError
from host.liquid import LiquidOutcome
from host.liquid_memory import LiquidMemory, Prepared
from host.metrics import RequestRecord
from host.request_scope import Admission, current
from host.sse_body import gnosis, max_calls, next_event, note_result, result_of, station_error
from host.station_link import StationLink
from host.tokenize_api import station_tokens
from host.tool_calls import ToolCallParser, parse_tool_calls

ROUTE = "/v1/messages"
# What /v1/messages/count_tokens takes: the prompt's fields, nothing about sampling.
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                          "cache_control"})


def register(app: QuartTrio, settings: Settings, link: StationLink, memory: LiquidMemory,
             admission: Admission, read_body: Any) -> None:
    """The route, and the hook that gives its errors Anthropic's body."""

    @app.post(ROUTE)
    async def create_message() -> Response:
        body = await read_body()  # a slot is taken once the body is in
        admission.admit(current(), g.tenant)
        req = anthropic_api.parse_messages(body)
        chat = openai_api.with_session_header(req.chat,
                                              request.headers.get(openai_api.SESSION_HEADER))
        return await answer(settings, link, memory, replace(req, chat=chat), current(),
                            g.tenant)

    @app.post(ROUTE + "/count_tokens")
    async def count_tokens() -> Response:
        """Anthropic's token count: the prompt's tokens as the message would prefill them."""
        body = await read_body()
        if isinstance(body, dict):
            for key in body:
                if key not in COUNT_FIELDS:
                    raise anthropic_api.bad(key[:64], "Extra inputs are not permitted")
        req = anthropic_api.parse_messages({**body, "max_tokens": 1}
                                           if isinstance(body, dict) else body)
        try:
            link.current()
        except StationError as exc:
            raise errors.from_station(exc, "messages") from None
        if req.chat.model != link.model_id:
            raise errors.model_not_found(str(req.chat.model))
        args = {"messages": req.chat.station_args["messages"], "add_generation_prompt": True}
        if "tools" in req.chat.station_args:
            args["tools"] = req.chat.station_args["tools"]
        tokens = await station_tokens(link, args, "messages", current().request_id)
        return json_response({"input_tokens": len(tokens)})

    @app.after_request
    async def _anthropic_errors(response: Response) -> Response:
        if request.path != ROUTE and not request.path.startswith(ROUTE + "/"):
            return response
        record = current()
        response.headers["request-id"] = record.request_id  # where Anthropic's clients look
        if response.status_code < 400 or response.mimetype != "application/json":
            return response
        try:
            body = json.loads(await response.get_data())
        except ValueError:
            return response
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and body.get("type") != "error":
            message = str(error.get("message") or "")
            param = error.get("param")
            if isinstance(param, str) and param and not message.startswith(f"{param}: "):
                message = f"{param}: {message}"  # the field first, as Anthropic names it
            if response.status_code == 401:  # Anthropic's words for its key header
                message = "invalid x-api-key" if _key_given() else "x-api-key header is required"
            response.set_data(sse.encode_json(error_body(response.status_code, message,
                                                         record.request_id)))
        return response


def _key_given() -> bool:
    return bool(request.headers.get("x-api-key") or request.headers.get("Authorization"))


async def answer(settings: Settings, link: StationLink, memory: LiquidMemory,
                 req: AnthropicRequest, record: RequestRecord, tenant: str) -> Response:
    record.stream = req.chat.stream
    try:
        conn = link.current()
    except StationError as exc:
        raise errors.from_station(exc, "messages") from None
    model_id = link.model_id
    assert model_id is not None
    if req.chat.model != model_id:
        raise errors.model_not_found(str(req.chat.model))
    model = (link.hello or {}).get("model") or {}
    given = len(req.chat.station_args["messages"])
    chat, parser = with_tools(req.chat, model)
    check_grammar_support(chat, link.capabilities)
    check_prompt_fits(chat, model, link.max_frame_bytes)
    record.model = model_id
    plan, unavailable = _pin_plan(settings, memory, req, chat,
                                  len(chat.station_args["messages"]) - given, tenant)
    prepared = memory.prepare(chat.station_args, tenant=tenant, name=chat.session_name,
                              pins=list(plan.pins) if plan and plan.pins else None)
    run = _Run(conn, memory, req, chat, prepared, plan, unavailable, record, parser)
    fmt = MessageFormatter(model_id)
    if not chat.stream:
        try:
            with trio.fail_after(settings.request_timeout_s):
                return await run.whole(fmt)
        except StationError as exc:
            raise station_error(exc, chat) from None
        except trio.TooSlowError:
            raise errors.timed_out("The message", settings.request_timeout_s) from None
    stack = AsyncExitStack()
    record.closers.append(stack.aclose)
    try:
        stream = await stack.enter_async_context(
            conn.open_stream("generate", prepared.frame(), rid=record.request_id))
        outcome = run.on_first(await next_event(stream))
    except StationError as exc:
        raise station_error(exc, chat) from None
    response = Response(run.events(stream, fmt), 200, {**sse.HEADERS, **liquid.headers(outcome)})
    response.timeout = None  # a generation may outlast RESPONSE_TIMEOUT (60 s)
    return response


def _pin_plan(settings: Settings, memory: LiquidMemory, req: AnthropicRequest,
              chat: openai_api.CompletionRequest, shift: int,
              tenant: str) -> tuple[cache_pins.PinPlan | None, str | None]:
    """The pins of the request's breakpoints, or why they cannot be asked for."""
    if not req.breakpoints:
        return None, None
    if not memory.can_pin():
        state = memory.state(connected=True)
        return None, state.reason or "the model station lacks kv_session_pins"
    ttl_s = {"5m": settings.cache_ttl_5m_s, "1h": settings.cache_ttl_1h_s}
    return cache_pins.plan(req.breakpoints, chat.station_args["messages"],
                           chat.station_args.get("tools"), shift, tenant, ttl_s), None


class _Run:
    """One message's station call: its first event, its events, its answer."""

    def __init__(self, conn: StationConnection, memory: LiquidMemory, req: AnthropicRequest,
                 chat: openai_api.CompletionRequest, prepared: Prepared,
                 plan: cache_pins.PinPlan | None, unavailable: str | None,
                 record: RequestRecord, parser: str | None) -> None:
        self.conn, self.memory, self.req, self.chat = conn, memory, req, chat
        self.prepared, self.plan, self.unavailable = prepared, plan, unavailable
        self.record, self.parser = record, parser
        self.outcome: LiquidOutcome | None = None
        self.pins = cache_pins.PinUsage()
        self.prompt_tokens = 0

    def on_first(self, first: Any) -> LiquidOutcome:
        """The prefill event: the liquid outcome, the pins' counts, the record's fields."""
        prefill = first if isinstance(first, PrefillEvent) else None
        outcome = self.outcome = self.memory.on_prefill(self.prepared, prefill)
        record = self.record
        record.liquid_memory, record.liquid_reason = outcome.liquid_memory, outcome.miss_reason
        record.liquid_tier = outcome.tier
        self.pins = cache_pins.usage(self.req.breakpoints, self.plan,
                                     prefill.pins if prefill else (), self.unavailable)
        record.pins.extend(self.pins.outcomes)
        if prefill is not None:
            record.prefill_at = time.monotonic()
            record.prompt_tokens = self.prompt_tokens = prefill.prompt_tokens
            record.cached_tokens = prefill.cached_tokens
        return outcome

    def usage(self, output_tokens: int) -> dict[str, Any]:
        return message_usage(self.prompt_tokens, output_tokens, self.pins)

    def gnosis(self, result: GenerateResult) -> dict[str, Any]:
        assert self.outcome is not None
        return {**gnosis(self.outcome, result), "cache_pins": self.pins.cache_pins}

    async def finish(self, result: GenerateResult) -> str | None:
        """Record the result; the stop sequence that ended it, if one did."""
        self.memory.on_result(self.prepared, result)
        note_result(self.record, result)
        if result.finish_reason != "stop" or not self.req.stop_sequences:
            return None
        decoded = await self.conn.request("detokenize", {"tokens": list(result.first.token_ids),
                                                         "skip_special_tokens": True})
        return matched_stop(str(decoded.get("text", "")), result.first.text,
                            self.req.stop_sequences)

    async def whole(self, fmt: MessageFormatter) -> Response:
        async with self.conn.open_stream("generate", self.prepared.frame(),
                                         rid=self.record.request_id) as stream:
            item = await next_event(stream)
            outcome = self.on_first(item)
            while item is not None:
                if isinstance(item, TokensEvent):
                    self.record.on_tokens(len(item.token_ids))
                item = await next_event(stream)
        result = result_of(stream)
        stop_sequence = await self.finish(result)
        text: str | None = result.first.text
        calls: list = []
        if self.parser is not None:
            text, calls = parse_tool_calls(result.first.text, self.parser, max_calls(self.chat))
        content = ([{"type": "text", "text": text}] if text else []) + [tool_use(c) for c in calls]
        stop = stop_reason(result.finish_reason, bool(calls), stop_sequence)
        body = fmt.message(content, stop, stop_sequence, self.usage(result.completion_tokens),
                           self.gnosis(result))
        return json_response(body, headers=liquid.headers(outcome))

    async def events(self, stream: StationStream, fmt: MessageFormatter) -> AsyncIterator[bytes]:
        tools = ToolCallParser(self.parser, max_calls(self.chat)) if self.parser else None
        calls = 0
        output = 0

        def blocks(text: str, found: list) -> list[bytes]:
            """The events of newly known text, then of each tool call found complete."""
            return [*fmt.text(text), *(chunk for call in found for chunk in fmt.call(call))]

        # Events already here go out as one write (as host/sse_body.py's chunks do): the
        # body yields only before it would wait for the station, and at its end.
        out = [fmt.start(self.usage(1))]
        try:
            while True:
                if out and not stream.ready:
                    yield sse.take(out)
                item = await next_event(stream)
                if item is None:
                    break
                if not isinstance(item, TokensEvent):
                    continue
                self.record.on_tokens(len(item.token_ids))
                output += len(item.token_ids)
                self.record.completion_tokens = output
                text, found = tools.feed(item.text) if tools else (item.text, [])
                calls += len(found)
                out += blocks(text, found)
            result = result_of(stream)
            if tools is not None:
                text, found = tools.finish()
                calls += len(found)
                out += blocks(text, found)
            if result.finish_reason == "stop" and self.req.stop_sequences:
                yield sse.take(out)  # finish asks the station which stop it was: do not wait
            stop_sequence = await self.finish(result)
        except StationError as exc:
            # The headers are gone: the error travels as Anthropic's error event.
            self.record.outcome = f"error:{exc.code}"
            error = errors.for_client(station_error(exc, self.chat), self.record.request_id)
            out.append(_error_event(error, self.record.request_id))
            yield sse.take(out)
            return
        stop = stop_reason(result.finish_reason, calls > 0, stop_sequence)
        out += fmt.end(stop, stop_sequence, self.usage(result.completion_tokens),
                       self.gnosis(result))
        yield sse.take(out)
        self.record.outcome = "ok"


def _error_event(error: ApiError, request_id: str) -> bytes:
    return event("error", error_body(error.status, error.message, request_id))
