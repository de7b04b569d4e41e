"""OpenAI Responses (Open Responses): the request model and ``to_engine``.

Input items live in ``responses_items.py``, tools in ``responses_tools.py``, the answer side
in ``responses_output.py`` (models) and ``responses_translator.py``; all are re-exported here.

``reasoning.effort`` maps to thinking: absent -> the model's default, ``none`` or ``minimal`` ->
off, any other effort -> on (the templates only know on and off).
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator, model_validator

from mashbox.api.base import (
    NO_LOGPROBS,
    STRUCTURED,
    MaxTokens,
    Part,
    RequestModel,
    SamplingFields,
    engine_request,
    refuse_logprobs,
)
from mashbox.api.responses_items import InputItem, to_messages
from mashbox.api.responses_output import Response, StreamEvent
from mashbox.api.responses_tools import (
    ResponsesTool,
    ToolChoice,
    ToolMap,
    allowed_tools,
    engine_tool_choice,
    skipped,
)
from mashbox.api.responses_translator import Translator
from mashbox.engine.request import EngineRequest, Message
from mashbox.errors import InvalidRequestError

__all__ = ["ResponsesRequest", "Response", "StreamEvent", "Translator", "to_engine"]

STATELESS = ("this server keeps no responses, so previous_response_id cannot refer to one; send the whole "
             "conversation in input (as clients do with store: false)")


class ReasoningConfig(Part):
    effort: str | None = None
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
    accepted_ignored = ("store", "client_metadata", "metadata")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    prompt_cache_key: str | None = None
    store: bool | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None

    _no_logprobs = field_validator("top_logprobs")(refuse_logprobs)

    @model_validator(mode="before")
    @classmethod
    def _stateless(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("previous_response_id") is not None:
            raise InvalidRequestError("previous_response_id", STATELESS, code="unsupported_parameter")
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
        return skipped(self.tools) + include + summary

    def tool_map(self) -> ToolMap:
        return ToolMap(self.tools)


def to_engine(req: ResponsesRequest) -> EngineRequest:
    tools = req.tool_map()
    messages = to_messages(req.input, tools)
    if req.instructions:
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
