"""``WorkerBackend``: the engine in a worker process, started again if it dies.

The server process never imports torch. It talks to the worker with the
typed messages of ``worker_messages``: a sender thread writes commands, a
reader thread hands each reply to the channel of the request it answers.

When the worker dies, the backend reports ``loading``, counts a restart and
starts a new one (again, ``RELOADS`` times in a row, where that one dies while
loading: a model that loaded once can load again; a load that fails says why and
ends). Every stream it was answering ends with ``Finish(reason="error")``: the
HTTP layer re-sends, once, a request whose client has received nothing (commands
sent meanwhile wait for the new worker). A token count, which nothing above
re-sends, is sent again once.

A worker that says nothing for ``hang_s`` while it has requests to answer is taken
as hung (a deadlock, a stopped process: it sends the engine's stats after every
step, and each step's events) and killed, so that it is started again as above.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from mashbox.engine.channel import Channel
from mashbox.engine.events import Event, Finish
from mashbox.engine.info import ModelInfo
from mashbox.engine.load.catalog import served_id
from mashbox.engine.request import EngineRequest
from mashbox.engine.stats import EngineStats
from mashbox.errors import EngineClosedError
from mashbox.server.backend import STOPPING, Change, State, stopped
from mashbox.server.settings import HANG_S
from mashbox.server.worker_child import serve
from mashbox.server.worker_messages import (
    SETTLE_S,
    Abort,
    Halt,
    Command,
    Count,
    Counted,
    Error,
    EventMsg,
    Events,
    Failed,
    Ready,
    Reply,
    StatsSnapshot,
    Stop,
    Submit,
    error_finish,
)

log = logging.getLogger("mashbox.server")
RELOADS = 3  # a worker that dies while loading again (out of memory, say) is started again this many times in a row


@dataclass(slots=True, frozen=True)
class WorkerLost:
    """Put in a request's channel when its worker is gone (never crosses the pipe)."""

    error: str
    final: bool  # True: no new worker will answer (load failed, shutting down)


@dataclass(slots=True, eq=False)
class Incarnation:
    """One run of the worker process and its pipe."""

    process: BaseProcess
    conn: Connection
    outbox: queue.SimpleQueue[Command | None] = field(default_factory=queue.SimpleQueue)
    ready: bool = False
    failed: str | None = None
    hung: bool = False  # killed by the backend for saying nothing while it had requests to answer


@dataclass(slots=True, eq=False)
class Pending:
    """A command waiting for its replies."""

    command: Submit | Count
    channel: Channel[Reply | WorkerLost] = field(default_factory=Channel)
    retried: bool = False
    answered: bool = False  # the worker sent its last reply (a Finish, a count, an error): it owes nothing more


