"""OpenAI Responses (Open Responses): the request model, ``to_engine`` and the ``Translator``.

Input items live in ``responses_items.py``, tools in ``responses_tools.py``, the answer's models
in ``responses_output.py``; the ones callers need are re-exported here.

The Translator (engine events -> Responses stream events and the whole Response) makes every
block of the engine's answer one output item: reasoning -> ``reasoning`` (one ``reasoning_text``
part), text -> ``message`` (one ``output_text`` part), a tool call -> ``function_call`` (with its
``namespace`` when it came from one), ``custom_tool_call`` or ``local_shell_call``. Custom and
local-shell inputs are decoded from the JSON arguments, so they are sent whole when the call ends.
The stream ends with ``response.completed`` whatever the status (``incomplete`` when max tokens ran
out, and so is the item they cut), as DESIGN.md's order says; a failure ends it with ``error`` then
``response.failed``; then ``data: [DONE]``, as open-responses.md says.

``reasoning.effort`` maps to thinking: absent -> the model's default, ``none`` or ``minimal`` ->
off, any other effort -> on (the templates only know on and off).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from mashbox.api.base import (
    NO_LOGPROBS,
    STRUCTURED,
    MaxTokens,
    Part,
    RequestModel,
    SamplingFields,
    Stream,
    engine_request,
    json_object,
    new_id,
    now,
    prefixed,
    refuse_logprobs,
)
from mashbox.api.blocks import Block, BlockTracker, Change
from mashbox.api.responses_items import InputItem, to_messages
from mashbox.api.responses_output import (
    ArgumentsDoneEvent,
    CallDeltaEvent,
    ContentPartEvent,
    CustomToolCallOut,
    ErrorEvent,
    FunctionCallOut,
    IncompleteDetails,
    ItemStatus,
    InputDoneEvent,
    LocalShellActionOut,
    LocalShellCallOut,
    MessageOut,
    OutputItemEvent,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningEcho,
    ReasoningOut,
    ReasoningText,
    Response,
    ResponseError,
    ResponseLifecycle,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
    EventBase,
)
from mashbox.api.responses_tools import (
    ResponsesTool,
    ToolChoice,
    ToolMap,
    allowed_tools,
    echo_tool,
    echo_tool_choice,
    engine_tool_choice,
    skipped,
)
from mashbox.engine.events import Event, Usage
from mashbox.engine.request import EngineRequest, Message
from mashbox.errors import InvalidRequestError

__all__ = ["ResponsesRequest", "Response", "StreamEvent", "Translator", "to_engine"]

STATEFUL = {"previous_response_id": "responses", "conversation": "conversations", "prompt": "prompts"}  # what
# each field refers to, which this server does not keep: refused unless null (ignored, the answer lacked it)


def stateless(field: str) -> str:
    return (f"this server keeps no {STATEFUL[field]}, so {field} cannot refer to one; send the whole conversation "
            "in input (as clients do with store: false)")


class ReasoningConfig(Part):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None

    def thinking(self) -> bool | None:
        return None if self.effort is None else self.effort not in ("none", "minimal")


class TextConfig(Part):
    format: dict[str, Any] | None = None

    @field_validator("format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError(STRUCTURED)
        return value


class ResponsesRequest(RequestModel, SamplingFields):
    accepted_ignored = ("store", "client_metadata")
    echoed = frozenset({"input[].id", "input[].status"})  # an output item's, sent back in the next turn's input

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    stream: Stream = False
    prompt_cache_key: str | None = None
    store: bool | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    previous_response_id: str | None = None  # refused unless null (STATEFUL): known, so a keyword gets the reason

    _no_logprobs = field_validator("top_logprobs")(refuse_logprobs)

    @model_validator(mode="before")
    @classmethod
    def _stateless(cls, data: Any) -> Any:
        for field in STATEFUL:  # a prompt that is no stored one's reference ({"id": ...}) is ignored, as before
            value = data.get(field) if isinstance(data, dict) else None
            if value is not None and (field != "prompt" or isinstance(value, dict)):
                raise InvalidRequestError(field, stateless(field), code="unsupported_parameter")
        return data

    @field_validator("include")
    @classmethod
    def _no_logprobs_include(cls, value: list[str] | None) -> list[str] | None:
        if any("logprobs" in entry for entry in value or ()):
            raise ValueError(NO_LOGPROBS)
        return value

    def max_new_tokens(self) -> int | None:
        return self.max_output_tokens or super().max_new_tokens()

    def _more_ignored(self) -> list[str]:
        include = [f"include[{entry}]" for entry in self.include or ()]
        summary = ["reasoning.summary"] if self.reasoning and self.reasoning.summary else []
        return skipped(self.tools, self.tool_choice) + include + summary

    def tool_map(self) -> ToolMap:
        return ToolMap(self.tools)


def to_engine(req: ResponsesRequest) -> EngineRequest:
    tools = req.tool_map()
    messages = to_messages(req.input, tools)
    if req.instructions or (req.instructions is not None and messages):  # "": no system text, nor the template's
        messages.insert(0, Message("system", req.instructions))
    if not messages:
        raise InvalidRequestError("input", "must hold at least one item")
    return engine_request(
        messages=tuple(messages),
        sampling=req.sampling(),
        tools=allowed_tools(req.tool_choice, tools),
        tool_choice=engine_tool_choice(req.tool_choice, tools),
        parallel_tool_calls=bool(req.parallel_tool_calls),  # the Server API's default: false
        enable_thinking=req.reasoning.thinking() if req.reasoning else None,
    )


_PREFIX = {"text": "msg_", "reasoning": "rs_", "function": "fc_", "custom": "ctc_", "local_shell": "lsh_"}


def _custom_input(text: str) -> str:
    value = json_object(text).get("input")
    return value if isinstance(value, str) else text


def _echo(request: ResponsesRequest, model: str) -> dict[str, Any]:
    """The Response fields that repeat the request."""
    sampling, reasoning = request.sampling(), request.reasoning
    return {
        "model": model,
        "parallel_tool_calls": bool(request.parallel_tool_calls),  # as sent; the Server API's default: false
        "tool_choice": echo_tool_choice(request.tool_choice),
        "tools": [echo_tool(t) for t in request.tools or ()],
        "instructions": request.instructions,
        "max_output_tokens": request.max_new_tokens(),  # what ran (also max_tokens, the other routes' name)
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "reasoning": ReasoningEcho(effort=reasoning.effort, summary=reasoning.summary) if reasoning else None,
        "prompt_cache_key": request.prompt_cache_key,
        "metadata": request.metadata or {},
    }


class Translator:
    """Engine events -> Responses stream events, and the whole Response."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self._echo = _echo(request, request.model or model)
        self._tools = request.tool_map()
        self._id = new_id("resp_")
        self._created = now()
        self._seq = 0
        self._completed_at: int | None = None
        self._item_ids: dict[int, str] = {}
        self._output: dict[int, Any] = {}
        self._blocks = BlockTracker()

    def start(self, prompt: Usage | None = None) -> list[EventBase]:
        return [self._life("response.created"), self._life("response.in_progress")]

    def feed(self, event: Event) -> list[EventBase]:
        return [e for change in self._blocks.feed(event) for e in self._on(change)]

    def error(self, message: str) -> list[EventBase]:
        error = ErrorEvent.of(self._next(), message, self._id)
        failed = self._snapshot("failed", ResponseError(message=message))
        return [error, ResponseLifecycle(type="response.failed", sequence_number=self._next(), response=failed)]

    def response(self) -> Response:
        finish = self._blocks.done()
        if finish.reason == "error":
            return self._snapshot("failed", ResponseError(message=finish.error or "generation failed"))
        return self._snapshot("incomplete" if finish.reason == "length" else "completed")

    def _on(self, change: Change) -> list[EventBase]:
        block = change.block
        if change.kind == "finish":
            self._completed_at = now()
            return self._end()
        if block is None:
            return []
        kind = self._kind(block)
        if change.kind == "open":
            return self._open(block, kind)
        if change.kind == "delta":
            return self._delta(block, kind, change.text)
        return self._close(block, kind)

    def _open(self, block: Block, kind: str) -> list[EventBase]:
        self._item_ids[block.index] = new_id(_PREFIX[kind])
        if kind == "local_shell":
            return []
        events: list[EventBase] = [self._item_event("response.output_item.added", block, "in_progress")]
        part = self._part(block, "")
        if part is not None:
            events.append(self._part_event("response.content_part.added", block, part))
        return events

    def _delta(self, block: Block, kind: str, text: str) -> list[EventBase]:
        item_id, index = self._item_ids[block.index], block.index
        if kind == "text":
            return [TextDeltaEvent(sequence_number=self._next(), item_id=item_id, output_index=index, delta=text)]
        if kind == "reasoning":
            return [ReasoningDeltaEvent(sequence_number=self._next(), item_id=item_id, output_index=index,
                                        delta=text)]
        if kind != "function":
            return []
        return [CallDeltaEvent(type="response.function_call_arguments.delta", sequence_number=self._next(),
                               item_id=item_id, output_index=index, delta=text)]

    def _close(self, block: Block, kind: str) -> list[EventBase]:
        status: ItemStatus = "incomplete" if self._blocks.cut else "completed"
        self._output[block.index] = self._item(block, status)
        if kind == "local_shell":
            added = self._item_event("response.output_item.added", block, "in_progress")
            return [added, self._item_event("response.output_item.done", block, status)]
        events = self._close_content(block, kind)
        part = self._part(block, block.text)
        if part is not None:
            events.append(self._part_event("response.content_part.done", block, part))
        return [*events, self._item_event("response.output_item.done", block, status)]

    def _close_content(self, block: Block, kind: str) -> list[EventBase]:
        item_id, index, text = self._item_ids[block.index], block.index, block.text
        if kind == "text":
            return [TextDoneEvent(sequence_number=self._next(), item_id=item_id, output_index=index, text=text)]
        if kind == "reasoning":
            return [ReasoningDoneEvent(sequence_number=self._next(), item_id=item_id, output_index=index, text=text)]
        if kind == "function":
            return [ArgumentsDoneEvent(sequence_number=self._next(), item_id=item_id, output_index=index,
                                       arguments=text or "{}")]
        whole = _custom_input(text)
        return [
            CallDeltaEvent(type="response.custom_tool_call_input.delta", sequence_number=self._next(),
                           item_id=item_id, output_index=index, delta=whole),
            InputDoneEvent(sequence_number=self._next(), item_id=item_id, output_index=index, input=whole),
        ]

    def _end(self) -> list[EventBase]:
        finish = self._blocks.done()
        if finish.reason == "error":
            return self.error(finish.error or "generation failed")
        return [ResponseLifecycle(type="response.completed", sequence_number=self._next(), response=self.response())]

    def _kind(self, block: Block) -> str:
        return block.kind if block.kind != "tool" else self._tools.ref(block.name).kind

    def _item(self, block: Block, status: ItemStatus) -> Any:
        kind = self._kind(block)
        whole = status != "in_progress" or kind == "local_shell"
        item_id, text = self._item_ids[block.index], block.text if whole else ""
        if kind == "text":
            parts = [OutputText(text=text)] if whole else []
            return MessageOut(id=item_id, status=status, content=parts)
        if kind == "reasoning":
            thoughts = [ReasoningText(text=text)] if whole else []
            return ReasoningOut(id=item_id, status=status, content=thoughts)
        return self._call_item(block, kind, item_id, status, text)

    def _call_item(self, block: Block, kind: str, item_id: str, status: ItemStatus, text: str) -> Any:
        ref, call_id = self._tools.ref(block.name), prefixed("call_", block.tool_id)
        if kind == "custom":
            custom_input = _custom_input(text) if text else ""
            return CustomToolCallOut(id=item_id, status=status, call_id=call_id, name=ref.name,
                                     input=custom_input, namespace=ref.namespace)
        if kind == "local_shell":
            args = json_object(text)
            action = LocalShellActionOut(
                command=[str(c) for c in args.get("command") or []],
                working_directory=args.get("workdir"), timeout_ms=args.get("timeout_ms"),
            )
            return LocalShellCallOut(id=item_id, status=status, call_id=call_id, action=action)
        arguments = (text or "{}") if status != "in_progress" else ""
        return FunctionCallOut(id=item_id, status=status, call_id=call_id, name=ref.name,
                               arguments=arguments, namespace=ref.namespace)

    def _part(self, block: Block, text: str) -> OutputText | ReasoningText | None:
        if block.kind == "text":
            return OutputText(text=text)
        return ReasoningText(text=text) if block.kind == "reasoning" else None

    def _item_event(self, kind: Any, block: Block, status: ItemStatus) -> OutputItemEvent:
        item = self._item(block, status)
        return OutputItemEvent(type=kind, sequence_number=self._next(), output_index=block.index, item=item)

    def _part_event(self, kind: Any, block: Block, part: OutputText | ReasoningText) -> ContentPartEvent:
        return ContentPartEvent(
            type=kind, sequence_number=self._next(), item_id=self._item_ids[block.index],
            output_index=block.index, part=part,
        )

    def _life(self, kind: Any) -> ResponseLifecycle:
        return ResponseLifecycle(type=kind, sequence_number=self._next(), response=self._snapshot("in_progress"))

    def _snapshot(self, status: Any, error: ResponseError | None = None) -> Response:
        finish = self._blocks.finish
        done = status in ("completed", "incomplete")
        return Response(
            **self._echo, id=self._id, created_at=self._created, status=status,
            completed_at=self._completed_at if done else None,
            output=[self._output[i] for i in sorted(self._output)],
            usage=ResponseUsage.of(finish.usage) if finish is not None and done else None,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            error=error,
        )

    def _next(self) -> int:
        self._seq += 1
        return self._seq
