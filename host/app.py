"""The host: an OpenAI-compatible HTTP API (Quart on quart-trio, served by hypercorn).

It is the only client of the station socket (through one ``StationLink``, whose connect
hook negotiates capabilities and rebuilds the liquid-memory session index: ``host.
liquid_memory``). Completions (``host.completions``) go to the station's ``generate`` op,
on the liquid or the native path; embeddings to ``embed``; errors use OpenAI's body; every
completion reports what liquid memory did (``_gnosis`` block, ``X-Thoth-Liquid-*`` headers).

Two framework facts shape this file: quart-trio applies ``RESPONSE_TIMEOUT`` to streamed
bodies too, so each SSE response lifts its own timeout; and hypercorn gives in-flight
requests only ``graceful_timeout`` on shutdown, so that is set to ``drain_grace_s``.

Overload gets an answer, never a reset: the listening socket's accept queue is
``listen_backlog`` (hypercorn's own default of 100 overflows under a burst), the process may
hold as many sockets as its hard file limit allows, a body over ``max_request_bytes`` is a
413, and past ``max_inflight_requests`` completions and embeddings (or a tenant's share of
them), counted once a body is read, a request is answered 429 with ``Retry-After`` at once
instead of queueing in the host. A client that stops reading is cut below the app
(``host.http_server``), as are ambiguous framing and protocol switches.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, g, request
from prometheus_client import CONTENT_TYPE_LATEST
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from gnosis_daemon.api_keys import ANON, KeyFileError, Keyring, bearer, load_keyring
from gnosis_daemon.client import StationError
from gnosis_daemon.logs import configure_logging, get_logger
from gnosis_daemon.refusal import describe
from gnosis_daemon.settings import Settings
from host import (embeddings, errors, http_server, json_body, openai_api, responses_api,
                  session_control, sse, tokenize_api)
from host import messages
from host.completions import complete, json_response
from host.errors import ApiError
from host.liquid_memory import LiquidMemory
from host.request_scope import Admission, RequestConnection, current, tenant_limit
from host.metrics import Metrics
from host.scrape_metrics import ScrapeCollector, supervisor_restarts
from host.station_link import StationLink

_HEALTH_STATS_S = 0.5
# What /health's station_refused shows of the refusal file (docs/api.md).
_REFUSAL_FIELDS = ("model_type", "kind", "reason", "message", "model", "at")


def _session_count(stats: dict[str, Any] | None) -> int | None:
    """KV sessions in every tier, from the station's ``stats``."""
    try:
        return None if stats is None else (int(stats.get("kv_sessions") or 0)
                                           + int(stats.get("kv_disk_sessions") or 0))
    except (TypeError, ValueError):
        return None

log = get_logger("host")
_DRAIN_POLL_S = 0.05
# Paths that never need a key unless health_requires_key is set. (/livez, outside /v1,
# never needs one: it says only that the process serves.)
_HEALTH_PATHS = ("/health", "/metrics")
# vLLM's token endpoints sit outside /v1 but run the model's tokenizer or point to the KV
# events (every tenant's prompt tokens): keyed like /v1.
_TOKEN_PATHS = ("/tokenize", "/detokenize", "/kv_event_sources")


