"""Tasks running on the server: each task's loop runs as an asyncio task of its own, over the
backend's ``astream`` (the worker process's engine), so that a client may follow its events,
cancel, pause or resume it from another request, and retrieve it later.

A task takes an admission ticket like any request (its tenant's allowance; 429 when spent) until
its first generation has a slot. Its events are kept in memory only while it runs; the task
object is saved at every change of status (``TaskStore``), on a thread of the store's own, one call
after another (the event loop never waits on the file; a read sees every save queued before it).
A client that goes away cancels the task it created, unless it was created with ``background: true``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Any, TypeVar

from mashbox.api.base import new_id
from mashbox.api.task_events import TaskLifecycleEvent
from mashbox.api.task_items import FINAL, CreateTask, RpcError, TaskObject
from mashbox.api.task_loop import GENERATION_FAILED, Action, TaskLoop, request_param
from mashbox.engine.events import Event, Finish, Queued, Started
from mashbox.engine.request import EngineRequest
from mashbox.errors import InvalidRequestError, StorageError
from mashbox.server.admission import Admission, Ticket
from mashbox.server.backend import Backend
from mashbox.server.errors import ApiError
from mashbox.server.metrics import Metrics
from mashbox.server.task_store import TaskStore

log = logging.getLogger("mashbox.server")
T = TypeVar("T")
ACT_TIMEOUT_S = 30.0
MAX_SWEEP_EVERY_S = 60.0  # old tasks expire this long after their time to live at most
STOP_WAIT_S = 8.0  # a stopping server waits this long at most for its tasks to end (its answers get 4 s, then end)
# what each action needs of a running task, and the statuses that show it took effect
NEEDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cancel": (frozenset({"created", "queued", "working", "paused"}), frozenset({"canceled"}) | FINAL),
    "pause": (frozenset({"working"}), frozenset({"paused"}) | FINAL),
    "resume": (frozenset({"paused"}), frozenset({"working"}) | FINAL),
}


class Live:
    """One running task: its loop, the events so far, and who waits on them."""

    def __init__(self, tenant: str, loop: TaskLoop, ticket: Ticket, background: bool) -> None:
        self.tenant, self.loop, self.ticket, self.background = tenant, loop, ticket, background
        self.events: list[dict[str, Any]] = []
        self.started = self.touched = time.monotonic()  # its start, and its last event
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.saved: Future[None] | None = None  # its first save (queued): the create answers once it is kept
        self.in_file = False  # whether a save of it succeeded
        self.refused = False  # its first save failed: its create was refused, so it is never saved
        self.finished = False
        self.runner: asyncio.Future[None] | None = None  # its loop's asyncio task (held: tasks are weakly kept)
        self._tick = asyncio.Event()

    @property
    def task(self) -> TaskObject:
        return self.loop.task

    def add(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self.touched = time.monotonic()
        self.wake()

    def wake(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def changed(self, timeout: float) -> bool:
        """Wait for the next event (or the end); False when ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._tick.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def follow(self, keepalive_s: float) -> AsyncIterator[dict[str, Any] | None]:
        """Every event from the first, then each as it comes; None after ``keepalive_s`` without one."""
        sent = 0
        while True:
            while sent < len(self.events):
                sent += 1
                yield self.events[sent - 1]
            if self.finished:
                return
            if not await self.changed(keepalive_s):
                yield None


