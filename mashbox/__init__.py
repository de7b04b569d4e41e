"""mashbox: a local LLM engine and server for notebooks and coding agents.

``Engine`` (and ``IgnoredFieldsWarning``) load on first use, so that the
server process and the CLI import the request and event types without torch.
"""

from typing import TYPE_CHECKING, Any

from mashbox.engine.config import EngineConfig
from mashbox.engine.events import (
    Event,
    Finish,
    Queued,
    ReasoningDelta,
    Started,
    TextDelta,
    Timings,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from mashbox.engine.info import ModelInfo
from mashbox.engine.request import EngineRequest, Message, SamplingParams, Tool, ToolCall
from mashbox.errors import (
    ConfigError,
    ContextLengthError,
    EngineClosedError,
    GenerationError,
    InvalidRequestError,
    MashboxError,
    ModelLoadError,
    ModelNotFoundError,
)

if TYPE_CHECKING:
    from mashbox.facade import Engine, IgnoredFieldsWarning

__all__ = [
    "ConfigError", "ContextLengthError", "Engine", "EngineClosedError", "EngineConfig", "EngineRequest", "Event",
    "Finish", "GenerationError", "IgnoredFieldsWarning", "InvalidRequestError", "MashboxError", "Message", "ModelInfo", "ModelLoadError",
    "ModelNotFoundError", "Queued", "ReasoningDelta", "SamplingParams", "Started", "TextDelta", "Timings", "Tool",
    "ToolCall", "ToolCallDelta", "ToolCallEnd", "ToolCallStart", "Usage",
]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "IgnoredFieldsWarning"):
        from mashbox.engine.model.openmp import prefer_passive_wait

        prefer_passive_wait()  # before facade imports torch
        from mashbox import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'mashbox' has no attribute {name!r}")
