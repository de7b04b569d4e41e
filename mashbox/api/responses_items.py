"""Responses input items and their mapping to the canonical conversation.

An item without ``type`` is a message (as the OpenAI Agents SDK and Pi send them). Calls
(function, custom, local shell) that follow an assistant turn join that turn's message; a
reasoning item becomes the ``reasoning`` of the next assistant message.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from mashbox.api.base import Part, UnsupportedPart, type_of
from mashbox.api.responses_tools import LOCAL_SHELL, ToolMap
from mashbox.engine.request import Message, ToolCall
from mashbox.errors import InvalidRequestError


class TextPart(Part):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class RefusalPart(Part):
    type: Literal["refusal"]
    refusal: str


class MediaPart(UnsupportedPart):
    type: Literal["input_image", "input_audio", "input_file", "image", "audio", "file"]


ContentPart = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]
Content = str | list[ContentPart]


def text_of(content: Content | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in content if not isinstance(p, MediaPart))


class MessageItem(Part):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Content


class FunctionCallItem(Part):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"
    namespace: str | None = None


class CustomToolCallItem(Part):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str = ""
    namespace: str | None = None


class LocalShellAction(Part):
    type: Literal["exec"] = "exec"
    command: list[str] = Field(default_factory=list)
    working_directory: str | None = None
    timeout_ms: int | None = None


class LocalShellCallItem(Part):
    type: Literal["local_shell_call"]
    call_id: str | None = None
    id: str | None = None
    action: LocalShellAction


class CallOutputItem(Part):
    type: Literal["function_call_output", "custom_tool_call_output", "local_shell_call_output"]
    call_id: str | None = None
    id: str | None = None
    output: Content = ""


class ReasoningItem(Part):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None

    def text(self) -> str:
        return "\n".join(p.text for p in self.content or self.summary)


class ItemReference(Part):
    """An earlier item by its id, as the AI SDK sends the items OpenAI stored: refused, saying what to do."""

    type: Literal["item_reference"]

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        named = f" ({data['id']!r})" if isinstance(data, dict) and isinstance(data.get("id"), str) else ""
        raise InvalidRequestError("type", f"this server keeps no items, so an item_reference{named} cannot refer "
                                          "to one; send the items themselves in input (as clients do with "
                                          "store: false)", code="unsupported_value")


def _item_tag(value: Any) -> str:
    return type_of(value, "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[LocalShellCallItem, Tag("local_shell_call")]
    | Annotated[CallOutputItem, Tag("function_call_output")]
    | Annotated[CallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[CallOutputItem, Tag("local_shell_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ItemReference, Tag("item_reference")],
    Discriminator(_item_tag),
]


def to_messages(items: str | list[Any], tools: ToolMap) -> list[Message]:
    if isinstance(items, str):
        return [Message("user", items)]
    builder = _Builder(tools)
    for k, item in enumerate(items):
        start = len(builder.messages)
        builder.add(item)
        builder.messages[start:] = [dataclasses.replace(m, item=k) for m in builder.messages[start:]]
    return builder.messages


class _Builder:
    def __init__(self, tools: ToolMap) -> None:
        self.messages: list[Message] = []
        self._tools = tools
        self._reasoning: str | None = None

    def add(self, item: Any) -> None:
        if isinstance(item, MessageItem):
            self._message(item)
        elif isinstance(item, ReasoningItem):
            self._reasoning = "\n".join(filter(None, (self._reasoning, item.text()))) or None
        elif isinstance(item, CallOutputItem):
            call_id = item.call_id or item.id or ""
            self.messages.append(Message("tool", text_of(item.output), tool_call_id=call_id))
        else:
            self._call(_tool_call(item, self._tools))

    def _message(self, item: MessageItem) -> None:
        if item.role != "assistant":
            role = "system" if item.role == "developer" else item.role
            self.messages.append(Message(role, text_of(item.content)))
            return
        self.messages.append(Message("assistant", text_of(item.content), reasoning=self._reasoning))
        self._reasoning = None

    def _call(self, call: ToolCall) -> None:
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant":
            self.messages.append(Message("assistant", tool_calls=(call,), reasoning=self._reasoning))
        else:
            reasoning = last.reasoning or self._reasoning
            merged = dataclasses.replace(last, tool_calls=(*last.tool_calls, call), reasoning=reasoning)
            self.messages[-1] = merged
        self._reasoning = None


def _tool_call(item: Any, tools: ToolMap) -> ToolCall:
    if isinstance(item, FunctionCallItem):
        return ToolCall(item.call_id, tools.visible(item.name, item.namespace), item.arguments)
    if isinstance(item, CustomToolCallItem):
        name = tools.visible(item.name, item.namespace)
        return ToolCall(item.call_id, name, json.dumps({"input": item.input}))
    action = item.action
    args = {"command": action.command, "workdir": action.working_directory, "timeout_ms": action.timeout_ms}
    args = {k: v for k, v in args.items() if v is not None}
    return ToolCall(item.call_id or item.id or "", LOCAL_SHELL, json.dumps(args))
