"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
whose conversation state is the KV.

A response is one chat generation on the liquid path (``host.liquid_memory``): its input
items are chat messages, after ``instructions`` as the system message. A stored response
(``store``, the default) keeps its text record on disk (``host.response_store``) and its
KV in the station: the generation is sent with ``save_session`` and ``save_final_session``
= the response's own session (``host.session_names.response_session``), so the prompt is
saved when its prefill ends and prompt + output replace it when it ends. A follow-up naming
it in ``previous_response_id`` rebuilds the conversation from the chain of records (each
turn's input, then its output as the assistant's message) and is sent with ``load_session``
= that session: the station reuses the whole saved conversation and
prefills only what is new. The session survives a station restart through the disk tier;
when it is gone the chain is still the text, so the follow-up is a miss, never wrong.

``store: false`` leaves nothing behind: no record, and no save arguments (the prefix cache
still serves what it holds, as for any request). ``DELETE`` removes the record and its
session with ``forget`` (``kv_session.delete``: its blocks leave the prefix cache too). A
response of another tenant is a 404, as one that never existed.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any, Awaitable, Callable

import trio
from quart import Response, g

from gnosis_daemon.client import StationConnection, StationError
from gnosis_daemon.logs import get_logger
from gnosis_daemon.settings import Settings
from gnosis_daemon.wire import GenerateResult, PrefillEvent, TokensEvent
from host import errors, liquid, retention, sse
from host.completions import check_prompt_fits, json_response, with_tools
from host.errors import ApiError
from host.liquid import LiquidOutcome
from host.liquid_memory import LiquidMemory, Prepared
from host.metrics import RequestRecord
from host.openai_api import CHAT, CompletionRequest
from host.request_scope import Admission, current
from host.response_store import ResponseRecord, ResponseStore, new_id
from host.responses_fields import ResponsesRequest, parse
from host.responses_format import ResponseShape, status_of, usage
from host.session_names import response_session
from host.sse_body import gnosis, next_event, note_result, result_of, station_error
from host.station_link import StationLink

log = get_logger("host.responses")


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", errors.INVALID_REQUEST,
                    None, "not_found")


def conversation(chain: list[ResponseRecord], req: ResponsesRequest) -> list[dict[str, str]]:
    """The chat messages of a turn: this request's instructions (a previous turn's do not
    carry over, as in OpenAI's API), every earlier turn's input and output, this input."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for record in chain:
        messages += [{"role": m["role"], "content": m["content"]} for m in record.input]
        messages.append({"role": "assistant", "content": record.output_text})
    return messages + req.input


def _plan(prepared: Prepared, *, store: bool, save: str, load: str | None) -> None:
    """The session arguments of a response's generate: its own session, the prompt's KV
    when the prefill ends and prompt + output when it ends (``store``: so a response makes
    that one session, which its ``DELETE`` forgets), or no save at all; the previous
    response's session loaded."""
    if not prepared.liquid:
        return
    if store:
        prepared.args["save_session"] = prepared.args["save_final_session"] = save
    else:
        prepared.args.pop("save_session", None)
        prepared.args.pop("save_final_session", None)
    if load:
        prepared.args["load_session"] = load


def _outcome(prepared: Prepared, first: Any, record: RequestRecord, store: bool) -> LiquidOutcome:
    prefill = first if isinstance(first, PrefillEvent) else None
    outcome = prepared.fixed or liquid.from_prefill(prefill, save_asked=store,
                                                    match_asked=prepared.match)
    record.liquid_memory = outcome.liquid_memory
    record.liquid_reason = outcome.miss_reason
    record.liquid_tier = outcome.tier
    if prefill is not None:
        record.prompt_tokens = prefill.prompt_tokens
        record.cached_tokens = prefill.cached_tokens
        retention.note_pins(record, prefill.pins)
    return outcome


