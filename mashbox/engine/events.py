"""The engine's one event stream: what every protocol translates from.

A request yields ``Queued`` (accepted), ``Started`` (it has a slot), deltas (text, reasoning,
tool-call pieces) and ends with exactly one ``Finish``. Protocol modules in ``mashbox.api`` turn these into
their own responses and stream events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]
CLOSED = "this Engine is closed (engine.close() or the end of its `with` block); make a new Engine()"  # an abort's error


@dataclass(slots=True, frozen=True)
class Queued:
    """The request is valid and fits the context: it waits for a slot. Always the first event;
    ``prompt_tokens`` is the length of its prompt."""

    prompt_tokens: int
    type: Literal["queued"] = "queued"


@dataclass(slots=True, frozen=True)
class Started:
    """The request has a slot: its prompt is being computed (once, before any output).
    ``cached`` prompt tokens came from the prefix cache. ``differs``: the token at which the prompt
    left a longer cached prefix (None: no cached prefix went on past where it agreed), and ``part``
    the part of the conversation that token lies in (``system text``, ``tools``, ``message 3
    (user)``, ...)."""

    cached: int
    differs: int | None = None
    part: str | None = None
    type: Literal["started"] = "started"


@dataclass(slots=True, frozen=True)
class TextDelta:
    text: str
    type: Literal["text"] = "text"


@dataclass(slots=True, frozen=True)
class ReasoningDelta:
    text: str
    type: Literal["reasoning"] = "reasoning"


@dataclass(slots=True, frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str
    type: Literal["tool_call_start"] = "tool_call_start"


@dataclass(slots=True, frozen=True)
class ToolCallDelta:
    index: int
    arguments: str
    type: Literal["tool_call_delta"] = "tool_call_delta"


@dataclass(slots=True, frozen=True)
class ToolCallEnd:
    index: int
    type: Literal["tool_call_end"] = "tool_call_end"


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those spent thinking
    accepted_tokens: int = 0  # speculation: proposed tokens the model confirmed, and those it did not
    rejected_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True, frozen=True)
class Timings:
    """llama-server style timings (milliseconds)."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int
    queue_ms: float

    @property
    def prompt_per_second(self) -> float | None:
        return self.prompt_n / self.prompt_ms * 1000 if self.prompt_ms > 0 else None

    @property
    def predicted_per_second(self) -> float | None:
        if self.predicted_ms <= 0 or self.predicted_n < 2:
            return None
        return (self.predicted_n - 1) / self.predicted_ms * 1000


@dataclass(slots=True, frozen=True)
class Finish:
    reason: FinishReason
    usage: Usage
    timings: Timings
    stop_sequence: str | None = None
    error: str | None = None
    param: str | None = None  # the request's field at fault, where it failed for its own input (a grammar)
    type: Literal["finish"] = "finish"


Event = Queued | Started | TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | Finish


def closed(event: Event) -> bool:
    """Whether ``event`` is the Finish an engine's close ended a request with: not the request's own answer."""
    return isinstance(event, Finish) and event.reason == "abort" and event.error == CLOSED
