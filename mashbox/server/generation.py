"""One generating request, from admission to its last byte.

A stream's headers and opening events go out as soon as the engine accepts the request (its
``Queued`` event: a bad request is still a 4xx; Anthropic's ``message_start``, which tells how the
prompt met the cache, once it has a slot); while it waits for a slot or prefills, a keep-alive goes
out every ``keepalive_s`` (Anthropic ``ping`` after ``message_start``; else an SSE comment), so the
client knows the server works and a client that leaves is seen at once.

A request whose client has received nothing is run again once when the device fails
(``Finish`` with reason ``error``): not streamed, until its answer is written; streamed, until its
first output is sent. After that a stream ends with the protocol's error event instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from litestar import Request, Response
from litestar.types import Receive

from mashbox.api.base import RequestModel, turns_in
from mashbox.api.frames import COMMENT
from mashbox.api.protocols import Protocol, prepare, start_usage
from mashbox.engine.events import Event, Finish, Queued, Started
from mashbox.engine.request import EngineRequest
from mashbox.errors import ContextLengthError, EngineClosedError, InvalidRequestError
from mashbox.server import security
from mashbox.server.context import Context
from mashbox.server.errors import ApiError
from mashbox.server.sse import EventStream

log = logging.getLogger("mashbox.server")
MAX_HEADER = 2048  # an ignored-fields header longer than this is cut
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "session_id")
MAX_SESSION = 200  # a session id longer than this is cut
SLOT_WAIT_S = 1.0  # a stream's headers wait this long for its prompt's slot, to say how it met the cache
T = TypeVar("T")


def refuse_overlong(ctx: Context, body: dict[str, Any], turns: str | None) -> None:
    """Refuse, before validating it, a conversation with more items than the context has tokens:
    every message takes at least one token; reasoning items may take none."""
    items, info = body.get(turns) if turns else None, ctx.backend.info
    if not isinstance(items, list) or info is None or len(items) <= info.ctx:
        return
    if (n := turns_in(items)) > info.ctx:
        raise ContextLengthError.of(turns, n, info.ctx, bound=f"{n} items of at least one each", hint="shorten it")


@dataclass(frozen=True, slots=True)
class Tag:
    """Who asked: what the log says of a request."""

    request_id: str
    session: str | None
    tenant: str

    @classmethod
    def of(cls, request: Request, req: RequestModel, ctx: Context) -> Tag:
        return cls(request_id(request), session_of(request.headers, req), security.tenant(ctx.settings, request.headers))


def session_of(headers: Mapping[str, str], req: RequestModel) -> str | None:
    """The client's session, as agents send it: a session header (mashbox's ``x-session-id``, Claude
    Code's, Codex's, Pi's; its bytes read as UTF-8), else OpenAI's ``prompt_cache_key``, else the
    ``session_id`` in Anthropic's ``metadata.user_id`` (Claude Code's JSON; before it, ``..._session_<id>``).
    Characters that are not printable are escaped (``\\n``, ``\\x1b``): the id is written in the log's line."""
    if found := next((headers[h] for h in SESSION_HEADERS if headers.get(h)), None):
        return _printable(found.encode("latin-1", "replace").decode("utf-8", "replace"))
    if key := getattr(req, "prompt_cache_key", None):
        return _printable(str(key))
    metadata = getattr(req, "metadata", None)
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and "_session_" in user and not user.startswith("{"):  # Claude Code 1's
        # user_<hash>_account_<uuid>_session_<uuid>
        return _printable(found) if (found := user.rpartition("_session_")[2]) else None
    if not isinstance(user, str) or len(user) > 4096 or not user.startswith("{"):
        return None
    try:
        found = json.loads(user).get("session_id")
    except (ValueError, AttributeError, RecursionError):  # not Claude Code's JSON object
        return None
    return _printable(str(found)) if isinstance(found, str | int) and found != "" else None


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:MAX_SESSION])[:MAX_SESSION]