class Responses:
    """The routes' shared parts (one per app)."""

    def __init__(self, settings: Settings, link: StationLink, memory: LiquidMemory,
                 store: ResponseStore) -> None:
        self.settings = settings
        self.link = link
        self.memory = memory
        self.store = store

    async def create(self, body: Any, record: RequestRecord, tenant: str) -> Response:
        req = parse(body)
        record.stream = req.stream
        try:
            conn = self.link.current()
        except StationError as exc:
            raise errors.from_station(exc, "input") from None
        model_id = self.link.model_id
        assert model_id is not None
        if req.model is not None and req.model != model_id:
            raise errors.model_not_found(req.model)
        chain: list[ResponseRecord] = []
        if req.previous_response_id:
            found = await trio.to_thread.run_sync(self.store.chain, tenant,
                                                  req.previous_response_id)
            if found is None:
                raise errors.invalid(f"Previous response with id '{req.previous_response_id}' "
                                     f"not found.", "previous_response_id", "not_found")
            chain = found
        messages = conversation(chain, req)
        chat = CompletionRequest(CHAT, req.model, req.stream, False,
                                 {"messages": messages, **req.sampling}, "input",
                                 req.session_name,
                                 sum(len(m["content"]) for m in messages))
        card = (self.link.hello or {}).get("model") or {}
        chat, _ = with_tools(chat, card)
        check_prompt_fits(chat, card, self.link.max_frame_bytes)
        pins = retention.pins(self.settings, self.memory, req.retention, tenant,
                              chat.station_args)
        record.model = model_id
        shape = ResponseShape(new_id(), model_id, req)
        prepared = self.memory.prepare(chat.station_args, tenant=tenant, name=req.session_name,
                                       pins=pins)
        save = response_session(tenant, shape.id)
        _plan(prepared, store=req.store, save=save,
              load=chain[-1].session_id if chain else None)
        finish = _Finish(self, conn, shape, tenant, save)
        if not req.stream:
            return await self._whole(conn, prepared, chat, record, finish)
        return await self._streamed(conn, prepared, chat, record, finish)

    async def _whole(self, conn: StationConnection, prepared: Prepared, chat: CompletionRequest,
                     record: RequestRecord, finish: _Finish) -> Response:
        store = finish.shape.req.store
        try:
            with trio.fail_after(self.settings.request_timeout_s):
                async with conn.open_stream("generate", prepared.frame(),
                                            rid=record.request_id) as stream:
                    event = await next_event(stream)
                    outcome = _outcome(prepared, event, record, store)
                    while event is not None:
                        if isinstance(event, TokensEvent):
                            record.on_tokens(len(event.token_ids))
                        event = await next_event(stream)
                result = result_of(stream)
        except StationError as exc:
            raise station_error(exc, chat) from None
        except trio.TooSlowError:
            raise errors.timed_out("The response", self.settings.request_timeout_s) from None
        body = await finish.done(result, outcome, record)
        return json_response(body, headers=liquid.headers(outcome))

    async def _streamed(self, conn: StationConnection, prepared: Prepared,
                        chat: CompletionRequest, record: RequestRecord,
                        finish: _Finish) -> Response:
        stack = AsyncExitStack()
        record.closers.append(stack.aclose)  # the station stream ends with the request
        try:
            stream = await stack.enter_async_context(
                conn.open_stream("generate", prepared.frame(), rid=record.request_id))
            first = await next_event(stream)
        except StationError as exc:
            raise station_error(exc, chat) from None
        outcome = _outcome(prepared, first, record, finish.shape.req.store)
        shape = finish.shape

        async def body() -> Any:
            for chunk in shape.opening():
                yield chunk
            event = first
            try:
                while event is not None:
                    if isinstance(event, TokensEvent):
                        record.on_tokens(len(event.token_ids))
                        if event.text:
                            yield shape.delta(event.text)
                    event = await next_event(stream)
                result = result_of(stream)
            except StationError as exc:
                record.outcome = f"error:{exc.code}"
                error = errors.for_client(station_error(exc, chat), record.request_id)
                yield shape.failed(error.body()["error"])
                return
            response = await finish.done(result, outcome, record)
            for chunk in shape.closing(result.first.text, response["status"],
                                       response["usage"], response["_gnosis"]):
                yield chunk
            record.outcome = "ok"

        response = Response(body(), 200, {**sse.HEADERS, **liquid.headers(outcome)})
        response.timeout = None  # a generation may outlast RESPONSE_TIMEOUT (60 s)
        return response

    async def get(self, tenant: str, response_id: str) -> Response:
        found = await trio.to_thread.run_sync(self.store.get, tenant, response_id)
        if found is None or not found.extra:
            raise not_found(response_id)
        return json_response(found.extra)

    async def delete(self, tenant: str, response_id: str) -> Response:
        found = await trio.to_thread.run_sync(self.store.delete, tenant, response_id)
        if found is None:
            raise not_found(response_id)
        if found.session_id:
            await forget(self.link, tenant, [found.session_id])
        return json_response({"id": response_id, "object": "response", "deleted": True})


