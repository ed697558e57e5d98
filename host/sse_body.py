"""The body of a streamed completion: the station's events of every prompt as OpenAI's chunks.

A request with several prompts has one station stream per prompt, all running at once in
the station; their events are read in the order they arrive (``first_ready``), never one
stream after another, so no stream's frames wait in the host for another prompt to end
(each request's frames are bounded: ``stream_buffer_bytes``). Chunks carry each choice's
``index``, so a client reassembles each choice as it does for ``n > 1``.

Chunks whose events are already here go out as one write: the body yields only before it
would wait for the station (or at its end), so no chunk is held back for a later one, and
a short answer (a prefix hit's one token, its finish, usage and ``[DONE]``) costs one pass
through the HTTP stack and one socket write instead of four.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, AsyncIterator

from gnosis_daemon.client import StationError, StationStream, first_ready
from gnosis_daemon.protocol import ErrorCode, OpError
from gnosis_daemon.wire import GenerateEvent, GenerateResult, PrefillEvent, TokensEvent, event_from_wire
from host import errors, formatting, liquid, openai_api, sse
from host.errors import ApiError
from host.liquid import LiquidOutcome
from host.liquid_memory import LiquidMemory
from host.metrics import RequestRecord
from host.tool_calls import ToolCallParser


async def next_event(stream: StationStream) -> GenerateEvent | None:
    """The stream's next ``generate`` event; None once its result has come."""
    try:
        data = await stream.__anext__()
    except StopAsyncIteration:
        return None
    try:
        return event_from_wire(data)
    except OpError as exc:  # the station broke the protocol: its failure, not the client's
        raise StationError(ErrorCode.INTERNAL.value, f"malformed generate event: {exc.message}") from None


def result_of(stream: StationStream) -> GenerateResult:
    """The ``generate`` result of a stream that has ended."""
    assert stream.result is not None
    try:
        return GenerateResult.from_wire(stream.result)
    except OpError as exc:
        raise StationError(ErrorCode.INTERNAL.value, f"malformed generate result: {exc.message}") from None


def station_error(exc: StationError, req: openai_api.CompletionRequest) -> ApiError:
    """A station error frame; a refused grammar or tools are blamed on their field."""
    param = req.prompt_param
    if exc.code == "bad_request" and "argument 'grammar'" in exc.message and req.grammar_param:
        param = req.grammar_param
    elif exc.code == "bad_request" and "'tools'" in exc.message:
        param = "tools"
    return errors.from_station(exc, param)


def max_calls(req: openai_api.CompletionRequest) -> int | None:
    tools = req.tools
    return 1 if tools is not None and (tools.named or not tools.parallel) else None


def total(results: list[GenerateResult]) -> GenerateResult:
    """The results of every prompt as one: each prompt counted once, every choice's tokens."""
    return replace(results[0], prompt_tokens=sum(r.prompt_tokens for r in results),
                   completion_tokens=sum(r.completion_tokens for r in results),
                   cached_tokens=sum(r.cached_tokens for r in results))


def note_result(record: RequestRecord, result: GenerateResult) -> None:
    record.finished_at = time.monotonic()
    record.finish_reason = result.finish_reason
    record.prompt_tokens = result.prompt_tokens
    record.completion_tokens = result.completion_tokens
    record.cached_tokens = result.cached_tokens
    record.ttft_ms = result.ttft_ms


def gnosis(outcome: LiquidOutcome, result: GenerateResult) -> dict[str, Any]:
    return liquid.gnosis_block(
        outcome, prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens, ttft_ms=result.ttft_ms,
        tokens_per_second=result.decode_tokens_per_s)


