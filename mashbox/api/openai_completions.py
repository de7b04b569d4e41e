"""OpenAI Completions: continue a plain prompt, no chat template.

Stream objects carry ``finish_reason: null`` until the last one, as OpenAI sends them; the
openai SDK's ``Completion`` type only admits a non-null reason, so only the last object and the
whole answer validate under it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from mashbox.api.base import (
    ErrorBody,
    LogitBias,
    OutModel,
    RequestModel,
    SamplingFields,
    Stream,
    StreamOptions,
    at_a_glance,
    engine_request,
    new_id,
    now,
    refuse_logprobs,
    unread_stream_options,
)
from mashbox.api.blocks import BlockTracker, Change
from mashbox.api.chat_output import ChatUsage  # OpenAI's one usage type for both routes
from mashbox.engine.events import Event, Finish, Usage
from mashbox.engine.request import EngineRequest


class CompletionRequest(RequestModel, LogitBias, SamplingFields):
    accepted_ignored = ("merge",)

    model: str | None = None
    prompt: str | list[str]
    stream: Stream = False
    stream_options: StreamOptions | None = None
    merge: bool | None = None
    prompt_cache_key: str | None = None
    logprobs: int | None = None

    _no_logprobs = field_validator("logprobs")(refuse_logprobs)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("give one prompt: a string, or a list of one string")
        return value

    def _more_ignored(self) -> list[str]:
        return unread_stream_options(self.stream, self.stream_options)

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def to_engine(req: CompletionRequest) -> EngineRequest:
    return engine_request(prompt=req.text(), sampling=req.sampling())


CompletionFinishReason = Literal["stop", "length"]


class CompletionChoice(OutModel):
    keep_none = frozenset({"finish_reason", "logprobs"})

    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: CompletionFinishReason | None = None


class Completion(OutModel):
    """The whole answer, or one object of a stream (then without usage, but for the last one where the request's
    ``stream_options.include_usage`` asks for it: no choices, the usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: ChatUsage | None = None
    system_fingerprint: str | None = None
    error: ErrorBody | None = None

    def _repr_markdown_(self) -> str:
        usage = self.usage
        return at_a_glance(self.choices[0].text if self.choices else "", self.choices[0].finish_reason if self.choices
                           else None, usage and usage.prompt_tokens, usage and usage.completion_tokens)


def finish_reason(finish: Finish) -> CompletionFinishReason:
    return "length" if finish.reason == "length" else "stop"


class Translator:
    """Engine events -> Completion stream objects, and the whole Completion."""

    def __init__(self, request: CompletionRequest, model: str) -> None:
        self._model = model
        self._id = new_id("cmpl-")
        self._created = now()
        self._fingerprint = None if request.seed is None else f"seed-{request.seed}"
        self._usage = bool(request.stream_options and request.stream_options.include_usage)
        self._blocks = BlockTracker()

    def start(self, prompt: Usage | None = None) -> list[Completion]:
        return []

    def feed(self, event: Event) -> list[Completion]:
        return [c for change in self._blocks.feed(event) for c in self._on(change)]

    def error(self, message: str) -> list[Completion]:
        return [Completion(id=self._id, created=self._created, model=self._model, choices=[],
                           error=ErrorBody(message=message, request_id=self._id))]

    def response(self) -> Completion:
        finish = self._blocks.done()
        return self._object(self._blocks.text(), finish_reason(finish), ChatUsage.of(finish.usage))

    def _on(self, change: Change) -> list[Completion]:
        if change.kind == "finish":
            finish = self._blocks.done()
            if finish.reason == "error":
                return self.error(finish.error or "generation failed")
            last = self._object("", finish_reason(finish))
            if not self._usage:
                return [last]
            return [last, last.model_copy(update={"choices": [], "usage": ChatUsage.of(finish.usage)})]
        block = change.block
        if change.kind == "delta" and block is not None and block.kind == "text":
            return [self._object(change.text)]
        return []

    def _object(
        self, text: str, reason: CompletionFinishReason | None = None, usage: ChatUsage | None = None
    ) -> Completion:
        return Completion(
            id=self._id, created=self._created, model=self._model,
            choices=[CompletionChoice(text=text, finish_reason=reason)],
            usage=usage, system_fingerprint=self._fingerprint,
        )