class _Finish:
    """What follows a response's generation: its object, and its record when stored."""

    def __init__(self, api: Responses, conn: StationConnection, shape: ResponseShape,
                 tenant: str, save: str) -> None:
        self.api, self.conn, self.shape, self.tenant, self.save = api, conn, shape, tenant, save

    async def done(self, result: GenerateResult, outcome: LiquidOutcome,
                   record: RequestRecord) -> dict[str, Any]:
        note_result(record, result)
        shape, req = self.shape, self.shape.req
        text = result.first.text
        status = status_of(result.finish_reason)
        body = shape.response(status, text=text,
                              usage_=usage(result.prompt_tokens, result.completion_tokens,
                                           result.cached_tokens),
                              gnosis=gnosis(outcome, result))
        if req.store:
            saved = self.save if result.first.final_saved else None
            if result.first.final_save_error:
                log.warning("response_save_failed", error=result.first.final_save_error,
                            response=shape.id)
            stored = {k: v for k, v in body.items() if k != "_gnosis"}
            entry = ResponseRecord(id=shape.id, tenant=self.tenant, created_at=shape.created_at,
                                   model=shape.model, instructions=req.instructions,
                                   input=req.input, output_text=text,
                                   previous_response_id=req.previous_response_id,
                                   session_id=saved, status=status, usage=body["usage"],
                                   metadata=req.metadata, extra=stored)
            dropped = await trio.to_thread.run_sync(self.api.store.put, entry)
            gone = [r.session_id for r in dropped if r.session_id]
            if gone:
                await forget(self.api.link, self.tenant, gone)
        return body


async def forget(link: StationLink, tenant: str, session_ids: list[str]) -> None:
    """Delete the tenant's sessions with ``forget``; a station that is down forgets them
    anyway once they expire, so a failure here is logged, not answered."""
    try:
        conn = link.current()
        for session_id in session_ids:
            await conn.request("kv_session.delete", {"session_id": session_id,
                                                     "tenant": tenant, "forget": True})
    except StationError as exc:
        log.warning("response_session_delete_failed", error=str(exc), sessions=len(session_ids))


def register(app: Any, settings: Settings, link: StationLink, memory: LiquidMemory,
             admission: Admission, read_body: Callable[[], Awaitable[Any]]) -> None:
    """The routes, on the host's app (``host.app.create_app``)."""
    store = ResponseStore(settings.effective_state_dir / "responses",
                          settings.responses_max_per_tenant, settings.responses_ttl_s)
    api = Responses(settings, link, memory, store)
    app.gnosis_responses = api

    @app.post("/v1/responses")
    async def create_response() -> Response:
        body = await read_body()  # a slot is taken once the body is in
        admission.admit(current(), g.tenant)
        return await api.create(body, current(), g.tenant)

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        return await api.get(g.tenant, response_id)

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        return await api.delete(g.tenant, response_id)
