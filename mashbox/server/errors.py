"""Errors as each protocol shapes them, and the exception handlers that answer with them.

Routes under ``/v1/messages`` answer in Anthropic's shape, every other path in OpenAI's.
Nothing a client sends becomes a 500: only a failure on the device or a bug does, and is logged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, InternalServerException, SerializationException

from mashbox.errors import (
    ContextLengthError,
    EngineClosedError,
    InvalidRequestError,
    ModelNotFoundError,
    NotReadyError,
    StorageError,
)
from mashbox.server.admission import QueueFull

if TYPE_CHECKING:
    from mashbox.server.metrics import Metrics

log = logging.getLogger("mashbox.server")

OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
                500: "server_error", 502: "server_error", 503: "server_error", 504: "server_error"}
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 502: "api_error",
                   504: "api_error", 529: "overloaded_error"}
OVERLOADED = 529
MAX_BODY = 10_000_000  # bytes of a request body the server reads (Litestar's default, said in its 413)
SLASHES = re.compile("/{2,}")


class ApiError(Exception):
    """An answer other than 200, with what the error body and headers need."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        retry_after: int | None = None, overloaded: bool = False, anthropic_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.anthropic_message = anthropic_message  # where Anthropic's wording differs (agents match it)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.overloaded = overloaded or status == 503


RPC_CODES = {400: -32602, 401: -32001, 403: -32003, 404: -32004, 405: -32601, 409: -32009, 415: -32600,
             429: -32029, 500: -32603, 503: -32503}  # JSON-RPC error codes of the task routes
NOT_JSON = "invalid_json"  # the code of a body that does not parse: JSON-RPC's parse error, -32700


def is_task(path: str) -> bool:
    return path.removeprefix("/v1").split("/")[1:2] == ["tasks"]


