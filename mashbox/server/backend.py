"""What the server needs of an engine, and the in-process implementation.

The HTTP layer talks to a ``Backend``: the in-process one here (tests,
notebooks) or a worker process (``worker.py``). Both load the model in the
background so the server answers ``loading`` before the model is ready.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from mashbox.engine.events import Event, closed
from mashbox.engine.info import ModelInfo
from mashbox.engine.request import EngineRequest
from mashbox.engine.stats import EngineStats
from mashbox.errors import ConfigError, EngineClosedError, NotReadyError

if TYPE_CHECKING:  # torch loads only where an engine is built
    from mashbox.facade import Engine

log = logging.getLogger("mashbox.server")
State = Literal["loading", "ready", "failed"]


STOPPING = "the server is shutting down"


def stopped(event: Event) -> None:
    """Raise ``EngineClosedError`` with the request's usage so far if ``event`` is the Finish its engine's close
    ended it with (the server stopping), which is not the request's own answer."""
    if closed(event):
        raise EngineClosedError(STOPPING, usage=event.usage)


@dataclass(slots=True, frozen=True)
class Change:
    """A backend's state as it changed to it: what the terminal reports."""

    state: State
    restarts: int
    error: str | None
    info: ModelInfo | None
    refused: bool = False  # failed: a setting the model or the machine cannot take (ConfigError)


class Backend(Protocol):
    changes: queue.SimpleQueue[Change]  # every state change, in order (read by one watcher)

    @property
    def state(self) -> State: ...
    @property
    def error(self) -> str | None: ...
    @property
    def model_id(self) -> str: ...
    @property
    def info(self) -> ModelInfo | None: ...
    @property
    def worker_pid(self) -> int | None: ...
    @property
    def worker_restarts(self) -> int: ...

    def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        """Events of ``request``; a bad request raises on the first ``__anext__``."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop the request of this ``EngineRequest.id``; its stream goes on to its Finish."""
        ...

    async def count(self, request: EngineRequest) -> int:
        """Prompt tokens ``request`` would run on."""
        ...

    def stats(self) -> EngineStats | None: ...
    def busy(self) -> int:
        """Requests in flight now (submitted, not yet finished)."""
        ...

    def close(self) -> None: ...


class InProcessBackend:
    """An ``Engine`` in this process, built on a background thread."""

    def __init__(self, model_id: str, build: Callable[[], Engine]) -> None:
        self._model_id = model_id
        self._engine: Engine | None = None
        self._error: str | None = None
        self.changes: queue.SimpleQueue[Change] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._load, args=(build,), name="mashbox-load", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, engine: Engine) -> InProcessBackend:
        """A backend over an engine that is already loaded."""
        backend = cls(engine.model_id, lambda: engine)
        backend._thread.join()
        return backend

    def _load(self, build: Callable[[], Engine]) -> None:
        refused = False
        try:
            self._engine = build()
        except ConfigError as exc:  # a setting refused: the message says which and what to do
            self._error, refused = str(exc), True
        except Exception as exc:  # reported through state/error, and by the CLI
            self._error = f"{type(exc).__name__}: {exc}"
        self.changes.put(Change(self.state, 0, self._error, self.info, refused))

    def wait(self, timeout: float | None = None) -> State:
        self._thread.join(timeout)
        return self.state

    @property
    def state(self) -> State:
        if self._engine is not None:
            return "ready"
        return "failed" if self._error else "loading"

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def model_id(self) -> str:
        return self._engine.model_id if self._engine else self._model_id

    @property
    def info(self) -> ModelInfo | None:
        return self._engine.info if self._engine else None

    @property
    def worker_pid(self) -> int | None:
        return None

    @property
    def worker_restarts(self) -> int:
        return 0

    async def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        async for event in self._ready().astream(request):
            stopped(event)
            yield event

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)

    async def count(self, request: EngineRequest) -> int:
        return len(self._ready().encode(request))

    def stats(self) -> EngineStats | None:
        return self._engine.stats() if self._engine else None

    def busy(self) -> int:
        stats = self.stats()
        return stats.running + stats.waiting if stats else 0

    def close(self) -> None:
        """Close the engine; one still loading once its load ends (torch's threads cannot be stopped: the process
        left with them running aborted, 'terminate called without an active exception')."""
        if self._thread.is_alive():
            log.info("stopping: the model's load ends first (it runs in this process: --in-process)")
            self._thread.join()
        if self._engine is not None:
            self._engine.close()

    def _ready(self) -> Engine:
        if self._engine is None:
            raise NotReadyError("the model is still loading")
        return self._engine
