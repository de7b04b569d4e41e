"""Agent Tasks API stream events, and the translator of one agent step's engine events into them.

Every event carries ``task_id``, ``agent_step`` and ``sequence_number`` (1, 2, 3, ... per task).
A step's output opens and closes items as the engine's blocks do: a text block is a ``message``
item with one ``output_text`` part, a reasoning block a ``reasoning`` item with one
``reasoning_text`` part, a tool call a ``tool_call`` item whose arguments stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field

from mashbox.api.base import OutModel, new_id
from mashbox.api.blocks import Block, BlockTracker, Change
from mashbox.api.task_items import (
    Envelope,
    MessageOut,
    OutputItem,
    OutText,
    ReasoningOut,
    TaskObject,
    ToolCallOut,
    ToolResultOut,
)
from mashbox.engine.events import Event

Lifecycle = Literal["task.created", "task.queued", "task.working", "task.input_required", "task.paused",
                    "task.completed", "task.failed", "task.canceled", "task.expired"]
STATUS_EVENT: dict[str, Lifecycle] = {
    "created": "task.created", "queued": "task.queued", "working": "task.working",
    "input-required": "task.input_required", "paused": "task.paused", "completed": "task.completed",
    "failed": "task.failed", "canceled": "task.canceled", "expired": "task.expired",
}


class Base(OutModel):
    task_id: str
    agent_step: int
    sequence_number: int = 0


class TaskLifecycleEvent(Base):
    type: Lifecycle
    task: TaskObject


class OutputItemEvent(Base):
    type: Literal["task.output_item.added", "task.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(Base):
    type: Literal["task.content_part.added", "task.content_part.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutText


class TextDeltaEvent(Base):
    type: Literal["task.output_text.delta", "task.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] | None = None


class TextDoneEvent(Base):
    type: Literal["task.output_text.done", "task.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] | None = None


class ArgumentsDeltaEvent(Base):
    type: Literal["task.tool_call_arguments.delta"] = "task.tool_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Base):
    type: Literal["task.tool_call_arguments.done"] = "task.tool_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ToolResultDeltaEvent(Base):
    type: Literal["task.tool_result.delta"] = "task.tool_result.delta"
    call_id: str
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ToolResultDoneEvent(Base):
    type: Literal["task.tool_result.done"] = "task.tool_result.done"
    call_id: str
    item_id: str
    output_index: int
    content_index: int = 0
    output: str


TaskEvent = Annotated[
    TaskLifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
    | ArgumentsDeltaEvent | ArgumentsDoneEvent | ToolResultDeltaEvent | ToolResultDoneEvent,
    Field(discriminator="type"),
]
Emit = Callable[..., Any]  # (event class, **fields) -> the event, numbered


class StepTranslator:
    """One agent step: engine events -> task events, appending the step's items to the task."""

    def __init__(self, task: TaskObject, emit: Emit) -> None:
        self._task, self._emit = task, emit
        self._blocks = BlockTracker()
        self._items: dict[int, Any] = {}  # block index -> its item
        self.calls: list[ToolCallOut] = []

    @property
    def finish(self) -> Any:
        return self._blocks.finish

    def text(self) -> str:
        return self._blocks.text()

    def reasoning(self) -> str:
        return self._blocks.reasoning()

    def feed(self, event: Event) -> list[Any]:
        return [e for change in self._blocks.feed(event) for e in self._on(change)]

    def interrupt(self) -> list[Any]:
        """Close the open item as ``incomplete`` (the step was paused or canceled)."""
        return [e for item in self._items.values() if item.status == "in_progress"
                for e in self._close(item, "incomplete")]

    def _on(self, change: Change) -> list[Any]:
        block = change.block
        if block is None:
            return []
        if change.kind == "open":
            return self._open(block)
        item = self._items[block.index]
        if change.kind == "close":
            return self._close(item, "incomplete" if self._blocks.cut else "completed")
        if isinstance(item, ToolCallOut):
            item.arguments += change.text
            return [self._emit(ArgumentsDeltaEvent, item_id=item.id, output_index=self._index(item),
                               delta=change.text)]
        (item.message_content if isinstance(item, MessageOut) else item.content)[0].text += change.text
        kind = "task.output_text.delta" if isinstance(item, MessageOut) else "task.reasoning_text.delta"
        return [self._emit(TextDeltaEvent, type=kind, item_id=item.id, output_index=self._index(item),
                           delta=change.text, logprobs=[] if isinstance(item, MessageOut) else None)]

    def _open(self, block: Block) -> list[Any]:
        item: Any
        if block.kind == "tool":
            item = ToolCallOut(id=new_id("tc_"), call_id=block.tool_id, name=block.name)
            self.calls.append(item)
        elif block.kind == "text":
            item = MessageOut(id=new_id("msg_"), message_content=[OutText(annotations=[])])
        else:
            item = ReasoningOut(id=new_id("rs_"), content=[OutText(type="reasoning_text")])
        self._items[block.index] = item
        self._task.output.append(item)
        events = [self._emit(OutputItemEvent, type="task.output_item.added", output_index=self._index(item),
                             item=item.model_copy(deep=True))]
        if not isinstance(item, ToolCallOut):
            part = OutText(type="output_text", annotations=[]) if isinstance(item, MessageOut) else \
                OutText(type="reasoning_text")
            events.append(self._emit(ContentPartEvent, type="task.content_part.added", item_id=item.id,
                                     output_index=self._index(item), part=part))
        return events

    def _close(self, item: Any, status: str) -> list[Any]:
        item.status = status
        index, events = self._index(item), []
        if isinstance(item, ToolCallOut):
            item.arguments = item.arguments or "{}"
            events.append(self._emit(ArgumentsDoneEvent, item_id=item.id, output_index=index, name=item.name,
                                     arguments=item.arguments))
        else:
            part = item.message_content[0] if isinstance(item, MessageOut) else item.content[0]
            kind = "output_text" if isinstance(item, MessageOut) else "reasoning_text"
            events.append(self._emit(TextDoneEvent, type=f"task.{kind}.done", item_id=item.id, output_index=index,
                                     text=part.text, logprobs=[] if kind == "output_text" else None))
            events.append(self._emit(ContentPartEvent, type="task.content_part.done", item_id=item.id,
                                     output_index=index, part=part.model_copy()))
        events.append(self._emit(OutputItemEvent, type="task.output_item.done", output_index=index,
                                 item=item.model_copy(deep=True)))
        return events

    def _index(self, item: Any) -> int:
        return next(i for i, it in enumerate(self._task.output) if it is item)


def tool_result_events(task: TaskObject, emit: Emit, call: ToolCallOut, text: str) -> list[Any]:
    """A tool's result as a finished ``tool_result`` item, appended to the task."""
    item = ToolResultOut(id=new_id("tr_"), call_id=call.call_id, message_content=[OutText(text="")])
    task.output.append(item)
    index = len(task.output) - 1
    events = [emit(OutputItemEvent, type="task.output_item.added", output_index=index, item=item.model_copy(deep=True))]
    item.message_content[0].text, item.status = text, "completed"
    common = {"call_id": call.call_id, "item_id": item.id, "output_index": index}
    events += [emit(ToolResultDeltaEvent, **common, delta=text), emit(ToolResultDoneEvent, **common, output=text),
               emit(OutputItemEvent, type="task.output_item.done", output_index=index, item=item.model_copy(deep=True))]
    return events


class TaskEnvelope(Envelope):
    """An answer holding one task (create, retrieve, delete; cancel, pause and resume add its fields)."""

    result: TaskObject | None = None


class TaskListEnvelope(Envelope):
    result: list[TaskObject] = []


class TaskEventEnvelope(Envelope):
    """One frame of a streamed create."""

    result: TaskEvent | None = None