def create_app(settings: Settings, link: StationLink,
               keyring: Keyring | None = None) -> QuartTrio:
    """The app; ``keyring`` defaults to the settings' keys (``KeyFileError`` on a bad file)."""
    keyring = load_keyring(settings) if keyring is None else keyring
    app = QuartTrio("gnosis_host")
    app.asgi_http_class = RequestConnection
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    host_metrics = Metrics(settings.max_model_len)
    ttl_names = {settings.cache_ttl_5m_s: "5m", settings.cache_ttl_1h_s: "1h",
                 settings.cache_retention_24h_s: "24h"}  # /metrics' ttl label of a pin's seconds
    app.gnosis_metrics = host_metrics  # type: ignore[attr-defined]
    link.on_overflow = host_metrics.overflows.inc
    tenants = len({tenant for _, tenant in keyring.entries})
    admission = Admission(settings.max_inflight_requests, tenant_limit(
        settings.max_inflight_requests, settings.max_inflight_tenant_share, tenants))
    app.gnosis_admission = admission  # type: ignore[attr-defined]
    memory = LiquidMemory(settings.liquid_memory,
                          negotiate_timeout_s=max(settings.health_timeout_s, 5.0))
    app.gnosis_liquid = memory  # type: ignore[attr-defined]

    async def on_connect(conn: Any, hello: dict[str, Any]) -> None:
        # Every (re)connect: negotiate before requests can see the connection.
        await memory.on_connect(conn, hello)
        assert memory.negotiated is not None
        link.capabilities = {k: v for k, v in memory.negotiated.flags.items() if v}

    link.on_connect = on_connect

    @app.before_request
    async def _authenticate() -> None:
        # Without keys every caller is the one local tenant; with keys the key names it.
        if not keyring.enabled:
            g.tenant = ANON
            return
        g.tenant = None
        path = request.path
        if not (path == "/v1" or path.startswith("/v1/")) and path not in _TOKEN_PATHS and \
                not (settings.health_requires_key and path in _HEALTH_PATHS):
            return
        # Anthropic's clients send the key as x-api-key: the same keys, the same tenants.
        key = bearer(request.headers.get("Authorization")) or \
            (request.headers.get("x-api-key") or "").strip() or None
        tenant = keyring.tenant(key)
        if tenant is None:
            message = ("Incorrect API key provided." if key else
                       "You didn't provide an API key. You need to provide your API key in an "
                       "Authorization header using Bearer auth (i.e. Authorization: Bearer "
                       "YOUR_KEY).")
            raise ApiError(401, message, errors.INVALID_REQUEST, None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})
        g.tenant = tenant

    @app.after_request
    async def _finish(response: Response) -> Response:
        record = current()
        record.status = response.status_code
        record.route = request.url_rule.rule if request.url_rule is not None else None
        if not record.stream or response.status_code >= 400:
            # The answer is complete; a disconnect while it is sent does not change that.
            record.outcome = record.outcome or ("ok" if response.status_code < 400 else "error")
        response.headers["X-Request-Id"] = record.request_id
        if settings.replica_name:  # which replica of a fleet answered (behind a router)
            response.headers["X-Gnosis-Replica"] = settings.replica_name
        if _body_unread():
            # Answered before the body was read (401, 413, a 404...): the rest of the body is
            # still coming, and a client reusing the connection would wait behind it.
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(ApiError)
    async def _api_error(exc: ApiError) -> Response:
        record = current()
        record.outcome = record.outcome or f"error:{exc.code or exc.type}"
        exc = errors.for_client(exc, record.request_id)
        return Response(sse.encode_json(exc.body()), exc.status, exc.headers,
                        content_type="application/json")

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        message = exc.description or exc.name
        if status == 404:
            message = f"Unknown request URL: {request.method} {request.path}."
        if status == 413:
            message = (f"The request body is larger than this server's limit of "
                       f"{settings.max_request_bytes} bytes.")
        return await _api_error(ApiError(status, message, errors.INVALID_REQUEST, None, code))

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled_error")
        return await _api_error(errors.internal(f"{type(exc).__name__}: {exc}"))

    @app.get("/livez")
    async def livez() -> Response:
        """200 whenever this process serves, station or not (a station restart cannot fail it)."""
        return Response(sse.encode_json({"status": "alive"}), 200, content_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        connected = link.connected
        hello = link.hello if connected else None
        # A station that refused its model (permanent): the refusal file's reason.
        refusal = None if connected else link.refusal
        body: dict[str, Any] = {
            "status": "ok" if connected else ("refused" if refusal else "unavailable"),
            "host_pid": os.getpid(),
            "model": link.model_id if connected else None,
            "station_reachable": connected,
            "station_pid": hello.get("pid") if hello else None,
            # Every negotiated flag (false ones included) and how each was learned.
            "station_capabilities": (dict(memory.negotiated.flags)
                                     if connected and memory.negotiated else {}),
            "station_capabilities_learned": (dict(memory.negotiated.learned)
                                             if connected and memory.negotiated else {}),
            "station_restarts": link.reconnects,
            "station_last_error": (None if connected else
                                   describe(refusal) if refusal else link.last_error),
            "station_refused": (None if refusal is None else
                                {key: refusal.get(key) for key in _REFUSAL_FIELDS}),
            # The station's KV disk tier at its start (restored, rejected, foreign).
            "station_kv_tier": hello.get("kv_tier") if hello else None,
            # The station's decode plan: body, head, linear forms, every refused candidate's why.
            "station_decode_plan": (hello.get("model") or {}).get("decode_plan") if hello else None,
        }
        # Liquid memory: effective state, env switch, station kv_session, reason when off.
        body.update(memory.state(connected=connected).health_fields())
        stats = await station_stats() if connected else None
        body["liquid_sessions"] = _session_count(stats)
        if stats is not None and isinstance(stats.get("kv_tier"), dict):
            body["station_kv_tier"] = stats["kv_tier"]  # the tiers' fill now
        return Response(sse.encode_json(body), 200 if connected else 503,
                        content_type="application/json")

    async def station_stats() -> dict[str, Any] | None:
        """The station's ``stats`` (KV sessions in each tier), None when it does not answer
        within ``_HEALTH_STATS_S``: /health never waits on a busy station for long."""
        with trio.move_on_after(_HEALTH_STATS_S):
            try:
                stats = await link.current().request("stats", {})
            except StationError:
                return None
            return stats if isinstance(stats, dict) else None
        return None

    @app.get("/metrics")
    async def metrics() -> Response:
        gauges = {"station_up": 1.0 if link.connected else 0.0,
                  "station_refused": 1.0 if link.refusal is not None else 0.0,
                  "station_restarts": float(link.reconnects),
                  "http_requests_inflight": float(host_metrics.inflight),
                  "model_requests_inflight": float(admission.inflight),
                  "model_requests_inflight_limit": float(admission.limit),
                  **link.buffered()}
        station = await station_stats() if link.connected else None
        model_name = link.model_id
        if model_name is not None:
            host_metrics.touch(model_name)
        scraped = ScrapeCollector(gauges, station, model_name,
                                  supervisor_restarts(settings.status_file), ttl_names)
        return Response(host_metrics.render(scraped), 200, content_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [_model_card(link)]})

    @app.get("/v1/models/<path:model>")
    async def model(model: str) -> Response:
        card = _model_card(link)
        if model != card["id"]:
            raise errors.model_not_found(model)
        return json_response(card)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = await _body()  # a slot is taken once the body is in, never while it arrives
        admission.admit(current(), g.tenant)
        req = openai_api.parse_chat(body)
        req = openai_api.with_session_header(req, request.headers.get(openai_api.SESSION_HEADER))
        return await complete(settings, link, memory, req, current(), g.tenant)

    @app.post("/v1/completions")
    async def completions() -> Response:
        body = await _body()  # a slot is taken once the body is in, never while it arrives
        admission.admit(current(), g.tenant)
        req = openai_api.parse_completion(body)
        req = openai_api.with_session_header(req, request.headers.get(openai_api.SESSION_HEADER))
        return await complete(settings, link, memory, req, current(), g.tenant)

    messages.register(app, settings, link, memory, admission, _body)
    tokenize_api.register(app, settings, link, _body)

    embeddings.register(app, settings, link, memory, admission, _body)
    responses_api.register(app, settings, link, memory, admission, _body)
    session_control.register(app, link)

    return app


