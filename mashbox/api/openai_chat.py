"""OpenAI Chat Completions: the request model, ``to_engine`` and the Translator.

The answer's models (ChatCompletion, ChatCompletionChunk, usage, timings) are in
``chat_output.py`` and re-exported here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from mashbox.api.base import (
    STRUCTURED,
    ErrorBody,
    LogitBias,
    Part,
    RequestModel,
    SamplingFields,
    Stream,
    StreamOptions,
    UnsupportedPart,
    engine_request,
    new_id,
    now,
    parameters_of,
    prefixed,
    refuse_logprobs,
    unread_stream_options,
)
from mashbox.api.blocks import Block, BlockTracker, Change
from mashbox.api.chat_output import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatFinishReason,
    ChatTimings,
    ChatUsage,
    ChunkChoice,
    ChunkDelta,
    FunctionOut,
    ToolCallDeltaOut,
    ToolCallOut,
)
from mashbox.engine.events import Event, Finish, Usage
from mashbox.engine.request import EngineRequest, Message, Named, Role, Tool, ToolCall, ToolChoice
from mashbox.errors import InvalidRequestError

__all__ = ["ChatCompletion", "ChatCompletionChunk", "ChatRequest", "Translator", "to_engine"]

class TextPart(Part):
    type: Literal["text"]
    text: str


class RefusalPart(Part):
    type: Literal["refusal"]
    refusal: str


class MediaPart(UnsupportedPart):
    type: Literal["image_url", "input_audio", "file", "image", "audio"]


ContentPart = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]


class FunctionCall(Part):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ChatToolCall(Part):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Part):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    name: str | None = None
    refusal: str | None = None  # an assistant turn the model refused (the SDK's message, dumped)
    function_call: FunctionCall | None = None  # deprecated: one call, answered by a ``function`` message of its name

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if "content" not in self.model_fields_set and self.role != "assistant":
            keys = ", ".join(sorted(self.model_fields_set | set(self.model_extra or {})))
            raise InvalidRequestError("content", f"is required in a {self.role} message (this one has: {keys})")
        for field in ("refusal", "function_call"):
            if self.role != "assistant" and getattr(self, field) is not None:
                raise InvalidRequestError(field, f"is an assistant message's, not a {self.role} message's")
        return self


class FunctionDef(Part):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a call follows its tool's parameters here (a grammar), as OpenAI's strict


class ChatTool(Part):
    type: str = "function"
    function: FunctionDef | None = None

    def left_out(self) -> bool:
        return self.type != "function"

    @model_validator(mode="after")
    def _function_given(self) -> ChatTool:
        if self.type == "function" and self.function is None:
            raise InvalidRequestError("function", "a function tool needs its function (name, parameters)")
        return self


class NamedFunction(Part):
    name: str


class NamedToolChoice(Part):
    type: Literal["function"] = "function"
    function: NamedFunction


class Prediction(Part):
    """OpenAI's predicted output: text the answer is expected to resemble (a file with a small edit)."""

    type: Literal["content"]
    content: str | list[TextPart]


class TemplateKwargs(Part):
    """vLLM's ``chat_template_kwargs``: mashbox reads ``enable_thinking``; other keys are reported unread."""

    enable_thinking: bool | None = None


class ChatRequest(RequestModel, LogitBias, SamplingFields):
    accepted_ignored = ("merge", "store")

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: Stream = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    enable_thinking: bool | None = None
    merge: bool | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    prediction: Prediction | None = None
    continue_final_message: bool | None = None  # vLLM's and transformers': the answer continues the last message

    _no_logprobs = field_validator("logprobs", "top_logprobs")(refuse_logprobs)

    @model_validator(mode="after")
    def _continues_an_answer(self) -> ChatRequest:
        final = self.messages[-1]
        if self.continue_final_message and (final.role != "assistant" or final.tool_calls):
            raise InvalidRequestError("continue_final_message", "needs a last message of the assistant's text, "
                                                                "which the answer continues")
        return self

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError(STRUCTURED)
        return value

    def _more_ignored(self) -> list[str]:
        skipped = [f"tools[{t.type}]" for t in self.tools or () if t.left_out()]
        return skipped + unread_stream_options(self.stream, self.stream_options)

    def thinking(self) -> bool | None:
        kwargs = self.chat_template_kwargs
        return kwargs.enable_thinking if kwargs and "enable_thinking" in kwargs.model_fields_set else self.enable_thinking


def to_engine(req: ChatRequest) -> EngineRequest:
    return engine_request(
        messages=_messages(req.messages),
        sampling=req.sampling(),
        tools=tuple(
            Tool(t.function.name, t.function.description or "", parameters_of(t.function.parameters))
            for t in req.tools or ()
            if t.function is not None and t.type == "function"
        ),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        enable_thinking=req.thinking(),
        prediction=_text(req.prediction.content) if req.prediction else None,
        continue_final=bool(req.continue_final_message),
    )


