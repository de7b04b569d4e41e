"""OpenAI Chat Completions, the answer side: ChatCompletion, chunks, usage and timings."""

from __future__ import annotations

from typing import Literal

from mashbox.api.base import ErrorBody, OutModel, at_a_glance
from mashbox.engine.events import Timings, Usage


class ChatTimings(OutModel):
    keep_none = frozenset({"prompt_per_second", "predicted_per_second"})

    prompt_n: int
    prompt_ms: float
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float | None
    cache_n: int
    queue_ms: float

    @classmethod
    def of(cls, t: Timings) -> ChatTimings:
        return cls(
            prompt_n=t.prompt_n, prompt_ms=t.prompt_ms, prompt_per_second=t.prompt_per_second,
            predicted_n=t.predicted_n, predicted_ms=t.predicted_ms,
            predicted_per_second=t.predicted_per_second, cache_n=t.cache_n, queue_ms=t.queue_ms,
        )


class PromptTokensDetails(OutModel):
    cached_tokens: int


class CompletionTokensDetails(OutModel):
    reasoning_tokens: int
    accepted_prediction_tokens: int  # speculation: proposed tokens kept, and proposed tokens not
    rejected_prediction_tokens: int


class ChatUsage(OutModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails

    @classmethod
    def of(cls, u: Usage) -> ChatUsage:
        return cls(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
            completion_tokens_details=CompletionTokensDetails(
                reasoning_tokens=u.reasoning_tokens, accepted_prediction_tokens=u.accepted_tokens,
                rejected_prediction_tokens=u.rejected_tokens),
        )


class FunctionOut(OutModel):
    name: str | None = None
    arguments: str


class ToolCallOut(OutModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionOut


class AssistantMessage(OutModel):
    keep_none = frozenset({"content"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(OutModel):
    keep_none = frozenset({"logprobs"})  # OpenAI's null: log probabilities are not given

    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: ChatFinishReason


class ChatCompletion(OutModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    timings: ChatTimings | None = None

    def _repr_markdown_(self) -> str:
        choice = self.choices[0]
        calls = [f"`{c.function.name}({c.function.arguments})`" for c in choice.message.tool_calls or []]
        text = "\n".join([choice.message.content or "", *calls])
        return at_a_glance(text, choice.finish_reason, self.usage.prompt_tokens, self.usage.completion_tokens)


class ToolCallDeltaOut(OutModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionOut


class ChunkDelta(OutModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChunkChoice(OutModel):
    keep_none = frozenset({"finish_reason", "logprobs"})

    index: int = 0
    delta: ChunkDelta
    logprobs: None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(OutModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None
    timings: ChatTimings | None = None
    error: ErrorBody | None = None