async def _body() -> Any:
    data = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    g.body_read = True
    return json_body.decode(data)


def _body_unread() -> bool:
    has_body = (request.content_length or 0) > 0 or \
        "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    return has_body and not g.get("body_read", False)


def _model_card(link: StationLink) -> dict[str, Any]:
    try:
        link.current()
    except StationError as exc:
        raise errors.from_station(exc, "model") from None
    assert link.model_id is not None
    return {"id": link.model_id, "object": "model", "created": link.connected_at,
            "owned_by": "gnosis-daemon"}


def _bind(settings: Settings) -> str:
    host = settings.host
    return f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"


def serve(settings: Settings) -> int:
    """Run the host until SIGTERM/SIGINT, then drain in-flight requests and return 0."""
    configure_logging("host", settings.log_level, settings.log_format)
    try:
        keyring = load_keyring(settings)
    except KeyFileError as exc:
        log.error("host_bad_api_keys", error=str(exc))
        print(f"gnosis-daemon host: {exc}", file=sys.stderr)
        return 2
    _raise_file_limit()
    link = StationLink(settings.station_socket, max_frame_bytes=settings.max_frame_bytes,
                       hello_timeout_s=settings.health_timeout_s,
                       refusal_file=settings.station_refusal_file,
                       buffer_bytes=settings.stream_buffer_bytes)
    app = create_app(settings, link, keyring)
    metrics: Metrics = app.gnosis_metrics  # type: ignore[attr-defined]
    http_server.install(settings.stream_stall_timeout_s, metrics.stalled.inc)
    config = HypercornConfig()
    config.bind = [_bind(settings)]
    config.backlog = settings.listen_backlog
    # hypercorn's default 3 s would cut in-flight generations at shutdown.
    config.graceful_timeout = settings.drain_grace_s
    config.loglevel = "WARNING"
    trio.run(_serve, app, config, link, settings)
    return 0


def _raise_file_limit() -> None:
    """Every client connection is a file descriptor: a soft limit of 1024 would stall the
    accept loop under a burst, so take the hard limit (capped: an unlimited one is not a
    number the kernel's per-process tables can honour)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.warning("host_file_limit", soft=soft, hard=hard, error=str(exc))


async def _serve(app: QuartTrio, config: HypercornConfig, link: StationLink,
                 settings: Settings) -> None:
    # Install the handlers before binding, so a SIGTERM that arrives at once still drains.
    metrics: Metrics = app.gnosis_metrics  # type: ignore[attr-defined]
    draining = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

        async def shutdown_trigger() -> None:
            async for signum in signals:
                log.info("host_draining", signal=signal.Signals(signum).name,
                         grace_s=settings.drain_grace_s, inflight=metrics.inflight)
                draining.set()
                return

        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            async with trio.open_nursery() as http:
                binds = await http.start(partial(hypercorn_serve, app, config,
                                                 shutdown_trigger=shutdown_trigger))
                log.info("host_listening", binds=binds, pid=os.getpid(),
                         station_socket=str(settings.station_socket))
                await draining.wait()
                # hypercorn has stopped accepting and lets in-flight requests finish within
                # graceful_timeout, but an idle keep-alive connection also holds it until
                # that deadline: leave as soon as no request is in flight.
                with trio.move_on_after(settings.drain_grace_s):
                    while metrics.inflight > 0:
                        await trio.sleep(_DRAIN_POLL_S)
                http.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    log.info("host_stopped", uptime_s=round(time.monotonic() - _STARTED, 3),
             inflight=metrics.inflight)


_STARTED = time.monotonic()
