"""mashbox: a local LLM engine and server for notebooks and coding agents."""

from mashbox.engine.config import EngineConfig
from mashbox.engine.engine import Engine, IgnoredFieldsWarning, ModelInfo
from mashbox.engine.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    Timings,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from mashbox.engine.request import EngineRequest, Message, SamplingParams, Tool, ToolCall
from mashbox.errors import ContextLengthError, InvalidRequestError, MashboxError, ModelLoadError

__all__ = [
    "ContextLengthError", "Engine", "EngineConfig", "EngineRequest", "Event", "Finish",
    "IgnoredFieldsWarning", "InvalidRequestError", "MashboxError", "Message", "ModelInfo",
    "ModelLoadError", "ReasoningDelta", "SamplingParams", "TextDelta", "Timings", "Tool", "ToolCall",
    "ToolCallDelta", "ToolCallEnd", "ToolCallStart", "Usage",
]