def is_anthropic(path: str) -> bool:
    path = SLASHES.sub("/", path)  # as the router reads it: //v1//messages is /v1/messages
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def answer(path: str, error: ApiError, request_id: str | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, body and headers of ``error`` in the shape of the route at ``path``."""
    headers = {} if error.retry_after is None else {"retry-after": str(error.retry_after)}
    if error.status == 409:  # a state that a retry does not change (the SDKs retry a 409 unless told not to)
        headers["x-should-retry"] = "false"
    if is_task(path):
        data = {"type": OPENAI_TYPES.get(error.status, "invalid_request_error"), "param": error.param, "code": error.code}
        code = -32700 if error.code == NOT_JSON else RPC_CODES.get(error.status, -32000)
        rpc = {"code": code, "message": error.message, "data": data}
        return error.status, {"jsonrpc": "2.0", "id": request_id, "error": rpc}, headers
    if not is_anthropic(path):
        kind = OPENAI_TYPES.get(error.status, "invalid_request_error")
        body = {"message": error.message, "type": kind, "param": error.param, "code": error.code}
        return error.status, {"error": body}, headers
    status = OVERLOADED if error.overloaded else error.status
    if error.status == 503:  # not ready (loading, or a worker starting again): the SDKs retry
        headers["x-should-retry"] = "true"
    message = error.anthropic_message or (f"{error.param}: {error.message}" if error.param else error.message)
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}, headers


def api_error(exc: Exception, retry_after: int, body: bytes = b"", request_id: str | None = None) -> ApiError:
    """The answer an exception raised while handling request ``request_id`` deserves."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextLengthError):  # the code and wording agents look for to compact their history (a
        # prompt may take all the context but the one token its answer needs)
        return ApiError(400, exc.message, param=exc.param, code="context_length_exceeded",
                        anthropic_message=f"prompt is too long: {exc.tokens} tokens > {exc.ctx - 1} maximum")
    if isinstance(exc, ModelNotFoundError):
        return ApiError(404, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, exc.message, param=exc.param or None, code=exc.code)
    if isinstance(exc, (NotReadyError, EngineClosedError)):  # loading, restarting, or stopping: ask elsewhere
        return ApiError(503, str(exc), retry_after=retry_after)
    if isinstance(exc, QueueFull):
        return ApiError(429, exc.message, retry_after=exc.retry_after, overloaded=exc.scope == "server")
    if isinstance(exc, HTTPException):
        if exc.status_code >= 500:  # Litestar's own (not a client that left: the handler says that apart)
            log.error("%s failed: %s", request_id, exc.detail, exc_info=exc)
        return _body_error(exc, body) or ApiError(exc.status_code, _detail(exc))
    if isinstance(exc, StorageError):
        log.error("%s", exc)
        return ApiError(500, str(exc))
    log.error("%s failed: unexpected error", request_id, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}")


_HIGH, _LOW = rb"\\u[dD][89abAB][0-9a-fA-F]{2}", rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
BOM = b"\xef\xbb\xbf"
LONE_SURROGATE = re.compile(_HIGH + rb"(?!" + _LOW + rb")|(?<!" + _HIGH + rb")" + _LOW)  # half of a pair, alone


def _lone_surrogate(body: bytes) -> re.Match[bytes] | None:
    """The first escape of half a surrogate pair, alone, that is an escape: not ``\\\\ud800``, a backslash
    then the text ud800."""
    return next((m for m in LONE_SURROGATE.finditer(body) if _backslashes_before(body, m.start()) % 2 == 0), None)


def _not_utf8(body: bytes) -> str | None:
    """Where a body is not UTF-8, said: JSON over HTTP is UTF-8, whatever a content type's charset says."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        return (f"byte {err.start} (0x{body[err.start]:02X}) is not UTF-8, and JSON is read as UTF-8 whatever "
                "the content type's charset says (latin-1 text is sent UTF-8 encoded)")
    return None


def _backslashes_before(body: bytes, at: int) -> int:
    n = 0
    while n < at and body[at - n - 1] == ord("\\"):
        n += 1
    return n


def _body_error(exc: HTTPException, body: bytes) -> ApiError | None:
    """What is wrong with a body Litestar could not read as a JSON object (None: something else)."""
    if isinstance(exc.__cause__, SerializationException):  # msgspec: "Input data was truncated", "... (byte 7)"
        reason = _lower(str(exc.__cause__).removeprefix("JSON is malformed: "))
        where = "it ends in the middle of a value (input data was truncated)" if "truncated" in reason else reason
        if (lone := _lone_surrogate(body)) and ("truncated" in reason or "surrogate" in reason):
            where = (f"{lone[0][:6].decode()} at byte {lone.start()} is half of a UTF-16 surrogate pair without "
                     "the other half, which is not text")
        if "utf-8" in reason.lower():
            where = _not_utf8(body) or where
        if body.startswith(BOM):
            where = "it begins with a byte order mark (EF BB BF), which JSON sent over HTTP has not"
        elif body[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in body[:4]:
            where = "it is UTF-16 or UTF-32 (a byte order mark, or zero bytes between its first characters); send UTF-8"
        return ApiError(exc.status_code, f"the body is not valid JSON: {where}", code=NOT_JSON)
    for item in exc.extra if isinstance(exc.extra, list) else ():
        if isinstance(item, dict) and item.get("key") == "data" and item.get("source") == "body":
            if item.get("message") == "'data'":  # no body at all
                return ApiError(exc.status_code, "the body is not valid JSON: it is empty; send a JSON object",
                                code=NOT_JSON)
            return ApiError(exc.status_code, f"the body must be a JSON object: {_lower(str(item.get('message', '')))}")
    return None


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]


def _detail(exc: HTTPException) -> str:
    if exc.status_code == 405:
        return f"{exc.detail}; see GET /openapi.json for the methods each path takes"
    if exc.status_code == 404:
        return "no such route; see GET /openapi.json"
    if exc.status_code == 413:
        return f"the body is larger than {MAX_BODY // 10**6} MB, the most this server reads"
    extra = exc.extra if isinstance(exc.extra, list) and exc.extra else None
    return f"{exc.detail}: {extra[0].get('message', '')}" if extra and isinstance(extra[0], dict) else exc.detail


def client_left(exc: Exception) -> bool:
    """Whether ``exc`` is Litestar's word that the client went away while its body was being read."""
    return isinstance(exc, InternalServerException) and "disconnected" in str(exc.detail)


def log_answer(request_id: str | None, method: str, path: str, status: int, message: str) -> None:
    """The log's line for an error answer (a full queue's and a 500's apart)."""
    log.info("%s %s %r answered %d: %s", request_id, method, path, status, message)


def handler(retry_after: int, metrics: Metrics) -> Callable[[Request, Exception], Response]:
    """The one exception handler: every error answered in its route's shape, and counted in ``metrics``
    (a full queue's refusals by their scope too)."""

    def handle(request: Request, exc: Exception) -> Response:
        request_id = request.scope.get("state", {}).get("request_id")
        if client_left(exc):  # nobody to answer: neither an error answered nor a failure
            log.info("%s %s %r: the client left before its body was read whole", request_id, request.method,
                     request.url.path)
            return Response(b"", status_code=400)
        read = request._connection_state.body  # what a body that failed to decode was (Empty: none read)
        error = api_error(exc, retry_after, read if isinstance(read, bytes) else b"", request_id)
        status, body, headers = answer(request.url.path, error, request_id)
        if isinstance(exc, QueueFull):  # overload shows in the log and /metrics too
            log.warning("%s refused (%d): %s", request_id, status, exc.message)
            metrics.request_refused(exc.scope)
        elif error.status != 500:  # a 500 is logged where it is made, with its traceback
            log_answer(request_id, request.method, request.url.path, status, error.message)
        metrics.error_answered(status)
        if isinstance(exc, HTTPException) and exc.headers:  # Litestar's own: a 405's Allow
            headers = {**exc.headers, **headers}
        return Response(body, status_code=status, headers=headers)

    return handle
