"""The typed messages between the server and its worker process.

Commands go from the server to the worker, replies come back; each is a
small frozen dataclass that pickles across the pipe. ``request_id`` is the
server's own number for one command, not the ``EngineRequest.id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mashbox.engine.events import Event, Finish, Timings, Usage
from mashbox.engine.info import ModelInfo
from mashbox.engine.request import EngineRequest
from mashbox.engine.stats import EngineStats
from mashbox.errors import ContextLengthError, InvalidRequestError

# -- commands: server -> worker ---------------------------------------------


@dataclass(slots=True, frozen=True)
class Submit:
    request_id: int
    request: EngineRequest


@dataclass(slots=True, frozen=True)
class Abort:
    request_id: int


@dataclass(slots=True, frozen=True)
class Halt:
    """Stop the request whose ``EngineRequest.id`` this is; its stream still ends with its Finish."""

    engine_id: str


@dataclass(slots=True, frozen=True)
class Count:
    request_id: int
    request: EngineRequest


@dataclass(slots=True, frozen=True)
class Stop:
    """Close the engine and exit."""


Command = Submit | Abort | Halt | Count | Stop

# -- replies: worker -> server ----------------------------------------------


@dataclass(slots=True, frozen=True)
class Ready:
    info: ModelInfo
    threads: int  # torch's intra-op threads in the worker


@dataclass(slots=True, frozen=True)
class Failed:
    """The model did not load; the worker exits after sending this. ``refused``: a setting the model
    or the machine cannot take (``ConfigError``), found before any allocation."""

    error: str
    refused: bool = False


@dataclass(slots=True, frozen=True)
class EventMsg:
    request_id: int
    event: Event


@dataclass(slots=True, frozen=True)
class Events:
    """The events the worker had ready at once (one engine step's, for every stream), in one message."""

    messages: list[EventMsg]


ErrorKind = Literal["invalid_request", "context_length", "internal"]


@dataclass(slots=True, frozen=True)
class Error:
    """A command refused before any work (bad request, prompt too long)."""

    request_id: int
    kind: ErrorKind
    param: str
    message: str
    tokens: int = 0  # a context length error's prompt and context lengths
    ctx: int = 0

    @classmethod
    def of(cls, request_id: int, exc: Exception) -> Error:
        if isinstance(exc, ContextLengthError):
            return cls(request_id, "context_length", exc.param, exc.message, exc.tokens, exc.ctx)
        if isinstance(exc, InvalidRequestError):
            return cls(request_id, "invalid_request", exc.param, exc.message)
        return cls(request_id, "internal", "", f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        """The exception the in-process engine would have raised."""
        if self.kind == "context_length":
            return ContextLengthError(self.param, self.message, tokens=self.tokens, ctx=self.ctx)
        if self.kind == "invalid_request":
            return InvalidRequestError(self.param, self.message)
        return RuntimeError(self.message)


@dataclass(slots=True, frozen=True)
class Counted:
    request_id: int
    n: int


@dataclass(slots=True, frozen=True)
class StatsSnapshot:
    """The engine's stats, sent by the worker whenever they changed (at most every ``STATS_EVERY`` s)."""

    stats: EngineStats


STATS_EVERY = 0.2
SETTLE_S = 0.5  # seconds a stopping worker has to send its requests' last events (a step's time; a long chunk's)
Reply = Ready | Failed | Events | Error | Counted | StatsSnapshot


def error_finish(error: str) -> Finish:
    """The ``Finish`` of a request the worker could not end itself."""
    return Finish("error", Usage(0, 0), Timings(0, 0.0, 0, 0.0, 0, 0.0), error=error)
