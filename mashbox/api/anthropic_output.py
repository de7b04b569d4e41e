"""Anthropic Messages, the answer side: Message, stream events and the Translator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from mashbox.api.base import OutModel, at_a_glance, json_object, new_id, prefixed
from mashbox.api.blocks import Block, BlockTracker, Change
from mashbox.engine.events import Event, Finish, Usage

if TYPE_CHECKING:
    from mashbox.api.anthropic_messages import CountTokensRequest

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


def stop_reason(finish: Finish) -> StopReason:
    if finish.reason == "length":
        return "max_tokens"
    if finish.reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


def content_block(block: Block, whole: bool) -> TextOut | ThinkingOut | ToolUseOut:
    """The block as content_block_start shows it (empty) or as the Message holds it (whole)."""
    text = block.text if whole else ""
    if block.kind == "text":
        return TextOut(text=text)
    if block.kind == "reasoning":
        return ThinkingOut(thinking=text, signature=SIGNATURE if whole else "")
    args = json_object(block.text) if whole else {}
    return ToolUseOut(id=prefixed("toolu_", block.tool_id), name=block.name, input=args)


class Translator:
    """Engine events -> Messages stream events, and the whole Message."""

    def __init__(self, request: CountTokensRequest, model: str) -> None:
        self._model = request.model or model
        self._id = new_id("msg_")
        self._blocks = BlockTracker()

    def start(self) -> list[StreamEvent]:
        message = self._message([], None, None, MessageUsage(input_tokens=0, output_tokens=0))
        return [MessageStart(message=message), Ping()]

    def feed(self, event: Event) -> list[StreamEvent]:
        return [e for change in self._blocks.feed(event) for e in self._on(change)]

    def error(self, message: str) -> list[StreamEvent]:
        return [ErrorEvent(error=ErrorDetail(message=message), request_id=self._id)]

    def response(self) -> AnthropicMessage:
        finish = self._blocks.done()
        content = [content_block(b, whole=True) for b in self._blocks.blocks]
        return self._message(content, stop_reason(finish), finish.stop_sequence, MessageUsage.of(finish.usage))

    def _on(self, change: Change) -> list[StreamEvent]:
        block = change.block
        if change.kind == "finish":
            return self._end()
        if block is None:
            return []
        if change.kind == "open":
            return [ContentBlockStart(index=block.index, content_block=content_block(block, whole=False))]
        if change.kind == "delta":
            return [ContentBlockDelta(index=block.index, delta=_delta(block, change.text))]
        signature = [ContentBlockDelta(index=block.index, delta=SignatureDeltaOut())]
        return [*(signature if block.kind == "reasoning" else []), ContentBlockStop(index=block.index)]

    def _end(self) -> list[StreamEvent]:
        finish = self._blocks.done()
        if finish.reason == "error":
            return self.error(finish.error or "generation failed")
        delta = StopDelta(stop_reason=stop_reason(finish), stop_sequence=finish.stop_sequence)
        return [MessageDelta(delta=delta, usage=MessageUsage.of(finish.usage)), MessageStop()]

    def _message(
        self, content: list[Any], reason: StopReason | None, sequence: str | None, usage: MessageUsage
    ) -> AnthropicMessage:
        return AnthropicMessage(
            id=self._id, model=self._model, content=content, stop_reason=reason,
            stop_sequence=sequence, usage=usage,
        )



def _delta(block: Block, text: str) -> TextDeltaOut | ThinkingDeltaOut | InputJsonDeltaOut:
    if block.kind == "text":
        return TextDeltaOut(text=text)
    if block.kind == "reasoning":
        return ThinkingDeltaOut(thinking=text)
    return InputJsonDeltaOut(partial_json=text)
