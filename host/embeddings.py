"""``POST /v1/embeddings``: OpenAI's request and response shapes over the station's ``embed``.

``input`` is a string, an array of strings, an array of token ids, or an array of token-id
arrays. The station returns mean-pooled, normalized final hidden states as one float32
array; ``encoding_format: "base64"`` sends each vector as base64 of its little-endian
float32 bytes, the way OpenAI does. A station without ``embed`` (negotiated, or answering
``unknown_op``) gets a 501 with OpenAI's error body, never a crash.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import trio
from quart import Response, g

from gnosis_daemon.client import StationError, is_unknown_op
from gnosis_daemon.protocol import unpack_array
from gnosis_daemon.settings import Settings
from host import errors, sse
from host.errors import ApiError
from host.fields import as_object, check_known, is_int
from host.openai_api import (
    FRAME_OVERHEAD,
    MAX_TOKEN_ID,
    check_token_ids,
    frame_estimate,
)
from host.liquid_memory import LiquidMemory
from host.request_scope import Admission, current
from host.station_link import StationLink

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str | None
    station_args: dict[str, Any]  # {"texts": [...]} | {"tokens": [[...]]}
    count: int
    encoding_format: str  # float | base64


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) and t >= 0 for t in value)


def parse(body: Any) -> EmbeddingRequest:
    body = as_object(body)
    check_known(body, FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.invalid_type("model", "a string", model)
    if body.get("input") is None:
        raise errors.missing("input")
    value = body["input"]
    if isinstance(value, str):
        args: dict[str, Any] = {"texts": [value]}
    elif _token_list(value):
        args = {"tokens": [list(value)]}
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        args = {"texts": list(value)}
    elif isinstance(value, list) and value and all(_token_list(v) for v in value):
        args = {"tokens": [list(v) for v in value]}
    else:
        raise errors.invalid_type("input", "a string, an array of strings, an array of token "
                                  "ids or an array of token-id arrays", value)
    items = args.get("texts") or args.get("tokens") or []
    for ids in args.get("tokens") or ():
        check_token_ids(ids, MAX_TOKEN_ID + 1, "input")
    if any(isinstance(v, str) and not v for v in items):
        raise errors.invalid_value("input", "strings must not be empty.")
    if len(items) > MAX_INPUTS:
        raise errors.invalid_value("input", f"array too long. Expected an array with maximum "
                                   f"length {MAX_INPUTS}, but got an array with length "
                                   f"{len(items)} instead.")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise errors.invalid_value("encoding_format", f"value must be one of 'float', "
                                   f"'base64', but got {encoding!r}.")
    if body.get("dimensions") is not None:
        raise errors.unsupported("dimensions", "is not supported by this server.")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise errors.invalid_type("user", "a string", user)
    return EmbeddingRequest(model, args, len(items), encoding)


def check_fits(req: EmbeddingRequest, model: dict[str, Any], max_frame_bytes: int) -> None:
    """Refuse, without the station, token ids outside the vocabulary and an input whose
    ``embed`` frame would pass the station's ``max_frame_bytes`` (which would end the station
    connection for every tenant)."""
    vocab_size = model.get("vocab_size")
    token_lists = req.station_args.get("tokens") or []
    if isinstance(vocab_size, int):
        for ids in token_lists:
            check_token_ids(ids, vocab_size, "input")
    texts = req.station_args.get("texts") or []
    items = len(texts) + sum(len(ids) for ids in token_lists)
    if frame_estimate(texts, items, max_frame_bytes) + FRAME_OVERHEAD >= max_frame_bytes:
        raise errors.invalid_value("input", f"the input is too large to pass to this server's "
                                   f"model station (its frames hold at most {max_frame_bytes} "
                                   f"bytes).")


def not_supported(detail: str = "") -> ApiError:
    message = "The model station does not support embeddings (capability embed)."
    if detail:
        message = f"{message} ({detail})"
    return ApiError(501, message, errors.INVALID_REQUEST, None, "embeddings_not_supported")


def response(req: EmbeddingRequest, model: str, result: dict[str, Any]) -> dict[str, Any]:
    try:
        matrix = unpack_array(result["embeddings"])
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.internal(f"the model station sent a bad embeddings array: {exc}") from None
    if matrix.ndim != 2 or matrix.shape[0] != req.count:
        raise errors.internal(f"the model station sent embeddings of shape {matrix.shape} for "
                              f"{req.count} inputs")
    matrix = matrix.astype("<f4", copy=False)
    data = []
    for index, row in enumerate(matrix):
        vector: Any = (base64.b64encode(row.tobytes()).decode("ascii")
                       if req.encoding_format == "base64" else [float(x) for x in row])
        data.append({"object": "embedding", "index": index, "embedding": vector})
    prompt_tokens = int(sum(result.get("num_tokens") or ()))
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def register(app: Any, settings: Settings, link: StationLink, memory: LiquidMemory,
             admission: Admission, read_body: Callable[[], Awaitable[Any]]) -> None:
    """The route, on the host's app (``host.app.create_app``; ``read_body``: its JSON body
    reader, after which the request takes an in-flight slot)."""

    @app.post("/v1/embeddings")
    async def create_embeddings() -> Response:
        body = await read_body()  # a slot is taken once the body is in, never while it arrives
        admission.admit(current(), g.tenant)
        req = parse(body)
        try:
            conn = link.current()
        except StationError as exc:
            raise errors.from_station(exc, "input") from None
        model_id = link.model_id
        assert model_id is not None
        if req.model is not None and req.model != model_id:
            raise errors.model_not_found(req.model)
        if not memory.has("embed"):
            raise not_supported()
        check_fits(req, (link.hello or {}).get("model") or {}, link.max_frame_bytes)
        try:
            with trio.fail_after(settings.request_timeout_s):
                result = await conn.request("embed", req.station_args, rid=current().request_id)
        except StationError as exc:
            if is_unknown_op(exc):
                raise not_supported(exc.message) from None
            raise errors.from_station(exc, "input") from None
        except trio.TooSlowError:
            raise errors.timed_out("The embeddings", settings.request_timeout_s) from None
        return Response(sse.encode_json(response(req, model_id, result)), 200,
                        content_type="application/json")
