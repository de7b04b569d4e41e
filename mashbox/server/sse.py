"""Server-sent events: the response that sends a protocol's frames (``mashbox.api.frames``).

``EventStream`` differs from Litestar's ``Stream`` in two ways the server needs: a write the
client does not take within ``idle_s`` ends the stream, and ``on_close`` runs once however the
stream ends (done, client gone, client idle), so that the request's slot is always freed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from anyio import CancelScope, create_task_group, fail_after
from litestar import Request
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Message, Receive, Send

log = logging.getLogger("mashbox.server")

HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class EventStream(Stream):
    """A ``text/event-stream`` answer that stops when its client reads nothing for ``idle_s``."""

    def __init__(
        self, frames: AsyncIterator[bytes], *, idle_s: float, on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        super().__init__(frames, media_type="text/event-stream", headers={**HEADERS, **headers})
        self.idle_s = idle_s
        self.on_close = on_close

    def to_asgi_response(self, app: Any, request: Request, **kwargs: Any) -> ASGIResponse:
        return _TimedStream(self, str(request.scope.get("state", {}).get("request_id", "")))


class _TimedStream(ASGIStreamingResponse):
    def __init__(self, stream: EventStream, request_id: str) -> None:
        super().__init__(iterator=stream.iterator, headers=stream.headers, media_type=stream.media_type)
        self._idle_s = stream.idle_s
        self._on_close = stream.on_close
        self._request_id = request_id

    async def send_body(self, send: Send, receive: Receive) -> None:
        async with create_task_group() as group:
            group.start_soon(self._send_all, send, group.cancel_scope)
            await self._listen_for_disconnect(cancel_scope=group.cancel_scope, receive=receive)

    async def _send_all(self, send: Send, scope: CancelScope) -> None:
        async def timed(message: Message) -> None:
            with fail_after(self._idle_s):
                await send(message)

        try:
            await self._stream(timed)
        except TimeoutError:
            log.warning("%s: its client read nothing for %.0f s: its stream is closed and its request stopped",
                        self._request_id, self._idle_s)
        finally:
            with CancelScope(shield=True):
                await self._close()
            scope.cancel()

    async def _close(self) -> None:
        try:
            await self.iterator.aclose()  # type: ignore[union-attr]
        finally:
            await self._on_close()
