"""OpenAI-shaped API errors, and the map from station error codes to HTTP.

Every error the host answers has OpenAI's body, so the official clients raise the right
exception class (``BadRequestError``, ``NotFoundError``, ``InternalServerError``...)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

A 500 never carries an internal message (a station exception, a traceback's text): the
client gets ``Internal server error (request id <id>).`` and the detail goes to the host's
log line with the same request id (``for_client``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gnosis_daemon.client import StationError, StreamOverflow
from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode
from host.station_link import StationRefused

log = get_logger("host.errors")

INVALID_REQUEST = "invalid_request_error"
SERVICE_UNAVAILABLE = "service_unavailable"
SERVER_ERROR = "server_error"

# Seconds a client should wait before retrying a 503: a station restart or a full KV pool
# usually clears within a second, and OpenAI clients honour Retry-After.
RETRY_AFTER_S = 1


@dataclass(eq=False)
class ApiError(Exception):
    """An error answered to the HTTP client; ``body()`` is OpenAI's error object."""

    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # What went wrong inside, for the log only (never sent to the client).
    detail: str | None = None

    def __post_init__(self) -> None:
        assert 400 <= self.status < 600, self.status
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def invalid_type(param: str, expected: str, value: Any) -> ApiError:
    return invalid(f"Invalid type for '{param}': expected {expected}, but got "
                   f"{_json_type(value)} instead.", param, "invalid_type")


def invalid_value(param: str, message: str) -> ApiError:
    return invalid(f"Invalid '{param}': {message}", param, "invalid_value")


def missing(param: str) -> ApiError:
    return invalid(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def unsupported(param: str, message: str) -> ApiError:
    return invalid(f"Unsupported value: '{param}' {message}", param, "unsupported_value")


def malformed_json() -> ApiError:
    return invalid("We could not parse the JSON body of your request. The API expects a JSON "
                   "object as the body (Content-Type: application/json).")


def timed_out(what: str, timeout_s: float) -> ApiError:
    """``what`` (``"The completion"``...) ran past ``request_timeout_s``: a 504."""
    return ApiError(504, f"{what} did not finish within {timeout_s:g} s.", SERVER_ERROR, None,
                    "timeout")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    INVALID_REQUEST, "model", "model_not_found")


def station_refused(refusal: dict[str, Any]) -> ApiError:
    """The station refused its model: a 503 naming the reason. Permanent until an operator
    acts, so no ``Retry-After`` (it would invite a retry loop), and ``x-should-retry: false``,
    which the official OpenAI clients honour instead of retrying a 503 on their own."""
    reason = refusal.get("message") or refusal.get("reason") or "no reason given"
    message = (f"The model station refused to serve its model: {reason}. This does not clear "
               f"by retrying; the operator must serve another model or a build that "
               f"implements it (see GET /health).")
    return ApiError(503, message, SERVICE_UNAVAILABLE, None, "station_refused",
                    {"x-should-retry": "false"})


def station_unavailable(detail: str = "") -> ApiError:
    message = "The model station is not available right now; retry shortly."
    if detail:
        message = f"{message} ({detail})"
    return ApiError(503, message, SERVICE_UNAVAILABLE, None, "station_unavailable",
                    {"Retry-After": str(RETRY_AFTER_S)})


def from_station(exc: StationError, prompt_param: str) -> ApiError:
    """Map a station error frame to the HTTP answer (``prompt_param``: messages or prompt)."""
    code = exc.code
    if isinstance(exc, StationRefused):
        return station_refused(exc.refusal)
    if code == "unavailable":
        return station_unavailable(exc.message)
    if code == ErrorCode.CONTEXT_OVERFLOW:
        return ApiError(400, exc.message or "The prompt is longer than the model's context.",
                        INVALID_REQUEST, prompt_param, "context_length_exceeded")
    if code == ErrorCode.BAD_REQUEST:
        # The host has checked every other field, so what the station refuses is the prompt.
        return ApiError(400, exc.message, INVALID_REQUEST, prompt_param, "invalid_value")
    if code in (ErrorCode.CAPACITY, ErrorCode.SHUTTING_DOWN):
        return ApiError(503, exc.message or "The server is busy; retry shortly.",
                        SERVICE_UNAVAILABLE, None, str(code), {"Retry-After": str(RETRY_AFTER_S)})
    if code == StreamOverflow.CODE:
        # Only a stream can fall behind: its client reads too slowly (stream_buffer_bytes).
        return ApiError(408, exc.message, INVALID_REQUEST, None, StreamOverflow.CODE)
    if code == ErrorCode.UNKNOWN_OP:
        return ApiError(503, f"The model station does not support this operation: {exc.message}",
                        SERVICE_UNAVAILABLE, None, "station_unsupported",
                        {"Retry-After": str(RETRY_AFTER_S)})
    return internal(f"station error {code}: {exc.message}")


def internal(detail: str) -> ApiError:
    """A 500; ``detail`` is logged, never answered."""
    return ApiError(500, "Internal server error.", SERVER_ERROR, None, "internal_error",
                    detail=detail)


def for_client(exc: ApiError, request_id: str) -> ApiError:
    """What the client may see of ``exc``: a 500 becomes a generic message naming the request
    id, and its detail is logged under that id."""
    if exc.status != 500:
        return exc
    log.error("internal_error", request_id=request_id, detail=exc.detail or exc.message)
    return ApiError(500, f"Internal server error (request id {request_id}).", SERVER_ERROR,
                    None, "internal_error", dict(exc.headers))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