_ROLES: dict[str, Role] = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant",
    "tool": "tool", "function": "tool",
}
_FINISH: dict[str, ChatFinishReason] = {"length": "length", "tool_calls": "tool_calls"}


def _messages(messages: list[ChatMessage]) -> tuple[Message, ...]:
    """The conversation; a deprecated ``function_call`` is a tool call (``call_<its message's index>``),
    and a ``function`` message answers the last one of its ``name``."""
    calls: dict[str | None, str] = {}
    out = []
    for i, m in enumerate(messages):
        tool_calls = [_tool_call(c.id, c.function) for c in m.tool_calls or ()]
        if m.function_call is not None:
            tool_calls.append(_tool_call(f"call_{i}", m.function_call))
            calls[m.function_call.name] = f"call_{i}"
        answers = calls.pop(m.name, None) if m.role == "function" and m.tool_call_id is None else m.tool_call_id
        out.append(Message(role=_ROLES[m.role], content="\n".join(filter(None, (_text(m.content), m.refusal))),
                           tool_calls=tuple(tool_calls), tool_call_id=answers,
                           reasoning=m.reasoning_content or m.reasoning))
    return tuple(out)


def _text(content: str | list[Any] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


def _tool_call(call_id: str, function: FunctionCall) -> ToolCall:
    args = function.arguments
    return ToolCall(call_id, function.name, args if isinstance(args, str) else json.dumps(args))


def _tool_choice(choice: str | NamedToolChoice | None) -> ToolChoice:
    if isinstance(choice, NamedToolChoice):
        return Named(choice.function.name)
    return choice or "auto"


def finish_reason(finish: Finish) -> ChatFinishReason:
    return _FINISH.get(finish.reason, "stop")


def tool_call_id(block: Block) -> str:
    return prefixed("call_", block.tool_id)


class Translator:
    """Engine events -> Chat Completions chunks, and the whole ChatCompletion."""

    def __init__(self, request: ChatRequest, model: str) -> None:
        self._request = request
        self._model = model
        self._id = new_id("chatcmpl-")
        self._created = now()
        self._blocks = BlockTracker()

    def start(self, prompt: Usage | None = None) -> list[ChatCompletionChunk]:
        return [self._chunk(ChunkDelta(role="assistant", content=""))]

    def feed(self, event: Event) -> list[ChatCompletionChunk]:
        return [c for change in self._blocks.feed(event) for c in self._on(change)]

    def error(self, message: str) -> list[ChatCompletionChunk]:
        return [ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=[],
            error=ErrorBody(message=message, request_id=self._id),
        )]

    def response(self) -> ChatCompletion:
        finish = self._blocks.done()
        blocks = self._blocks
        calls = [ToolCallOut(id=tool_call_id(b), function=FunctionOut(name=b.name, arguments=b.text or "{}"))
                 for b in blocks.tools()]
        reasoning = blocks.reasoning() or None
        message = AssistantMessage(
            content=blocks.text() or (None if calls else ""),
            reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls or None,
        )
        return ChatCompletion(
            id=self._id, created=self._created, model=self._model,
            choices=[ChatChoice(message=message, finish_reason=finish_reason(finish))],
            usage=ChatUsage.of(finish.usage), timings=ChatTimings.of(finish.timings),
        )

    def _on(self, change: Change) -> list[ChatCompletionChunk]:
        block = change.block
        if change.kind == "finish":
            return self._end()
        if block is None or change.kind == "close":
            return []
        if block.kind == "tool":
            return [self._chunk(ChunkDelta(tool_calls=[self._tool_delta(change, block)]))]
        if change.kind != "delta":
            return []
        if block.kind == "text":
            return [self._chunk(ChunkDelta(content=change.text))]
        return [self._chunk(ChunkDelta(reasoning_content=change.text, reasoning=change.text))]

    def _tool_delta(self, change: Change, block: Block) -> ToolCallDeltaOut:
        if change.kind == "open":
            return ToolCallDeltaOut(
                index=block.tool_ordinal, id=tool_call_id(block), type="function",
                function=FunctionOut(name=block.name, arguments=""),
            )
        return ToolCallDeltaOut(index=block.tool_ordinal, function=FunctionOut(arguments=change.text))

    def _end(self) -> list[ChatCompletionChunk]:
        finish = self._blocks.done()
        if finish.reason == "error":
            return self.error(finish.error or "generation failed")
        timings = ChatTimings.of(finish.timings)
        last = self._chunk(ChunkDelta(), finish_reason(finish), timings)
        options = self._request.stream_options
        if not (options and options.include_usage):
            return [last]
        usage = ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=[],
            usage=ChatUsage.of(finish.usage), timings=timings,
        )
        return [last, usage]

    def _chunk(
        self, delta: ChunkDelta, reason: ChatFinishReason | None = None, timings: ChatTimings | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model,
            choices=[ChunkChoice(delta=delta, finish_reason=reason)], timings=timings,
        )
