"""Anthropic Messages (and count_tokens): request models, ``to_engine`` and the ``Translator``.

The answer's models (Message, stream events) are in ``anthropic_output.py``, and re-exported here,
so callers import one module per protocol.

``thinking``: ``enabled`` -> on, with ``budget_tokens`` as the budget; ``disabled`` -> off;
``adaptive`` (Claude Code) or absent -> the model's default.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from mashbox.api.anthropic_output import (
    SIGNATURE,
    AnthropicMessage,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ErrorDetail,
    ErrorEvent,
    InputJsonDeltaOut,
    MessageDelta,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    SignatureDeltaOut,
    StopDelta,
    StopReason,
    StreamEvent,
    TextDeltaOut,
    TextOut,
    ThinkingDeltaOut,
    ThinkingOut,
    TokenCount,
    ToolUseOut,
)
from mashbox.api.anthropic_tools import client_tool
from mashbox.api.base import (
    TEXT_ONLY,
    Part,
    RequestModel,
    SamplingFields,
    Stream,
    UnsupportedPart,
    engine_request,
    json_object,
    new_id,
    prefixed,
)
from mashbox.api.blocks import Block, BlockTracker, Change
from mashbox.engine.events import Event, Finish, Usage
from mashbox.engine.request import EngineRequest, Message, Named, SamplingParams, Tool, ToolCall
from mashbox.engine.request import ToolChoice as EngineToolChoice
from mashbox.errors import InvalidRequestError

__all__ = [
    "AnthropicMessage",
    "CountTokensRequest",
    "MessagesRequest",
    "StreamEvent",
    "TokenCount",
    "Translator",
    "to_engine",
]

BILLING_HEADER = "x-anthropic-billing-header:"


class TextBlock(Part):
    type: Literal["text"]
    text: str


class ThinkingBlock(Part):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Part):
    type: Literal["redacted_thinking"]


class ToolUseBlock(Part):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class MediaBlock(UnsupportedPart):
    type: Literal["image", "audio", "file"]


class DocumentBlock(Part):
    """A document of plain text (``source`` ``text``, or ``content``: a string or text blocks), read as its
    title, context and text; a PDF or another file is refused as an image is."""

    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None

    @field_validator("source")
    @classmethod
    def _plain_text(cls, source: dict[str, Any]) -> dict[str, Any]:
        kind, content = source.get("type"), source.get("content")
        if kind == "text" and not isinstance(source.get("data"), str):
            raise InvalidRequestError("data", "is required in a document of source type text: its text, a string")
        if kind == "content" and not isinstance(content, str | list):
            raise InvalidRequestError("content", "is required in a document of source type content: a string or "
                                                 "a list of text blocks")
        if kind not in ("text", "content"):
            raise ValueError(f"a document of source type {kind!r} {TEXT_ONLY} (source types text and content are "
                             "read as text)")
        for i, block in enumerate(content if kind == "content" and isinstance(content, list) else ()):
            if not (isinstance(block, dict) and block.get("type") == "text"):
                what = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise InvalidRequestError(f"content.{i}.type", f"a block of type {what!r} in a document {TEXT_ONLY}")
        return source

    @property
    def text(self) -> str:
        content = self.source["data"] if self.source["type"] == "text" else self.source["content"]
        body = content if isinstance(content, str) else "\n".join(str(b.get("text", "")) for b in content)
        return "\n\n".join(part for part in (self.title, self.context, body) if part)


ResultPart = Annotated[TextBlock | DocumentBlock | MediaBlock, Field(discriminator="type")]


class ToolResultBlock(Part):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] | None = ""  # null: no output (a tool that printed nothing)
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _listed(cls, content: Any) -> Any:
        if isinstance(content, dict):  # pydantic's error would say only that it is no string
            raise ValueError("must be a string or a list of content blocks: a block alone is not taken")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            text = "\n".join(b.text for b in self.content if isinstance(b, TextBlock | DocumentBlock))
        else:
            text = self.content or ""
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | DocumentBlock | MediaBlock,
    Field(discriminator="type"),
]


class InputMessage(Part):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> InputMessage:
        """A block another role writes would be left out unsaid: a 400 instead, as Anthropic's."""
        mine = ((TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock) if self.role == "assistant"
                else (TextBlock, ToolResultBlock, DocumentBlock, MediaBlock))
        blocks = [] if isinstance(self.content, str) else self.content
        if odd := next((b for b in blocks if not isinstance(b, mine)), None):
            raise ValueError(f"a {odd.type} block cannot be in a message of role {self.role}")
        return self


class AnthropicTool(Part):
    type: str | None = None
    name: str | None = None  # a server tool may have none (the MCP connector's ``mcp_toolset``)
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    def usable(self) -> bool:
        return self.type in (None, "custom") or client_tool(self.type) is not None

    def left_out(self) -> bool:
        return not self.usable()

    def engine_tool(self) -> Tool:
        description, schema = client_tool(self.type) or ("", {})
        return Tool(self.name or "", self.description or description, self.input_schema or schema)

    @model_validator(mode="after")
    def _schema(self) -> AnthropicTool:
        if self.usable() and self.name is None:
            raise InvalidRequestError("name", "is required for a tool the model calls")
        if self.type in (None, "custom") and self.input_schema is None:  # a server tool (web_search, ...) has none
            raise InvalidRequestError("input_schema", "is required for a custom tool (a JSON schema of its input)")
        return self


