"""What runs before routing, for every request: its id, the security checks, and HEAD.

It wraps the Litestar router so that unknown paths, wrong methods and refusals get the same
``x-request-id`` header and error shapes as the routes themselves. HEAD is a ready check on every
path (Claude Code's first call is ``HEAD /``): 200 when the model is ready, 503 while it loads.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from litestar.datastructures import Headers
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from mashbox.server import security
from mashbox.server.context import Context
from mashbox.server.errors import ApiError, answer, log_answer


class Gate:
    def __init__(self, app: ASGIApp, ctx: Context) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = origin_form(scope)
        method, path, headers = scope["method"], scope["path"], Headers.from_scope(scope)
        request_id = adopted(headers.get("x-request-id")) or "req_" + uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id  # type: ignore[typeddict-item]
        origin = security.allowed_origin(self.ctx.settings, headers)
        send = _tagged(send, request_id, cors(origin))
        if origin is not None and method == "OPTIONS" and "access-control-request-method" in headers:
            await _reply(send, 204, None, PREFLIGHT)  # a browser asks first; the answer names what it may send
            return
        server = scope.get("server")
        framing = unframed(scope, headers)
        refusal = framing or security.check(self.ctx.settings, method, path, headers, server[0] if server else None)
        if refusal is not None:
            status, body, headers = answer(path, ApiError(refusal.status, refusal.message), request_id)
            if status == 401:  # RFC 9110: a 401 names the scheme it asks for
                headers = {**headers, "www-authenticate": 'Bearer realm="mashbox"'}
            if framing:  # what follows on the connection cannot be told from this request's body
                headers = {**headers, "connection": "close"}
            log_answer(request_id, method, path, status, refusal.message)
            self.ctx.metrics.error_answered(status)
            await _reply(send, status, None if method == "HEAD" else body, headers)
        elif method == "HEAD":
            ready = self.ctx.backend.state == "ready"
            await _reply(send, 200 if ready else 503, None, {} if ready else self._retry_after())
        else:
            await self.app(scope, receive, send)

    def _retry_after(self) -> dict[str, str]:
        return {"retry-after": str(self.ctx.settings.retry_after_s)}


SENT_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
ABSOLUTE = re.compile(rb"https?://([^/?#]*)(/.*)?", re.IGNORECASE | re.DOTALL)


def unframed(scope: Scope, headers: Headers) -> security.Refusal | None:
    """A request whose framing RFC 9112 calls faulty (then answered, and its connection closed): a version other
    than HTTP/1.x (h2c's ``PRI *`` preface was taken for a request, a 404), or both a Content-Length and a
    Transfer-Encoding (where a proxy reads one and the server the other, a request is smuggled)."""
    if scope.get("http_version") not in ("1.0", "1.1"):
        return security.Refusal(505, f"HTTP/{scope.get('http_version')} is not spoken here: send HTTP/1.1",
                                "invalid_request_error")
    if "transfer-encoding" in headers and ("content-length" in headers or scope.get("http_version") == "1.0"):
        return security.Refusal(400, "Transfer-Encoding with Content-Length, or in HTTP/1.0: the body's length is "
                                     "ambiguous; send one of them", "invalid_request_error")
    return None


def origin_form(scope: Scope) -> Scope:
    """``scope``, where its target is in absolute form (``GET http://127.0.0.1:8000/health``, as to a proxy), as
    RFC 9112 has an origin server take it: routed by its path, its Host the target's (it was a 404)."""
    found = ABSOLUTE.fullmatch(scope.get("raw_path") or b"")
    if found is None:
        return scope
    authority, raw = found.group(1), found.group(2) or b"/"
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"host"]
    path = scope["path"].split("://", 1)[1]
    return {**scope, "raw_path": raw, "path": path[path.find("/"):] if "/" in path else "/",  # type: ignore[typeddict-item]
            "headers": [(b"host", authority), *headers]}


def adopted(sent: str | None) -> str | None:
    """A client's own ``X-Request-Id`` (a proxy's, to follow a request through both logs), where it is
    a plain token: anything else (spaces, quotes, control characters: a forged log field) gets the
    server's own."""
    return sent if sent is not None and SENT_ID.fullmatch(sent) else None


PREFLIGHT = {"access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
             "access-control-allow-headers": "*, authorization", "access-control-max-age": "600"}


def cors(origin: str | None) -> list[tuple[bytes, bytes]]:
    """The CORS headers every answer to an allowed origin carries (none for others)."""
    if origin is None:
        return []
    return [(b"access-control-allow-origin", origin.encode()), (b"vary", b"origin"),
            (b"access-control-expose-headers", b"x-request-id, request-id, retry-after, x-mashbox-ignored-fields, x-mashbox-cache")]


def _tagged(send: Send, request_id: str, extra: list[tuple[bytes, bytes]]) -> Send:
    async def tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            tag = request_id.encode()  # under both names: OpenAI's SDKs read x-request-id, Anthropic's request-id
            message["headers"] = [*message.get("headers", ()), (b"x-request-id", tag), (b"request-id", tag), *extra]
        await send(message)

    return tagged


async def _reply(send: Send, status: int, body: dict[str, Any] | None, headers: dict[str, str]) -> None:
    content = b"" if body is None else json.dumps(body).encode()
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    if body is not None:
        raw += [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content, "more_body": False})
