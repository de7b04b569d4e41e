"""The worker process: one engine (the ``Runtime``: no protocol is imported here, so it is ready
sooner), fed by typed commands over a pipe.

The main thread reads commands in order. Each submitted request streams on
one asyncio loop in a pump thread (``Runtime.astream``), which sends the
events back as they come, all those ready at once (one engine step's, for
every stream) in one message; an ``Abort`` cancels that stream, which frees the
request's slot at the engine's next step. A stats thread sends the engine's
stats snapshot whenever it changed, so the server never asks and waits.
torch is imported here only.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent import futures
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from mashbox.engine.events import Event, Finish
from mashbox.engine.model.openmp import prefer_passive_wait
from mashbox.engine.request import EngineRequest
from mashbox.errors import ConfigError, EngineClosedError, MashboxError
from mashbox.server import logs
from mashbox.server.worker_messages import (
    SETTLE_S,
    STATS_EVERY,
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

if TYPE_CHECKING:
    from mashbox.engine.runtime import Runtime


def serve(conn: Connection, model: str, options: dict[str, Any], server: int) -> None:
    """The worker process's entry point: load the model, then answer commands."""
    # Ctrl-C, or a stop sent to the whole process group (systemd, timeout), reaches the server as well: it
    # lets its answers end, then sends Stop
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    threading.Thread(target=_orphaned, args=(server,), name="mashbox-parent", daemon=True).start()  # its pid from
    # the server itself: one killed while this process started (seconds of imports) was not seen
    logs.to_stderr()  # the engine's notes (a format widened at load, packed weights saved) beside the server's
    engine = _load(conn, model, options)
    if engine is not None:
        Worker(engine, conn).run()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skips tearing down torch's modules, which takes seconds; nothing is left to save


def _orphaned(server: int) -> None:
    """End the worker once its server is gone (killed with SIGKILL, it sends no Stop and its pipe is not
    read while the model loads): a load would go on for minutes, orphaned."""
    while os.getppid() == server:
        time.sleep(1.0)
    os._exit(1)


def _load(conn: Connection, model: str, options: dict[str, Any]) -> Runtime | None:
    """The engine, or None once the failure was reported. Loading makes almost no garbage, but every
    collection during it walks the ~250k objects torch and the model are made of again (~0.2 s of the
    start); so none runs until the engine is built, and what it is built of is then frozen: it lives as
    long as the worker, and a full collection while serving (~150 ms with the engine thread held)
    no longer walks it."""
    gc.disable()
    try:
        prefer_passive_wait()  # before torch loads OpenMP
        import torch

        from mashbox.engine.runtime import Runtime

        engine = Runtime(model, **options)
    except ConfigError as exc:  # a setting refused: the message says which and what to do
        conn.send(Failed(str(exc), refused=True))
        return None
    except Exception as exc:  # reported to the server, which shows it and stops
        conn.send(Failed(str(exc) if isinstance(exc, MashboxError) else f"{type(exc).__name__}: {exc}"))
        return None
    finally:
        gc.enable()
    gc.freeze()
    conn.send(Ready(engine.info, torch.get_num_threads()))
    return engine


class Worker:
    def __init__(self, engine: Runtime, conn: Connection) -> None:
        self._engine = engine
        self._conn = conn
        self._send_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._pump = threading.Thread(target=self._loop.run_forever, name="mashbox-pump", daemon=True)
        self._streams: dict[int, futures.Future[None]] = {}
        self._outgoing: list[EventMsg] = []  # the pump thread's events not yet sent
        self._stats_sent: Any = None  # the last snapshot sent
        self._engine_stopped = False  # after an internal error: this worker ends and the server starts another

    def run(self) -> None:
        self._pump.start()
        done = threading.Event()
        threading.Thread(target=self._publish_stats, args=(done,), name="mashbox-stats", daemon=True).start()
        try:
            while not self._engine_stopped and (command := self._receive()) is not None:
                self._handle(command)
        finally:
            done.set()
            self._engine.close()  # each stream still running ends with its usage so far, sent before the pump stops
            futures.wait(list(self._streams.values()), timeout=SETTLE_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._pump.join(timeout=5)

    def _publish_stats(self, done: threading.Event) -> None:
        while True:
            self._send_stats()
            if done.wait(STATS_EVERY):
                return

    def _send_stats(self) -> None:
        """The engine's snapshot, if it changed since the last one sent; read under the send lock, so
        a newer snapshot never goes out before an older one."""
        with self._send_lock:
            if (stats := self._engine.stats()) is not self._stats_sent:
                self._stats_sent = stats
                self._send_unlocked(StatsSnapshot(stats))

    def _receive(self) -> Command | None:
        try:
            command = self._conn.recv()
        except (EOFError, OSError):  # the server is gone
            return None
        return None if isinstance(command, Stop) else command

    def _handle(self, command: Command) -> None:
        match command:
            case Submit(request_id, request):
                self._submit(request_id, request)
            case Abort(request_id):
                if (stream := self._streams.pop(request_id, None)) is not None:
                    stream.cancel()
            case Halt(engine_id):
                self._engine.abort(engine_id)
            case Count(request_id, request):
                self._count(request_id, request)

    def _submit(self, request_id: int, request: EngineRequest) -> None:
        try:
            events = self._engine.astream(request)  # a bad request raises here, before any work
        except Exception as exc:
            self._send(Error.of(request_id, exc))
            self._engine_stopped = isinstance(exc, EngineClosedError)  # not closed by a Stop: it failed
            return
        stream = asyncio.run_coroutine_threadsafe(self._relay(request_id, events), self._loop)
        self._streams[request_id] = stream
        stream.add_done_callback(lambda _: self._streams.pop(request_id, None))

    async def _relay(self, request_id: int, events: AsyncIterator[Event]) -> None:
        try:
            async for event in events:
                if isinstance(event, Finish):  # its figures reach the server before its client sees the end
                    self._send_stats()
                self._post(EventMsg(request_id, event))
        except Exception as exc:  # the engine ends every stream with a Finish; this is a safety net
            self._post(EventMsg(request_id, error_finish(f"{type(exc).__name__}: {exc}")))

    def _post(self, message: EventMsg) -> None:
        """Queue an event (pump thread); the streams woken by the same step all queue theirs
        before the flush, which runs after them on the loop."""
        if not self._outgoing:
            self._loop.call_soon(self._flush)
        self._outgoing.append(message)

    def _flush(self) -> None:
        messages, self._outgoing = self._outgoing, []
        self._send(Events(messages))

    def _count(self, request_id: int, request: EngineRequest) -> None:
        try:
            self._send(Counted(request_id, len(self._engine.encode(request))))
        except Exception as exc:
            self._send(Error.of(request_id, exc))

    def _send(self, reply: Reply) -> None:
        with self._send_lock:
            self._send_unlocked(reply)

    def _send_unlocked(self, reply: Reply) -> None:
        try:
            self._conn.send(reply)
        except OSError:  # the server is gone; the command loop sees EOF and stops
            pass