class ToolChoice(Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise InvalidRequestError("name", "is required when type is tool: the tool to call")
        return self


class ThinkingConfig(Part):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None

    def enabled(self) -> bool | None:
        return {"enabled": True, "disabled": False}.get(self.type)


def _refuse_format(value: Any) -> Any:
    if value is not None:  # (the OpenAI routes take {"type": "text"}; Messages has no such value)
        raise ValueError("structured output is not supported; leave it out (a call forced with tool_choice "
                         "{'type': 'tool'} follows the tool's input_schema)")
    return value


class OutputConfig(Part):
    effort: str | None = None
    format: Any = None

    _no_format = field_validator("format")(_refuse_format)


class CountTokensRequest(RequestModel):
    """POST /v1/messages/count_tokens."""

    model: str | None = None
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def _more_ignored(self) -> list[str]:
        return [f"tools[{t.type}]" for t in self.tools or () if t.left_out()]

    @model_validator(mode="after")
    def _choice_runs_here(self) -> CountTokensRequest:
        named = self.tool_choice.name if self.tool_choice and self.tool_choice.type == "tool" else None
        skipped = next((t for t in self.tools or () if named is not None and t.name == named and not t.usable()), None)
        if skipped:
            raise InvalidRequestError("tool_choice", f"names {named!r}, a tool of type {skipped.type!r}, which "
                                                     "runs on Anthropic's side or needs images: this server cannot "
                                                     "call it")
        return self


class MessagesRequest(CountTokensRequest, SamplingFields):
    """POST /v1/messages."""

    accepted_ignored = ("metadata",)

    stream: Stream = False
    prompt_cache_key: str | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: Any = None  # the structured-outputs beta's name for output_config.format

    _no_format = field_validator("output_format")(_refuse_format)

    def _more_ignored(self) -> list[str]:
        effort = self.output_config is not None and self.output_config.effort is not None
        return super()._more_ignored() + (["output_config.effort"] if effort else [])


def to_engine(req: CountTokensRequest) -> EngineRequest:
    thinking = req.thinking
    for k, msg in enumerate(req.messages):  # as Anthropic's API: left out, the turn before became a prefill
        if msg.content == [] and not (k == len(req.messages) - 1 and msg.role == "assistant"):
            raise InvalidRequestError(f"messages.{k}.content", "is empty: every message but a final assistant "
                                      "one must have content")
    turns = (replace(m, item=k) for k, msg in enumerate(req.messages) for m in _messages(msg))
    messages = (*_system(req.system), *turns)
    return engine_request(
        messages=messages,
        continue_final=bool(messages) and _prefilled(messages[-1]),
        sampling=req.sampling() if isinstance(req, SamplingFields) else SamplingParams(),
        tools=tuple(t.engine_tool() for t in req.tools or () if t.usable()),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
        enable_thinking=thinking.enabled() if thinking is not None else None,
        thinking_budget=thinking.budget_tokens if thinking is not None and thinking.enabled() else None,
    )


def _prefilled(final: Message) -> bool:
    """Whether the conversation ends with the start of the answer (an assistant message of text, which
    the answer continues), as Anthropic's prefill: without trailing whitespace, as Anthropic requires."""
    if final.role != "assistant" or final.tool_calls or not final.content:
        return False
    if final.content != final.content.rstrip():
        raise InvalidRequestError("messages", "final assistant content cannot end with trailing whitespace")
    return True


def _system(system: str | list[TextBlock] | None) -> tuple[Message, ...]:
    if isinstance(system, list):
        system = "\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))
    return () if system is None else (Message("system", system),)  # "": no system text, nor the template's


def _tool_choice(choice: ToolChoice | None) -> EngineToolChoice:
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "tool" and choice.name:
        return Named(choice.name)
    return {"any": "required", "none": "none"}[choice.type]


def _messages(msg: InputMessage) -> list[Message]:
    if isinstance(msg.content, str):
        return [Message(msg.role, msg.content)]
    if msg.role == "assistant":
        return [_assistant(msg.content)]
    out: list[Message] = []
    texts: list[str] = []
    for block in msg.content:
        if isinstance(block, ToolResultBlock):
            out += _flush(msg.role, texts)
            out.append(Message("tool", block.text(), tool_call_id=block.tool_use_id))
        elif isinstance(block, TextBlock | DocumentBlock):
            texts.append(block.text)
    return out + _flush(msg.role, texts)


def _flush(role: Literal["user", "system"], texts: list[str]) -> list[Message]:
    if not texts:
        return []
    message = Message(role, "\n".join(texts))
    texts.clear()
    return [message]


def _assistant(blocks: list[Any]) -> Message:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    calls = tuple(
        ToolCall(b.id, b.name, json.dumps(b.input)) for b in blocks if isinstance(b, ToolUseBlock)
    )
    return Message("assistant", text, tool_calls=calls, reasoning=thinking or None)


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

    def start(self, prompt: Usage | None = None) -> list[StreamEvent]:
        """``message_start`` (with the prompt's tokens, where known, as Anthropic's has them) and a ping."""
        usage = MessageUsage.of(prompt) if prompt else MessageUsage(input_tokens=0, output_tokens=0)
        message = self._message([], None, None, usage)
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