class TaskRuns:
    def __init__(self, backend: Backend, admission: Admission, store: TaskStore, salted: bool,
                 metrics: Metrics) -> None:
        self._backend, self._admission, self.store, self._salted = backend, admission, store, salted
        self._metrics = metrics
        self._live: dict[tuple[str, str], Live] = {}
        self._claimed: set[tuple[str, str]] = set()  # ids being created: not yet live, maybe stored
        self._unsaved: dict[tuple[str, str], dict[str, Any]] = {}  # a task's last state the file did not take
        self.sweep_every_s = min(store.ttl_s / 2, MAX_SWEEP_EVERY_S)
        self._file = ThreadPoolExecutor(1, thread_name_prefix="mashbox-tasks-db")  # the store's calls, in order

    async def _stored(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call`` on the store's thread, awaited (behind every call queued before it)."""
        return await asyncio.wrap_future(self._file.submit(partial(call, *args, **kwargs)))

    def _save(self, live: Live) -> Future[None] | None:
        """Save the task as it is now on the store's thread without waiting; its future. A state the file
        does not take (locked by another program, a full disk) is logged, kept here as the task's, and
        saved again at each sweep: a task that ended is never left in the file as it was while it ran."""
        task = live.task.dump()
        try:
            return self._file.submit(self._kept, live.tenant, task, live)
        except RuntimeError:  # the server is stopping (its thread is gone): saved here
            self.store.save(live.tenant, task)
            return None

    def _kept(self, tenant: str, task: dict[str, Any], live: Live | None = None) -> None:
        key = (tenant, task["id"])
        if live is not None and live.refused:
            return
        try:
            self.store.save(tenant, task)
        except Exception as err:
            log.error("%s", err)
            if live is None or live.in_file:
                self._unsaved[key] = task
            else:  # its first save: the create answers with this error, so the task must not appear later
                live.refused = True
            raise
        self._unsaved.pop(key, None)  # saved in order: any state kept here is this one or older
        if live is not None:
            live.in_file = True

    def _saved_again(self) -> None:
        """Save the states the file did not take (on the store's thread); those it still refuses stay."""
        for (tenant, _), task in list(self._unsaved.items()):
            with suppress(Exception):
                self._kept(tenant, task)

    @asynccontextmanager
    async def sweeping(self) -> AsyncIterator[None]:
        """While the server runs (its lifespan): expire old tasks on a timer, not only when a
        request comes."""
        async def every() -> None:
            while True:
                await asyncio.sleep(self.sweep_every_s)
                try:
                    await self.sweep()
                except Exception:  # a locked or broken file: said, and tried again next time
                    log.exception("expiring old tasks failed")

        timer = asyncio.ensure_future(every())
        try:
            yield
        finally:
            timer.cancel()
            with suppress(asyncio.CancelledError):
                await timer
            await self._ended()
            await asyncio.to_thread(self._file.shutdown)  # the saves queued reach the file
            self.store.close()  # and its lock goes: the next server on the file is alone

    async def _ended(self) -> None:
        """The server is stopping: wait for the running tasks to end as their generations do (the
        backend ends those still running once the answers' time to end is up), so that each is saved
        as it ended, its output kept. A paused one waits for nothing: the next start fails it."""
        runners = [live.runner for live in self._live.values()
                   if live.runner is not None and live.task.status != "paused"]
        if runners:
            await asyncio.wait(runners, timeout=STOP_WAIT_S)

    async def start(self, req: CreateTask, tenant: str) -> Live:
        """Start a task; returns once the engine has taken its first generation (a request it
        refuses raises here, and leaves no task behind)."""
        await self.sweep()
        task_id = req.task_id or new_id("task_")
        key = (tenant, task_id)
        if key in self._live or key in self._claimed:  # claimed before the first wait: creates at once get one
            raise _taken(task_id)
        self._claimed.add(key)
        try:
            if await self._stored(self.store.get, tenant, task_id) is not None:
                raise _taken(task_id)
            if req.previous_task_id is not None and await self.find(tenant, req.previous_task_id, strict=False) is None:
                raise InvalidRequestError("previous_task_id", f"no task {req.previous_task_id!r} is known here")
        finally:
            self._claimed.discard(key)
        task = TaskObject(id=task_id, created_at=int(time.time()), session_id=req.session_id or "",
                          user_id=req.user_id or "", metadata=req.metadata or {}, previous_task_id=req.previous_task_id)
        loop = TaskLoop(req, task, self._counted, cache_salt=tenant if self._salted else "",
                        abort=self._backend.abort)
        live = Live(tenant, loop, self._admission.admit(tenant), bool(req.background))
        self._live[key] = live
        live.runner = asyncio.ensure_future(self._drive(live))
        await live.accepted
        try:
            if live.saved is not None:
                await asyncio.wrap_future(live.saved)
        except StorageError:  # not kept: no id handed out that a later look would not find
            live.runner.cancel()
            raise
        log.info("task %s started (tenant %s)", task_id, tenant)
        return live

    async def _counted(self, request: EngineRequest) -> AsyncIterator[Event]:
        """The backend's run of one of a task's generations, counted on /metrics as a route's request is
        (protocol ``tasks``)."""
        t0, ttft, finish = time.monotonic(), None, None
        try:
            async for event in self._backend.astream(request):
                if ttft is None and not isinstance(event, (Queued, Started)):
                    ttft = time.monotonic() - t0
                finish = event if isinstance(event, Finish) else None
                yield event
        finally:
            self._metrics.request_finished("tasks", finish or "abort", None, ttft, time.monotonic() - t0)

    async def _drive(self, live: Live) -> None:
        try:
            async for event in live.loop.run():
                self._on(live, event)
        except InvalidRequestError as err:
            self._fail(live, err.message, request_param(err, live.loop.req))
        except Exception as exc:
            log.exception("task %s failed", live.task.id)
            self._fail(live, f"{type(exc).__name__}: {exc}", exc)
        finally:
            live.ticket.done()
            live.finished = True
            self._live.pop((live.tenant, live.task.id), None)
            live.wake()
            task, error = live.task, live.task.error
            log.info("task %s ended %s after %.2f s%s", task.id, task.status, time.monotonic() - live.started,
                     f": {error.message}" if error is not None else "")

    def _on(self, live: Live, event: Any) -> None:
        if isinstance(event, TaskLifecycleEvent):
            if event.type == "task.working":
                live.ticket.running()
            if live.accepted.done():
                self._save(live)
            elif event.type == "task.queued":
                live.saved = self._save(live)
                live.accepted.set_result(None)
        live.add(event.dump())

    def _fail(self, live: Live, message: str, exc: Exception) -> None:
        if not live.accepted.done():
            live.accepted.set_exception(exc)
            return
        live.task.error = RpcError(code=GENERATION_FAILED, message=message)
        self._on(live, live.loop.status("failed"))

    async def find(self, tenant: str, task_id: str, strict: bool = True) -> dict[str, Any] | None:
        """The task as it is now (a running one from memory); 404 when ``strict`` and unknown.
        A strict look (a client's) expires what is old first, so none sees a task past its time."""
        if strict:
            await self.sweep()
        found = self._running(tenant, task_id) or await self._stored(self.store.get, tenant, task_id)
        if found is None and strict:
            raise ApiError(404, f"no task {task_id!r}", param="task_id", code="task_not_found")
        return found

    async def act(self, tenant: str, task_id: str, action: Action) -> dict[str, Any]:
        """Cancel, pause or resume a task; answers once the loop has done it."""
        found = await self.find(tenant, task_id)
        assert found is not None
        live = self._live.get((tenant, task_id))
        needs, shows = NEEDS[action]
        if live is None and action == "cancel" and found["status"] == "input-required":
            found = {**found, "status": "canceled"}  # waiting for its client, not running: canceled at once
            await self._stored(self.store.save, tenant, found)
            return found
        if live is None and found["status"] in needs:  # on another server that shares the file, or one that died
            raise ApiError(409, f"the task is {found['status']}, but not on this server: another server sharing this "
                                f"tasks file runs it ({action} it there), or stopped while it ran (DELETE removes it)",
                           param="task_id", code="invalid_task_state")
        if live is None or live.task.status not in needs:
            able = needs | ({"input-required"} if action == "cancel" else set())  # canceled above, when not live
            raise ApiError(409, f"the task is {found['status']}: only a task that is {' or '.join(sorted(able))} "
                                f"can be {'canceled' if action == 'cancel' else action + 'd'}",
                           param="task_id", code="invalid_task_state")
        live.loop.control.ask(action)
        deadline = time.monotonic() + ACT_TIMEOUT_S
        while live.task.status not in shows and not live.finished and time.monotonic() < deadline:
            await live.changed(deadline - time.monotonic())
        return live.task.dump()

    async def delete(self, tenant: str, task_id: str) -> dict[str, Any]:
        found = await self.find(tenant, task_id)
        assert found is not None
        if (tenant, task_id) in self._live:
            try:
                found = await self.act(tenant, task_id, "cancel")
            except ApiError as refused:  # it ended between the look and the cancel: deleted as it ended
                if refused.status != 409:
                    raise
                found = await self.find(tenant, task_id, strict=False) or found
        await self._stored(self.store.delete, tenant, task_id)
        self._unsaved.pop((tenant, task_id), None)
        return found

    async def page(self, tenant: str, limit: int, **filters: Any) -> list[dict[str, Any]]:
        await self.sweep()
        tasks = await self._stored(self.store.page, tenant, limit, **filters)
        return [self._running(tenant, t["id"]) or t for t in tasks]

    def _running(self, tenant: str, task_id: str) -> dict[str, Any] | None:
        """A running task as it is now, from memory (None if it is not running, or not yet accepted), or
        the last state of one that the file did not take."""
        live = self._live.get((tenant, task_id))
        if live is not None and live.accepted.done():
            return live.task.dump()
        return self._unsaved.get((tenant, task_id))

    async def sweep(self) -> None:
        """Save again what the file did not take; expire what is old; a running task paused that long, or
        with no event that long (a generation that stalled), is expired by its loop."""
        if self._unsaved:
            await self._stored(self._saved_again)
        for key in await self._stored(self.store.sweep, set(self._live)):
            live = self._live.get(key)
            if live is not None and (live.task.status == "paused"
                                     or time.monotonic() - live.touched > self.store.ttl_s):
                live.loop.control.ask("expire")

    def abandon(self, live: Live) -> None:
        """Its client went away: cancel it, unless it was created to run in the background."""
        if not live.finished and not live.background:
            live.loop.control.ask("cancel")


def _taken(task_id: str) -> ApiError:
    return ApiError(409, f"a task with id {task_id!r} exists; choose another task_id", param="task_id")
