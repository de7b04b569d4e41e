"""OpenAI Responses, the answer side: Response, output items and stream event models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from mashbox.api.base import OutModel, at_a_glance
from mashbox.engine.events import Usage

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(OutModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(OutModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageOut(OutModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningOut(OutModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallOut(OutModel):
    type: Literal["function_call"] = "function_call"
    id: str
    status: ItemStatus
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class CustomToolCallOut(OutModel):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str
    status: ItemStatus
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class LocalShellActionOut(OutModel):
    type: Literal["exec"] = "exec"
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    working_directory: str | None = None
    timeout_ms: int | None = None


class LocalShellCallOut(OutModel):
    type: Literal["local_shell_call"] = "local_shell_call"
    id: str
    status: ItemStatus
    call_id: str
    action: LocalShellActionOut


OutputItem = Annotated[
    MessageOut | ReasoningOut | FunctionCallOut | CustomToolCallOut | LocalShellCallOut,
    Field(discriminator="type"),
]


class InputTokensDetails(OutModel):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(OutModel):
    reasoning_tokens: int


class ResponseUsage(OutModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, u: Usage) -> ResponseUsage:
        return cls(
            input_tokens=u.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=u.cached_tokens),
            output_tokens=u.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=u.reasoning_tokens),
            total_tokens=u.total_tokens,
        )


class IncompleteDetails(OutModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(OutModel):
    code: Literal["server_error"] = "server_error"
    message: str


class TextFormat(OutModel):
    type: Literal["text"] = "text"


class TextField(OutModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningEcho(OutModel):
    keep_none = frozenset({"effort", "summary"})

    effort: str | None = None
    summary: str | None = None


class Response(OutModel):
    """The Responses ``Response``, with every field Open Responses requires (nullable ones null)."""

    keep_none = frozenset({
        "usage", "incomplete_details", "error", "instructions", "max_output_tokens", "completed_at",
        "previous_response_id", "reasoning", "max_tool_calls", "safety_identifier", "prompt_cache_key",
    })

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: None = None
    truncation: Literal["disabled"] = "disabled"
    text: TextField = Field(default_factory=TextField)
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    top_logprobs: int = 0
    reasoning: ReasoningEcho | None = None
    max_tool_calls: None = None
    store: bool = False
    background: bool = False
    service_tier: str = "default"
    metadata: dict[str, Any] = Field(default_factory=dict)  # the request's, as sent
    safety_identifier: None = None
    prompt_cache_key: str | None = None

    @property
    def output_text(self) -> str:
        """The text of every message in the output, joined (as the openai SDK's ``Response.output_text``)."""
        return "".join(part.text for item in self.output if isinstance(item, MessageOut) for part in item.content)

    def _repr_markdown_(self) -> str:
        usage = self.usage
        return at_a_glance(self.output_text, self.status, usage and usage.input_tokens, usage and usage.output_tokens)


class EventBase(OutModel):
    sequence_number: int


class ResponseLifecycle(EventBase):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.failed"]
    response: Response


class OutputItemEvent(EventBase):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _ItemEvent(EventBase):
    item_id: str
    output_index: int


class ContentPartEvent(_ItemEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    content_index: int = 0
    part: Annotated[OutputText | ReasoningText, Field(discriminator="type")]


class TextDeltaEvent(_ItemEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_ItemEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningDeltaEvent(_ItemEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    content_index: int = 0
    delta: str


class ReasoningDoneEvent(_ItemEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    content_index: int = 0
    text: str


class CallDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta", "response.custom_tool_call_input.delta"]
    delta: str


class ArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    arguments: str


class InputDoneEvent(_ItemEvent):
    type: Literal["response.custom_tool_call_input.done"] = "response.custom_tool_call_input.done"
    input: str


class ErrorPayload(OutModel):
    keep_none = frozenset({"param"})

    type: str = "server_error"
    code: str = "server_error"
    message: str
    param: str | None = None


class ErrorEvent(EventBase):
    """The error both ways: flat (the OpenAI SDK) and under ``error`` (Open Responses), with the response's id
    as ``request_id`` (as the other routes' error events carry theirs)."""

    keep_none = frozenset({"param"})

    type: Literal["error"] = "error"
    code: str = "server_error"
    message: str
    param: str | None = None
    error: ErrorPayload
    request_id: str

    @classmethod
    def of(cls, sequence_number: int, message: str, request_id: str) -> ErrorEvent:
        return cls(sequence_number=sequence_number, message=message, error=ErrorPayload(message=message),
                   request_id=request_id)


StreamEvent = Annotated[
    ResponseLifecycle | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
    | ReasoningDeltaEvent | ReasoningDoneEvent | CallDeltaEvent | ArgumentsDoneEvent
    | InputDoneEvent | ErrorEvent,
    Field(discriminator="type"),
]