def _field(value: str | None) -> str:
    """A session id as one field of a log line: quoted where it holds a space, a quote, a backslash or
    ``=`` (``abc tenant=admin`` forged a field; so did ``x\\" tenant=admin``) or reads as none (``-``)."""
    if value is None:
        return "-"
    quoted = any(c in value for c in ' "=\\') or value in ("-", "")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' if quoted else value


def request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))


def ignored_header(ignored: list[str]) -> dict[str, str]:
    if not ignored:
        return {}
    log.debug("ignored fields: %s", ", ".join(ignored))
    # control, non-ASCII and space characters escaped: a header value may not start or end with a space
    value = ", ".join(name.encode("unicode_escape").decode("ascii").replace(" ", "\\x20") for name in ignored)
    return {"x-mashbox-ignored-fields": value[:MAX_HEADER].rstrip(", ") + ("..." if len(value) > MAX_HEADER else "")}


async def generate(ctx: Context, protocol: Protocol, body: dict[str, Any], request: Request) -> Response:
    """Answer one request of ``protocol``: a JSON body, or its stream of events."""
    served = ctx.served()
    refuse_overlong(ctx, body, protocol.turns)
    prepared = prepare(protocol, body, served, ctx.settings.sampling)
    req, engine = prepared.req, prepared.engine
    tag = Tag.of(request, req, ctx)
    if ctx.settings.auth_required:  # one tenant's prompts never make another's cache hits (nor timings)
        engine = dataclasses.replace(engine, cache_salt=tag.tenant)
    if tag.session:  # its conversation's cached prefix outlives one-off requests
        engine = dataclasses.replace(engine, session=tag.session)
    run = Run(ctx, protocol, req, engine, tag)
    headers = ignored_header(prepared.ignored)
    if getattr(req, "stream", False):
        return await run.streamed(headers, request.receive) or Response(None, headers=headers)
    answer = await run.whole(request.receive)
    return Response(answer, headers={**headers, "x-mashbox-cache": run.cache()})