async def stream_body(opened: list, fmt: formatting.Formatter, memory: LiquidMemory,
                      record: RequestRecord, req: openai_api.CompletionRequest,
                      parser: str | None) -> AsyncIterator[bytes]:
    """``opened``: each prompt's (stream, its first event, prepared call, liquid outcome,
    choices). A request with tools (``parser``) streams content as it is known not to start
    a call, each call when it is complete."""
    tools: dict[int, ToolCallParser] = {}
    completion_tokens = 0
    results: dict[int, GenerateResult] = {}
    summed: GenerateResult | None = None
    block = None
    out: list[bytes] = []  # chunks not yet written (see the module's docstring)

    def chunks(index: int, text: str, lps: dict | None, calls: Any = ()) -> list[bytes]:
        out = [sse.event(fmt.delta_chunk(text, index, lps))] if text or lps else []
        for call in calls:
            at = tools[index].calls.index(call) if index in tools else 0
            out += [sse.event(c) for c in fmt.tool_call_chunks(at, call.openai(), index)]
        return out

    for _, _, _, _, prompt in opened:
        for choice in prompt.choices:
            role = fmt.role_chunk(choice.index)
            if role is not None:
                out.append(sse.event(role))
            if parser is not None:
                tools[choice.index] = ToolCallParser(parser, max_calls(req))
    waiting = {i: o[1] for i, o in enumerate(opened)}  # first events, not yet shown
    live = list(range(len(opened)))
    while live:
        try:
            at = next((i for i in live if i in waiting), None)
            if at is None:
                if out and not any(opened[i][0].ready for i in live):
                    yield sse.take(out)  # what is here goes now: the next event may be long
                at = live[await first_ready([opened[i][0] for i in live])]
                event = await next_event(opened[at][0])
            else:
                event = waiting.pop(at)
        except StationError as exc:
            # Headers are gone: the error travels as an event, the way OpenAI streams report it.
            record.outcome = f"error:{exc.code}"
            error = errors.for_client(station_error(exc, req), record.request_id)
            out.append(sse.event(error.body()))
            yield sse.take(out)
            return
        stream, _, prepared, outcome, prompt = opened[at]
        if event is not None:
            choice, entries = prompt.on_event(event)
            if isinstance(event, PrefillEvent) and req.echo:
                for c in prompt.choices:
                    out += chunks(c.index, *prompt.echo(req.kind, c))
            if isinstance(event, TokensEvent):
                count = len(event.token_ids)
                record.on_tokens(count)
                completion_tokens += count
                record.completion_tokens = completion_tokens
                text = event.text
                calls: list = []
                if text and choice.index in tools:
                    text, calls = tools[choice.index].feed(text)
                lps = choice.logprobs(req.kind, entries)
                out += chunks(choice.index, text, lps, calls)
            continue
        live.remove(at)
        try:
            result = result_of(stream)
        except StationError as exc:
            record.outcome = f"error:{exc.code}"
            out.append(sse.event(errors.for_client(station_error(exc, req), record.request_id).body()))
            yield sse.take(out)
            return
        memory.on_result(prepared, result)
        results[at] = result
        if not live:  # the last prompt to end: the request's totals
            summed = total([results[i] for i in sorted(results)])
            note_result(record, summed)
            block = gnosis(opened[0][3], summed)
        for choice, part in zip(prompt.choices, prompt.results(result)):
            reason = None
            if choice.index in tools:
                text, calls = tools[choice.index].finish()
                out += chunks(choice.index, text, None, calls)
                reason = "tool_calls" if tools[choice.index].calls else None
            last = not live and choice is prompt.choices[-1]
            out.append(sse.event(fmt.finish_chunk(reason or part.finish_reason,
                                                  None if fmt.include_usage or not last else block,
                                                  choice.index)))
    if fmt.include_usage:
        assert summed is not None and block is not None
        usage = formatting.usage(summed.prompt_tokens, summed.completion_tokens,
                                 summed.cached_tokens)
        out.append(sse.event(fmt.usage_chunk(usage, block)))
    record.outcome = "ok"
    out.append(sse.DONE)
    yield sse.take(out)
