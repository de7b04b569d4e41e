"""Anthropic Messages, the answer side: the Message, its usage and the stream events."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from mashbox.api.base import OutModel, at_a_glance
from mashbox.engine.events import Usage

SIGNATURE = "mashbox-local"
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TokenCount(OutModel):
    input_tokens: int


class MessageUsage(OutModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, u: Usage) -> MessageUsage:
        return cls(
            input_tokens=u.prompt_tokens - u.cached_tokens, output_tokens=u.completion_tokens,
            cache_read_input_tokens=u.cached_tokens,
        )


class TextOut(OutModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(OutModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseOut(OutModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]


class AnthropicMessage(OutModel):
    keep_none = frozenset({"stop_reason", "stop_sequence"})

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage

    def _repr_markdown_(self) -> str:
        parts = [getattr(b, "text", None) or (f"`{b.name}({b.input})`" if getattr(b, "name", None) else "")
                 for b in self.content if getattr(b, "type", "") != "thinking"]
        return at_a_glance("\n".join(p for p in parts if p), self.stop_reason, self.usage.input_tokens,
                           self.usage.output_tokens)


class MessageStart(OutModel):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessage


class Ping(OutModel):
    type: Literal["ping"] = "ping"


class ContentBlockStart(OutModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentOut


class TextDeltaOut(OutModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDeltaOut(OutModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDeltaOut(OutModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str = SIGNATURE


class InputJsonDeltaOut(OutModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


BlockDelta = Annotated[
    TextDeltaOut | ThinkingDeltaOut | SignatureDeltaOut | InputJsonDeltaOut, Field(discriminator="type")
]


class ContentBlockDelta(OutModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: BlockDelta


class ContentBlockStop(OutModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(OutModel):
    keep_none = frozenset({"stop_reason", "stop_sequence"})

    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(OutModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: MessageUsage


class MessageStop(OutModel):
    type: Literal["message_stop"] = "message_stop"


class ErrorDetail(OutModel):
    type: str = "api_error"
    message: str


class ErrorEvent(OutModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
    request_id: str | None = None


StreamEvent = Annotated[
    MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
    | MessageStop | ErrorEvent,
    Field(discriminator="type"),
]