class Run:
    """The engine side of one request: its queue ticket, its events, its books."""

    def __init__(self, ctx: Context, protocol: Protocol, req: RequestModel, engine: EngineRequest, tag: Tag) -> None:
        self._ctx, self._protocol, self._req, self._engine, self._tag = ctx, protocol, req, engine, tag
        self._ticket = ctx.admission.admit(tag.tenant)
        self._t0 = time.monotonic()
        self._ttft: float | None = None
        self._resent = False
        self._finish: Finish | None = None
        self._started: Started | None = None
        self._slot = asyncio.Event()  # set at Started
        self._pending: asyncio.Future[Event] | None = None  # a stream's next event, asked for before it began
        self._events: AsyncIterator[Event] | None = None
        self._closed = False
        self._refused = False  # a bad request answered 400: not counted among those answered
        self._ended: str | None = None  # why the backend ended it, taking no more requests
        log.info("%s %s session=%s tenant=%s", tag.request_id, protocol.name, _field(tag.session), tag.tenant)

    async def whole(self, receive: Receive) -> dict[str, Any] | None:
        """The whole answer; None when the client left first (its request is then stopped)."""
        try:
            return await unless_gone(receive, self._answer())
        finally:
            await self.close()

    async def _answer(self) -> dict[str, Any]:
        while True:
            translator = self._translator()
            translator.feed(event := await self._open())
            while not isinstance(event, Finish):
                translator.feed(event := await self._next())
            if event.reason != "error":
                return translator.response().dump()
            if event.param is not None:  # its own input failed it (a grammar that could not go on): no use again
                raise InvalidRequestError(event.param, event.error or "cannot be followed")
            self._failed(event)

    async def streamed(self, headers: dict[str, str], receive: Receive) -> EventStream | None:
        """The stream of events; None when the client left before its headers (its ticket given back then,
        not when the first frame failed to go: a second later, counted as waiting meanwhile)."""
        try:
            first = await unless_gone(receive, self._first())
        except BaseException:
            await self.close()
            raise
        if first is None:
            await self.close()
            return None
        if self._started is not None:
            headers = {**headers, "x-mashbox-cache": self.cache()}
        return EventStream(self._frames(first), idle_s=self._ctx.settings.idle_timeout_s, on_close=self.close,
                           headers=headers)

    async def _first(self) -> Event:
        """The run's first event, and a queued one's slot for up to SLOT_WAIT_S (``_await_slot``)."""
        first = await self._accepted()
        if isinstance(first, Queued):
            await self._await_slot()
        return first

    async def _await_slot(self) -> None:
        """Ask for a queued run's next event and wait up to SLOT_WAIT_S for its slot (``Started``: how
        its prompt met the prefix cache is then known for the stream's headers)."""
        self._pending = asyncio.ensure_future(self._next())
        slot = asyncio.ensure_future(self._slot.wait())
        try:
            await asyncio.wait({self._pending, slot}, timeout=SLOT_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            slot.cancel()

    async def _accepted(self) -> Event:
        """The run's first event (``Queued``: the engine took it); a bad request raises here, and
        a run lost on the device first is sent again once."""
        while _lost(event := await self._open()):
            self._failed(event)
        return event

    async def close(self) -> None:
        """Stop the request if it still runs; count it. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            if (pending := self._pending) is not None:  # a stream closed before it took its first event
                pending.cancel()
                await asyncio.wait({pending})
                if not pending.cancelled():
                    pending.exception()  # retrieved: a stream's error is told in its frames, if at all
            await self._aclose_events()
        finally:
            self._ticket.done()
            self._record()

    async def _frames(self, first: Event) -> AsyncIterator[bytes]:
        translator = self._translator()
        if self._protocol.start_tells_cache and isinstance(first, Queued):
            async for comment in self._until_slot():
                yield comment
        yield self._encode(translator.start(start_usage(first, self._started)))
        try:
            event = first
            while isinstance(event, Queued) or _lost(event):  # no output yet: it may be sent again
                if lost := _lost(event):
                    self._failed(event)
                waiting = self._pending or asyncio.ensure_future(self._open() if lost else self._next())
                self._pending = None
                async with contextlib.aclosing(self._beats(waiting)) as beats:
                    async for beat in beats:
                        yield beat
                event = waiting.result()
            yield self._encode(translator.feed(event))
            while not isinstance(self._finish, Finish):
                if items := translator.feed(await self._next()):
                    yield self._encode(items)
        except StopAsyncIteration:
            yield self._encode(translator.error("the request ended early"))
        except ApiError as err:
            yield self._encode(translator.error(err.message))
        except EngineClosedError as err:  # stopping: said as a whole answer's 503 says it
            yield self._encode(translator.error(str(err)))
        except Exception as exc:
            log.exception("%s failed after its stream started", self._tag.request_id)
            yield self._encode(translator.error(f"{type(exc).__name__}: {exc}"))
        yield self._protocol.done

    async def _until_slot(self) -> AsyncIterator[bytes]:
        """SSE comments (which every client skips, before the first event too) every ``keepalive_s`` while
        the run waits for its slot, for a first frame that tells how its prompt met the cache."""
        slot = asyncio.ensure_future(self._slot.wait())
        try:
            while self._pending is not None and not self._slot.is_set() and not self._pending.done():
                keepalive = self._ctx.settings.keepalive_s
                if not (await asyncio.wait({slot, self._pending}, timeout=keepalive,
                                           return_when=asyncio.FIRST_COMPLETED))[0]:
                    yield COMMENT
        finally:
            slot.cancel()

    async def _beats(self, work: asyncio.Future[Event]) -> AsyncIterator[bytes]:
        """A keep-alive every ``keepalive_s`` until ``work`` is done; ``work`` is cancelled if the
        stream closes first."""
        try:
            while not (await asyncio.wait({work}, timeout=self._ctx.settings.keepalive_s))[0]:
                yield self._protocol.keepalive
        finally:
            if not work.done():
                work.cancel()
                await asyncio.wait({work})

    def _encode(self, items: list[Any]) -> bytes:
        return b"".join(self._protocol.frame(item.dump()) for item in items)

    def _translator(self) -> Any:
        model = getattr(self._req, "model", None) or self._ctx.backend.model_id
        return self._protocol.module.Translator(self._req, model)

    async def _open(self) -> Event:
        await self._aclose_events()
        self._finish = None
        self._events = self._ctx.backend.astream(self._engine)
        try:
            return await self._next()
        except InvalidRequestError as err:
            self._refused = True
            raise self._protocol.named(err) from None

    async def _next(self) -> Event:
        """The next event for the client: ``Queued``, then its output and ``Finish``. The engine's
        ``Started`` (a slot; else the first output) ends the ticket's wait."""
        assert self._events is not None
        try:
            event = await anext(self._events)
        except EngineClosedError as err:  # the server stopping (or its model gone): told, then logged as failed
            self._ended = str(err)
            raise
        if isinstance(event, Started):
            self._ticket.running()
            self._started = event
            self._slot.set()
            event = await anext(self._events)
        if isinstance(event, Queued):
            return event
        if not isinstance(event, Finish):
            self._ticket.running()
        if self._ttft is None:
            self._ttft = time.monotonic() - self._t0
        if isinstance(event, Finish):
            self._finish = event
        return event

    def cache(self) -> str:
        """How the prompt met the prefix cache: ``cached=N`` tokens, and where it left a longer
        cached prefix, ``; differs-at=K; part="tools"`` (the x-mashbox-cache header, the log)."""
        started = self._started
        note = f"cached={started.cached if started else 0}"
        if started is not None and started.differs is not None:
            note += f'; differs-at={started.differs}; part="{started.part or "prompt"}"'
        return note

    def _failed(self, finish: Finish) -> None:
        """Re-send the first time; the second time answer 500."""
        if self._resent:
            raise ApiError(500, f"the request failed on the device, and again when re-sent: {finish.error}")
        self._resent = True
        log.warning("%s failed on the device before any output (%s); re-sending it once",
                    self._tag.request_id, finish.error)
        self._ttft = None

    async def _aclose_events(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            await events.aclose()  # type: ignore[attr-defined]

    def _record(self) -> None:
        finish, e2e = self._finish, time.monotonic() - self._t0
        if self._refused:  # its 400 is logged with the answer (errors.handler)
            return
        if finish is None and self._ended is not None:
            log.info("%s failed after %.2f s: %s", self._tag.request_id, e2e, self._ended)
            self._ctx.metrics.request_finished(self._protocol.name, "error", None, self._ttft, e2e)
            return
        if finish is None:
            log.info("%s stopped before it finished, after %.2f s", self._tag.request_id, e2e)
            self._ctx.metrics.request_finished(self._protocol.name, "abort", None, self._ttft, e2e)
            return
        usage = finish.usage
        if finish.reason == "error" and not usage.total_tokens:  # ended for it (its worker lost, the server
            # stopping): its counts went with the worker
            log.info("%s failed after %.2f s: %s", self._tag.request_id, e2e, finish.error)
        else:
            log.info("%s finished: %s, %d prompt + %d new tokens, %.2f s; prefix cache: %s", self._tag.request_id,
                     finish.reason, usage.prompt_tokens, usage.completion_tokens, e2e, self.cache())
        self._ctx.metrics.request_finished(self._protocol.name, finish, None, self._ttft, e2e)


def _lost(event: Event) -> bool:
    """A run that failed on the device (its worker died): it may be sent again."""
    return isinstance(event, Finish) and event.reason == "error" and event.param is None


async def unless_gone(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """The result of ``work``; None, with ``work`` cancelled, when the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return None if task.cancelled() else task.result()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