class WorkerBackend:
    """A ``Backend`` whose ``Engine(model, **engine_options)`` runs in a child process."""

    def __init__(self, model: str, engine_options: dict[str, Any], *, stop_timeout: float = 10.0,
                 hang_s: float = HANG_S) -> None:
        self._model = model
        self._served = served_id(model)  # its id before it loads
        self._options = dict(engine_options)
        self._stop_timeout = stop_timeout
        self._hang_s = hang_s  # 0: never taken as hung
        self._heard = time.monotonic()  # the worker's last reply, or the first request it was sent while it had none
        self.changes: queue.SimpleQueue[Change] = queue.SimpleQueue()
        self._spawn = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._pending: dict[int, Pending] = {}
        self._state: State = "loading"
        self._error: str | None = None
        self._refused = False
        self._info: ModelInfo | None = None
        self._threads = 0
        self._restarts = 0
        self._reloads = 0  # workers in a row that died while loading again, after the model had loaded
        self._closed = False
        self._stats: EngineStats | None = None
        self._lost: EngineStats | None = None  # the totals of the workers before this one
        with self._lock:
            self._worker = self._start()
        if hang_s:
            threading.Thread(target=self._watch, name="mashbox-worker-watch", daemon=True).start()

    # -- the Backend protocol ----------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def model_id(self) -> str:
        return self._info.id if self._info else self._served

    @property
    def info(self) -> ModelInfo | None:
        return self._info

    @property
    def worker_pid(self) -> int | None:
        return self._worker.process.pid

    @property
    def worker_restarts(self) -> int:
        return self._restarts

    @property
    def threads(self) -> int:
        """torch's intra-op threads in the worker (0 before it is ready)."""
        return self._threads

    async def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        pending = self._open(Submit(next(self._ids), request))
        done = False
        try:
            while not done:
                event = await self._next_event(pending)
                done = isinstance(event, Finish)
                stopped(event)
                yield event
        finally:
            self._forget(pending, abort=not done)

    def abort(self, request_id: str) -> None:
        """Stop the request of this ``EngineRequest.id``; its stream goes on to its Finish."""
        self._send(Halt(request_id))

    async def count(self, request: EngineRequest) -> int:
        pending = self._open(Count(next(self._ids), request))
        try:
            while True:
                match await pending.channel.aget():
                    case Counted(n=n):
                        return n
                    case Error() as error:
                        raise error.exception()
                    case WorkerLost() as lost if not self._retry(pending, lost):
                        raise EngineClosedError(lost.error)
        finally:
            self._forget(pending, abort=False)

    def stats(self) -> EngineStats | None:
        """The latest stats the worker sent (it sends them when they change; never waits), their
        totals counted from this server's start, over every worker it ran."""
        stats = self._stats
        return None if stats is None else stats.after(self._lost)

    def busy(self) -> int:
        """Requests sent to the worker and not yet finished (the stats may not show them yet)."""
        return len(self._pending)

    def wait(self, timeout: float | None = None) -> State:
        """Block until the worker is ready or failed (or ``timeout``); the state then."""
        with self._changed:
            self._changed.wait_for(lambda: self._state != "loading" or self._closed, timeout)
            return self._state

    def close(self) -> None:
        """Stop the worker: ``Stop``, which closes its engine, whose requests still running end with their
        usage so far (a task so stopped keeps its count) where that comes within ``SETTLE_S``; then terminate
        and kill after ``stop_timeout`` s (at once while it loads)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            self._changed.notify_all()
        worker.outbox.put(Stop())
        worker.outbox.put(None)
        if worker.ready:
            self._settle(time.monotonic() + SETTLE_S)
        with self._lock:
            self._lose_all(STOPPING, final=True)
        _stop(worker.process, self._stop_timeout if worker.ready else 0)  # a loading worker reads no Stop

    # -- requests ------------------------------------------------------------

    def _open(self, command: Submit | Count) -> Pending:
        with self._lock:
            if self._closed or self._state == "failed":  # no worker will answer: 503, as while loading
                raise EngineClosedError(self._error or STOPPING)
            if not self._owed():  # an idle worker says nothing: its silence counts from here
                self._heard = time.monotonic()
            pending = self._pending[command.request_id] = Pending(command)
            self._worker.outbox.put(command)
        return pending

    async def _next_event(self, pending: Pending) -> Event:
        while True:
            match await pending.channel.aget():
                case EventMsg(event=event):
                    return event
                case Error() as error:
                    raise error.exception()
                case WorkerLost(final=True) as lost:  # no worker will answer again (stopping): not to re-send
                    raise EngineClosedError(lost.error)
                case WorkerLost() as lost:
                    return error_finish(lost.error)

    def _retry(self, pending: Pending, lost: WorkerLost) -> bool:
        """Send a lost count to the new worker (once)."""
        if lost.final or pending.retried:
            return False
        with self._lock:
            pending.retried = True
            self._worker.outbox.put(pending.command)
        return True

    def _settle(self, deadline: float) -> None:
        """Wait until the worker has sent every request's last reply, or until ``deadline``."""
        while time.monotonic() < deadline:
            with self._lock:
                if not self._owed():
                    return
            time.sleep(0.01)

    def _forget(self, pending: Pending, abort: bool) -> None:
        with self._lock:
            self._pending.pop(pending.command.request_id, None)
            if abort and not self._closed:
                self._worker.outbox.put(Abort(pending.command.request_id))

    def _send(self, command: Command) -> None:
        with self._lock:
            self._worker.outbox.put(command)

    def _lose_all(self, error: str, final: bool) -> None:
        for pending in self._pending.values():
            pending.channel.put(WorkerLost(error, final))

    # -- the worker process ----------------------------------------------------

    def _start(self) -> Incarnation:
        """Start a worker process (lock held) with its reader and sender threads."""
        conn, child_conn = self._spawn.Pipe()
        process = self._spawn.Process(target=serve, args=(child_conn, self._model, self._options, os.getpid()),
                                      name="mashbox-worker", daemon=True)
        process.start()
        child_conn.close()  # so that the worker's death reads as EOF here
        worker = Incarnation(process, conn)
        threading.Thread(target=self._read, args=(worker,), name="mashbox-worker-read", daemon=True).start()
        threading.Thread(target=self._write, args=(worker,), name="mashbox-worker-write", daemon=True).start()
        self._state = "loading"
        return worker

    def _write(self, worker: Incarnation) -> None:
        while (command := worker.outbox.get()) is not None:
            try:
                worker.conn.send(command)
            except OSError:  # the worker is gone; the reader sees EOF
                return
            except Exception as exc:  # the command did not pickle: refuse it, keep the worker
                self._refuse(command, exc)

    def _refuse(self, command: Command, exc: Exception) -> None:
        request_id = getattr(command, "request_id", None)
        if request_id is not None and (pending := self._pending.get(request_id)) is not None:
            pending.channel.put(Error.of(request_id, exc))

    def _read(self, worker: Incarnation) -> None:
        try:
            while True:
                self._dispatch(worker, worker.conn.recv())
        except (EOFError, OSError):
            pass
        worker.outbox.put(None)
        worker.process.join(timeout=self._stop_timeout)
        self._exited(worker)

    def _dispatch(self, worker: Incarnation, reply: Reply) -> None:
        self._heard = time.monotonic()
        match reply:
            case Ready(info, threads):
                self._ready(worker, info, threads)
            case Failed(error, refused):
                self._failed(worker, error, refused)
            case StatsSnapshot(stats=stats):
                self._stats = stats
            case Events(messages):
                self._deliver(messages)
            case Error() | Counted():
                self._deliver([reply])

    def _deliver(self, replies: list[EventMsg] | list[Error | Counted]) -> None:
        """Queue each reply for its request (dropped if that has gone), then wake their readers at once."""
        held = []
        for reply in replies:
            if (pending := self._pending.get(reply.request_id)) is not None:
                last = not isinstance(reply, EventMsg) or isinstance(reply.event, Finish)
                pending.answered = pending.answered or last
                pending.channel.hold(reply)
                held.append(pending.channel)
        Channel.wake_all(held)

    def _ready(self, worker: Incarnation, info: ModelInfo, threads: int) -> None:
        with self._changed:
            if self._closed:  # loaded as the server stopped: nothing to announce
                return
            worker.ready, self._reloads = True, 0
            self._info, self._threads, self._state = info, threads, "ready"
            self._changed.notify_all()
            self._announce()
        log.info("worker %s ready: %s", worker.process.pid, info.id)

    def _failed(self, worker: Incarnation, error: str, refused: bool) -> None:
        with self._changed:
            worker.failed = self._error = error
            self._refused = refused
            self._state = "failed"
            self._changed.notify_all()
            self._announce()

    def _exited(self, worker: Incarnation) -> None:
        """The worker's pipe closed: fail, or start a new worker and retry requests."""
        with self._changed:
            if self._closed or worker is not self._worker:
                return
            again = not worker.ready and self._info is not None and self._reloads < RELOADS  # it loaded before
            if worker.failed or not (worker.ready or again):
                self._error = worker.failed or f"the worker {_exit(worker.process.exitcode)} while loading"
                self._state = "failed"
                self._lose_all(self._error, final=True)
            else:
                how = "was killed as hung" if worker.hung else _exit(worker.process.exitcode)
                log.warning("worker %s %s; starting it again", worker.process.pid, how)
                self._reloads += again
                self._restarts += 1
                self._lost, self._stats = self.stats() or self._lost, None
                self._worker = self._start()
                self._lose_all("worker restarted", final=False)
            self._changed.notify_all()
            self._announce()

    def _watch(self) -> None:
        """Kill a ready worker that has said nothing for ``hang_s`` with requests to answer (its reader then
        sees it gone, and a new one starts); checked ten times in that span. A check that comes late (the
        server stopped too: Ctrl-Z, then fg) starts the worker's span anew: it was stopped with it."""
        every = self._hang_s / 10
        while not self._closed:
            slept = time.monotonic()
            time.sleep(every)
            with self._lock:
                if time.monotonic() - slept > 2 * every + 1.0:
                    self._heard = time.monotonic()
                worker, silent, owed = self._worker, time.monotonic() - self._heard, self._owed()
                hung = worker.ready and owed and silent > self._hang_s and not self._closed
            if hung and worker.process.is_alive():
                log.error("worker %s has said nothing for %.0f s with %d requests to answer: taken as hung (stopped, "
                          "or deadlocked), killed and started again (--hang-timeout)", worker.process.pid, silent, owed)
                worker.hung = True
                worker.process.kill()
                self._heard = time.monotonic()  # said once; the new worker's silence counts anew

    def _owed(self) -> int:
        """Requests sent to the worker whose last reply has not come (one whose client reads slowly owes none)."""
        return sum(not pending.answered for pending in self._pending.values())

    def _announce(self) -> None:
        """Queue the state as it is now (lock held): every change reaches the terminal."""
        self.changes.put(Change(self._state, self._restarts, self._error, self._info, self._refused))


def _exit(code: int | None) -> str:
    """How a worker process ended, in words (a negative exit code is the signal that killed it)."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exited with code {code}"


def _stop(process: BaseProcess, timeout: float) -> None:
    """Wait ``timeout`` s for the worker to end after Stop, then kill it (it ignores SIGTERM: see
    ``worker_child.serve``)."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
