"""An HTTP connection: uvicorn's h11 protocol with a deadline on reading each request, a cap on how many, and
no upgrade to another protocol.

uvicorn times out only the wait between requests (keep-alive): a client that sent part of a request's
headers or body, or nothing at all, held its connection (a file descriptor) for as long as it liked,
before any key was checked. Here a request must be read whole within ``read_s`` of the connection's
start or of the answer before it; a connection still reading then is closed. And connections past what
the process's file descriptors allow (less ``RESERVE`` for its own files) are closed as they come: at the
limit, every accept failed (a traceback each, ~5 MB/s of log) and no client was answered until some left.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("mashbox.server")


RESERVE = 128  # file descriptors kept for the server's own files: the model, the worker's pipes, caches, the log
SAY_EVERY_S = 10.0


class Seldom:
    """Whether a warning that may come thousands of times a second is due: once every ``every_s`` seconds."""

    def __init__(self, every_s: float = SAY_EVERY_S) -> None:
        self.every_s = every_s
        self.said = -every_s

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.said <= self.every_s:
            return False
        self.said = now
        return True


def accepts_said_seldom(seldom: Seldom) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event loop's exception handler that says an accept that failed for want of file descriptors when
    ``seldom`` lets it, in one line: asyncio's loop goes on trying the accept up to its backlog (2048) times at
    each wake-up, and said each with its traceback (36 MB of log in 7 s under bursts of connections). Any other
    error goes to the loop's default handler."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
        elif seldom.due():
            log.warning("a connection could not be accepted (%s): the process is out of file descriptors "
                        "(ulimit -n); said at most every %.0f s", context.get("exception"), seldom.every_s)

    return handle


class Connection(H11Protocol):
    read_s = 60.0  # a 10 MB body (the largest taken) needs 170 kB/s
    refusals = Seldom()  # connections past the most, said in the log (one server a process)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        most = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - RESERVE
        if len(self.connections) > most:
            self._refuse(most)
            return
        self._arm()

    def _refuse(self, most: int) -> None:
        if self.refusals.due():
            log.warning("closing new connections: %d are open, the most this process's file descriptors allow "
                        "(ulimit -n, less %d)", most, RESERVE)
        self.transport.close()

    def _should_upgrade(self) -> bool:
        """Never: a request asking to change protocols (h2c, as ``curl --http2`` asks; a websocket) is answered in
        HTTP/1.1, as RFC 9110 lets a server (uvicorn logged two warnings for each, naming a library to install;
        with that library installed, a websocket one was a bare 403)."""
        return False

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request on this connection is read from now

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.read_s, self._read_or_close)

    def _reading(self) -> bool:
        """Whether a request is still being read: none begun since the last answer, or its body unfinished
        and nothing answered yet."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started)

    def _read_or_close(self) -> None:
        if self._reading() and not self.transport.is_closing():
            log.info("closed a connection from %s that sent no whole request in %.0f s",
                     "%s:%d" % self.client if self.client else "?", self.read_s)
            self.transport.close()
