"""Agent Tasks API (agent-tasks-api.txt): the create request, its conversation items, the task
object and the JSON-RPC envelope every answer is wrapped in.

``to_messages`` turns the request's history, user message and thought messages into the engine's
conversation; ``offered_tools`` applies ``allowed_tools`` / ``disallowed_tools``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, Tag, field_validator

from mashbox.api.base import (
    OutModel,
    Part,
    RequestModel,
    SamplingFields,
    UnsupportedPart,
    parameters_of,
    refuse_logprobs,
    type_of,
)
from mashbox.engine.request import Message, Named, Tool, ToolCall, ToolChoice, chosen

TaskStatus = Literal["created", "queued", "working", "input-required", "paused", "completed", "canceled",
                     "expired", "failed"]
STATUSES: tuple[TaskStatus, ...] = TaskStatus.__args__  # type: ignore[attr-defined]
FINAL: frozenset[str] = frozenset({"completed", "canceled", "expired", "failed"})
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# -- the request --------------------------------------------------------------

class TextPart(Part):
    type: Literal["text", "input_text", "output_text", "reasoning_text", "summary_text", "refusal"]
    text: str


class MediaPart(UnsupportedPart):
    type: Literal["image", "input_image", "output_image", "image_url", "input_audio", "output_audio", "audio",
                  "file"]


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]
Content = str | list[str | ContentPart]


class MessageIn(Part):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer", "tool"]
    message_content: Content | None = None
    content: Content | None = None  # the chat shape the spec's own example sends
    tool_call_id: str | None = None


class ReasoningIn(Part):
    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: list[TextPart] | None = None


class ToolCallIn(Part):
    type: Literal["tool_call"]
    call_id: str
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolResultIn(Part):
    type: Literal["tool_result"]
    call_id: str
    message_content: Content | None = None
    output: str | None = None


HistoryItem = Annotated[
    Annotated[MessageIn, Tag("message")] | Annotated[ReasoningIn, Tag("reasoning")]
    | Annotated[ToolCallIn, Tag("tool_call")] | Annotated[ToolResultIn, Tag("tool_result")],
    Discriminator(lambda value: type_of(value, "message")),
]


class FunctionDef(Part):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a call follows its tool's parameters here (a grammar), as OpenAI's strict


class ToolData(Part):
    type: Literal["function"] = "function"
    function: FunctionDef


class InferenceArgs(Part, SamplingFields):
    """``inference_args``: the generation fields of the other routes, checked the same way."""

    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    enable_thinking: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    _no_logprobs = field_validator("logprobs", "top_logprobs")(refuse_logprobs)

    def choice(self) -> ToolChoice:
        choice = self.tool_choice
        if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}} or {"name": ...}
            name = (choice.get("function") or choice).get("name")
            return "auto" if name is None else Named(str(name))
        return chosen(choice or "auto")


class AgentConfig(Part):
    developer_prompt: str | None = None
    inference_args: InferenceArgs | None = None
    max_response_length: Annotated[int, Field(ge=1)] | None = None


WRAPPER = {"name", "schema", "strict", "description"}  # OpenAI's json_schema object, around the schema
KEPT_METADATA = 16_384  # characters of metadata (as JSON) that a task keeps for the tasks' time to live
KEPT_ID = 1_024  # characters of its session_id and user_id


class CreateTask(RequestModel):
    accepted_ignored = ("allowed_subagents", "client_id", "env", "workspace_dir", "log_dir", "rollout_save_dir",
                        "return_rollout", "include_compress_model_rollout", "include_subagent_rollout")
    echoed = frozenset(f"{turns}[].{key}" for turns in ("history_messages", "thought_messages")
                       for key in ("id", "status", "language"))  # an output item's, sent back as history

    user_message_content: Content
    stream: StrictBool  # required, as the spec has it (the in-process Engine.task defaults it to false)
    structured_output: dict[str, Any] | None = None
    client_id: str | None = None
    request_id: str | int | None = None
    session_id: Annotated[str, Field(max_length=KEPT_ID)] | None = None
    task_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")] | None = None
    user_id: Annotated[str, Field(max_length=KEPT_ID)] | None = None
    agent_config: AgentConfig | None = None
    allowed_tools: list[str] | None = None
    disallowed_tools: list[str] | None = None
    allowed_subagents: list[str] | None = None
    stop_tools: list[str] | None = None
    client_tools: list[ToolData] | None = None
    history_messages: list[HistoryItem] | None = None
    thought_messages: list[HistoryItem] | None = None
    inference_args: InferenceArgs | None = None
    workspace_dir: str | None = None
    env: dict[str, str] | None = None
    log_dir: str | None = None
    rollout_save_dir: str | None = None
    return_rollout: bool | None = None
    include_compress_model_rollout: bool | None = None
    include_subagent_rollout: bool | None = None
    # mashbox's own fields (docs/tasks.md)
    background: bool | None = None  # keep running when the client goes away; retrieve it later
    previous_task_id: str | None = None
    max_steps: Annotated[int, Field(ge=1, le=100)] | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(json.dumps(value, ensure_ascii=False)) > KEPT_METADATA:
            raise ValueError(f"is kept with the task: at most {KEPT_METADATA} characters as JSON")
        return value

    @field_validator("structured_output")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if value.get("type") == "json_schema":  # OpenAI's response_format shape
            value = value.get("json_schema")
            if not isinstance(value, dict) or not isinstance(value.get("schema"), dict):
                raise ValueError("{'type': 'json_schema'} needs json_schema.schema: the JSON schema the answer follows")
        if isinstance(value.get("schema"), dict) and set(value) <= WRAPPER:  # {"name": ..., "schema": {...}}
            value = value["schema"]  # (a schema that has a "schema" property is a schema)
        return value

    def _more_ignored(self) -> list[str]:
        args = [f"inference_args.{k}" for k in (self.inference_args.model_extra or {})] if self.inference_args else []
        config = self.agent_config.model_extra or {} if self.agent_config else {}
        return args + [f"agent_config.{k}" for k in config]

    def args(self) -> InferenceArgs:
        """The request's inference args over the agent config's."""
        base = self.agent_config.inference_args if self.agent_config else None
        given = self.inference_args.model_dump(exclude_unset=True) if self.inference_args else {}
        merged = {**(base.model_dump(exclude_unset=True) if base else {}), **given}
        if self.agent_config and self.agent_config.max_response_length and "max_tokens" not in merged:
            merged["max_tokens"] = self.agent_config.max_response_length
        return InferenceArgs.model_validate(merged)


def text_of(content: Content | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p if isinstance(p, str) else p.text for p in content)


def client_tools(req: CreateTask) -> tuple[Tool, ...]:
    return tuple(Tool(t.function.name, t.function.description or "", parameters_of(t.function.parameters))
                 for t in req.client_tools or ())


def offered_tools(req: CreateTask, tools: tuple[Tool, ...]) -> tuple[Tool, ...]:
    """``tools`` less those ``allowed_tools`` leaves out (null: all) and ``disallowed_tools`` names."""
    allowed = None if req.allowed_tools is None else set(req.allowed_tools)
    banned = set(req.disallowed_tools or ())
    return tuple(t for t in tools if (allowed is None or t.name in allowed) and t.name not in banned)


def to_messages(req: CreateTask) -> list[Message]:
    """The conversation: the agent's prompt, the history, the user's message, the thoughts."""
    out = [Message("system", req.agent_config.developer_prompt)] if req.agent_config and \
        req.agent_config.developer_prompt else []
    user = text_of(req.user_message_content)
    for item in [*(req.history_messages or ()), *([MessageIn(role="user", content=user)] if user else []),
                 *(req.thought_messages or ())]:
        _add(out, item)
    return out


_ROLES = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _add(out: list[Message], item: Any) -> None:
    if isinstance(item, MessageIn):
        text = text_of(item.message_content if item.message_content is not None else item.content)
        out.append(Message(_ROLES[item.role], text, tool_call_id=item.tool_call_id))  # type: ignore[arg-type]
    elif isinstance(item, ToolResultIn):
        text = item.output if item.output is not None else text_of(item.message_content)
        out.append(Message("tool", text, tool_call_id=item.call_id))
    elif isinstance(item, ToolCallIn):
        args = item.arguments if isinstance(item.arguments, str) else json.dumps(item.arguments)
        call = ToolCall(item.call_id, item.name, args)
        last = out[-1] if out and out[-1].role == "assistant" else None
        if last is None:
            out.append(Message("assistant", tool_calls=(call,)))
        else:
            out[-1] = Message("assistant", last.content, (*last.tool_calls, call), reasoning=last.reasoning)
    else:  # reasoning: the next assistant turn's thinking
        text = text_of(item.content or item.summary)
        out.append(Message("assistant", "", reasoning=text))


# -- the answer ---------------------------------------------------------------

class OutText(OutModel):
    type: Literal["output_text", "reasoning_text"] = "output_text"
    text: str = ""
    annotations: list[Any] | None = None


class MessageOut(OutModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus = "in_progress"
    role: Literal["assistant"] = "assistant"
    message_content: list[OutText]


class ReasoningOut(OutModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: ItemStatus = "in_progress"
    summary: list[OutText] = []
    content: list[OutText]


class ToolCallOut(OutModel):
    type: Literal["tool_call"] = "tool_call"
    id: str
    status: ItemStatus = "in_progress"
    call_id: str
    name: str
    arguments: str = ""
    language: Literal["json"] = "json"


class ToolResultOut(OutModel):
    type: Literal["tool_result"] = "tool_result"
    id: str
    status: ItemStatus = "in_progress"
    call_id: str
    message_content: list[OutText]
    block_list: list[Any] = []


OutputItem = Annotated[MessageOut | ReasoningOut | ToolCallOut | ToolResultOut, Field(discriminator="type")]


class RpcError(OutModel):
    code: int
    message: str
    data: Any = None


class IncompleteDetails(OutModel):
    """Why a task's answer is cut short (as the spec's task examples and OpenAI's Responses)."""

    reason: Literal["max_output_tokens"] = "max_output_tokens"


class TaskObject(OutModel):
    object: Literal["task"] = "task"
    id: str
    session_id: str = ""
    user_id: str = ""
    status: TaskStatus = "created"
    created_at: int
    output: list[OutputItem] = []
    usage: dict[str, Any] | None = None
    error: RpcError | None = None
    incomplete_details: IncompleteDetails | None = None
    input_required: ToolCallOut | None = None
    input_required_calls: list[ToolCallOut] | None = None  # mashbox's: every call it waits on (the spec's holds one)
    metadata: dict[str, Any] = {}
    previous_task_id: str | None = None


class Envelope(OutModel):
    """Every answer: ``result`` (a task, a list of tasks or one stream event) or ``error``."""

    keep_none = frozenset({"id"})
    jsonrpc: Literal["2.0"] = "2.0"
    id: str | int | None = None
    result: Any = None
    error: RpcError | None = None
