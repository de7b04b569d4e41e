"""``Engine``: the product. The four protocols (and agent tasks) as typed methods over one
continuously batched ``Runtime``, usable from plain code, a notebook or a server.

``stream(EngineRequest)`` (the Runtime's) yields the engine's events; ``chat``, ``complete``,
``respond`` and ``message`` translate a protocol request into that, and the events back into the
protocol's response (or, with ``stream=True``, an iterator of its stream events). ``achat`` ...
are the async twins. Which module and request model answer each method comes from the protocol
registry the server reads too (``mashbox.api.protocols``).

Each method's overloads give type checkers its keyword parameters (``mashbox.api.params``) and
the return type ``stream`` picks; a request passed whole (a dict or model) may stream or not.
``self, /`` in the overloads: positional-only, as in the implementations (mypy requires it).
"""

from __future__ import annotations

import difflib
import numbers
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Literal, Unpack, overload

from pydantic import BaseModel

from mashbox.api import anthropic_messages, local_tasks
from mashbox.api.anthropic_messages import AnthropicMessage, TokenCount
from mashbox.api.anthropic_messages import StreamEvent as MessageEvent
from mashbox.api.base import MAX_DEPTH, parse, plain
from mashbox.api.chat_output import ChatCompletion, ChatCompletionChunk
from mashbox.api.openai_completions import Completion
from mashbox.api.openai_responses import Response
from mashbox.api.openai_responses import StreamEvent as ResponseEvent
from mashbox.api.params import (
    ChatParams,
    CompletionParams,
    CountTokensParams,
    MessagesParams,
    ResponsesParams,
)
from mashbox.api.protocols import PROTOCOLS, prepare, start_usage
from mashbox.api.task_items import CreateTask
from mashbox.engine.events import Event, Finish, Queued, closed
from mashbox.engine.request import EngineRequest
from mashbox.engine.runtime import Job, Runtime
from mashbox.errors import (
    EngineClosedError,
    GenerationError,
    InvalidRequestError,
)

Request = Mapping[str, Any] | BaseModel  # a whole request: a dict as the server reads a body, or its model


class IgnoredFieldsWarning(UserWarning):
    """A request carried fields mashbox accepts but does not act on."""


class Engine(Runtime):
    """One model, answering many requests at once, in the protocols agents and SDKs speak.

    >>> with Engine() as engine:
    ...     engine.chat(messages=[{"role": "user", "content": "Hi"}]).choices[0].message.content
    """

    @overload
    def chat(self, /, *, stream: Literal[True], **fields: Unpack[ChatParams]) -> Iterator[ChatCompletionChunk]: ...
    @overload
    def chat(self, /, *, stream: Literal[False] = False, **fields: Unpack[ChatParams]) -> ChatCompletion: ...
    @overload
    def chat(self, /, *, stream: bool, **fields: Unpack[ChatParams]) -> ChatCompletion | Iterator[ChatCompletionChunk]: ...
    @overload
    def chat(self, request: Request, /) -> ChatCompletion | Iterator[ChatCompletionChunk]: ...
    def chat(self, request: Any = None, /, **fields: Any) -> Any:
        """OpenAI Chat Completions: a ChatCompletion, or chunks with stream=True."""
        return self._call("chat", request, fields)

    @overload
    def complete(self, /, *, stream: Literal[True], **fields: Unpack[CompletionParams]) -> Iterator[Completion]: ...
    @overload
    def complete(self, /, *, stream: Literal[False] = False, **fields: Unpack[CompletionParams]) -> Completion: ...
    @overload
    def complete(self, /, *, stream: bool, **fields: Unpack[CompletionParams]) -> Completion | Iterator[Completion]: ...
    @overload
    def complete(self, request: Request, /) -> Completion | Iterator[Completion]: ...
    def complete(self, request: Any = None, /, **fields: Any) -> Any:
        """OpenAI Completions: a Completion, or Completion chunks with stream=True."""
        return self._call("complete", request, fields)

    @overload
    def respond(self, /, *, stream: Literal[True], **fields: Unpack[ResponsesParams]) -> Iterator[ResponseEvent]: ...
    @overload
    def respond(self, /, *, stream: Literal[False] = False, **fields: Unpack[ResponsesParams]) -> Response: ...
    @overload
    def respond(self, /, *, stream: bool, **fields: Unpack[ResponsesParams]) -> Response | Iterator[ResponseEvent]: ...
    @overload
    def respond(self, request: Request, /) -> Response | Iterator[ResponseEvent]: ...
    def respond(self, request: Any = None, /, **fields: Any) -> Any:
        """OpenAI Responses: a Response, or Responses stream events with stream=True."""
        return self._call("respond", request, fields)

    @overload
    def message(self, /, *, stream: Literal[True], **fields: Unpack[MessagesParams]) -> Iterator[MessageEvent]: ...
    @overload
    def message(self, /, *, stream: Literal[False] = False, **fields: Unpack[MessagesParams]) -> AnthropicMessage: ...
    @overload
    def message(self, /, *, stream: bool, **fields: Unpack[MessagesParams]) -> AnthropicMessage | Iterator[MessageEvent]: ...
    @overload
    def message(self, request: Request, /) -> AnthropicMessage | Iterator[MessageEvent]: ...
    def message(self, request: Any = None, /, **fields: Any) -> Any:
        """Anthropic Messages: a Message, or Messages stream events with stream=True."""
        return self._call("message", request, fields)

    @overload
    async def achat(self, /, *, stream: Literal[True], **fields: Unpack[ChatParams]) -> AsyncIterator[ChatCompletionChunk]: ...
    @overload
    async def achat(self, /, *, stream: Literal[False] = False, **fields: Unpack[ChatParams]) -> ChatCompletion: ...
    @overload
    async def achat(self, /, *, stream: bool, **fields: Unpack[ChatParams]) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]: ...
    @overload
    async def achat(self, request: Request, /) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]: ...
    async def achat(self, request: Any = None, /, **fields: Any) -> Any:
        return await self._acall("chat", request, fields)

    @overload
    async def acomplete(self, /, *, stream: Literal[True], **fields: Unpack[CompletionParams]) -> AsyncIterator[Completion]: ...
    @overload
    async def acomplete(self, /, *, stream: Literal[False] = False, **fields: Unpack[CompletionParams]) -> Completion: ...
    @overload
    async def acomplete(self, /, *, stream: bool, **fields: Unpack[CompletionParams]) -> Completion | AsyncIterator[Completion]: ...
    @overload
    async def acomplete(self, request: Request, /) -> Completion | AsyncIterator[Completion]: ...
    async def acomplete(self, request: Any = None, /, **fields: Any) -> Any:
        return await self._acall("complete", request, fields)

    @overload
    async def arespond(self, /, *, stream: Literal[True], **fields: Unpack[ResponsesParams]) -> AsyncIterator[ResponseEvent]: ...
    @overload
    async def arespond(self, /, *, stream: Literal[False] = False, **fields: Unpack[ResponsesParams]) -> Response: ...
    @overload
    async def arespond(self, /, *, stream: bool, **fields: Unpack[ResponsesParams]) -> Response | AsyncIterator[ResponseEvent]: ...
    @overload
    async def arespond(self, request: Request, /) -> Response | AsyncIterator[ResponseEvent]: ...
    async def arespond(self, request: Any = None, /, **fields: Any) -> Any:
        return await self._acall("respond", request, fields)

    @overload
    async def amessage(self, /, *, stream: Literal[True], **fields: Unpack[MessagesParams]) -> AsyncIterator[MessageEvent]: ...
    @overload
    async def amessage(self, /, *, stream: Literal[False] = False, **fields: Unpack[MessagesParams]) -> AnthropicMessage: ...
    @overload
    async def amessage(self, /, *, stream: bool, **fields: Unpack[MessagesParams]) -> AnthropicMessage | AsyncIterator[MessageEvent]: ...
    @overload
    async def amessage(self, request: Request, /) -> AnthropicMessage | AsyncIterator[MessageEvent]: ...
    async def amessage(self, request: Any = None, /, **fields: Any) -> Any:
        return await self._acall("message", request, fields)

    @overload
    def count_tokens(self, /, **fields: Unpack[CountTokensParams]) -> TokenCount: ...
    @overload
    def count_tokens(self, request: Request, /) -> TokenCount: ...
    def count_tokens(self, request: Any = None, /, **fields: Any) -> TokenCount:
        """Anthropic count_tokens: prompt tokens a Messages request would use."""
        self._check_open()
        model = anthropic_messages.CountTokensRequest
        req = parse(model, _merge(request, fields, model, "count_tokens"))
        _warn_ignored(req.ignored_fields(), stacklevel=3)
        return TokenCount(input_tokens=len(self.encode(anthropic_messages.to_engine(req))))

    def _prepare(self, name: str, request: Any, fields: dict[str, Any]) -> tuple[Any, Any, EngineRequest, Job]:
        protocol = PROTOCOLS[name]
        prepared = prepare(protocol, _merge(request, fields, protocol.request, name), self.model_id)
        _warn_ignored(prepared.ignored, stacklevel=5)  # the caller's line, past _prepare, _call and chat
        translator = protocol.module.Translator(prepared.req, self.model_id)
        try:
            job = self._job(prepared.engine)
        except InvalidRequestError as err:
            raise protocol.named(err) from None
        return prepared.req, translator, prepared.engine, job

    def _call(self, name: str, request: Any, fields: dict[str, Any]) -> Any:
        req, translator, engine, job = self._prepare(name, request, fields)
        events = self._events(job, engine)
        if req.stream:
            return _translated(translator, events, PROTOCOLS[name].start_tells_cache)
        for event in events:
            _check(name, event)
            translator.feed(event)
        return translator.response()

    async def _acall(self, name: str, request: Any, fields: dict[str, Any]) -> Any:
        req, translator, engine, job = self._prepare(name, request, fields)
        events = self._aevents(job, engine)
        if req.stream:
            return _atranslated(translator, events, PROTOCOLS[name].start_tells_cache)
        async for event in events:
            _check(name, event)
            translator.feed(event)
        return translator.response()

    def task(self, request: Any = None, /, **fields: Any) -> Any:
        """Agent Tasks (docs/tasks.md): the agent loop over this engine. A ``TaskObject``, or its
        ``task.*`` events with stream=True. ``client_tools`` may hold Python functions: the loop
        calls them itself; a client tool given as a description stops the task ``input-required``."""
        return local_tasks.run_sync(self._task_loop(request, fields, "task"))

    async def atask(self, request: Any = None, /, **fields: Any) -> Any:
        return await local_tasks.run_async(self._task_loop(request, fields, "atask"))

    def _task_loop(self, request: Any, fields: dict[str, Any], name: str) -> local_tasks.TaskLoop:
        loop = local_tasks.prepare(_merge(request, fields, CreateTask, name), self._task_stream, self.abort)
        _warn_ignored(loop.req.ignored_fields(), stacklevel=4)  # the caller's line, past _task_loop and task
        return loop

    async def _task_stream(self, request: EngineRequest) -> AsyncIterator[Event]:
        """A task's generation: one that this engine's close ended raises, its usage with it, so that the task fails
        stopped (-32012) with its tokens counted, as the server's do; a cancel's or pause's abort is the loop's."""
        async for event in self.astream(request):
            _closed(event)
            yield event


def _check(method: str, event: Event) -> None:
    """A failed request raises, but where its protocol has a failed answer (a Response's status)."""
    _stopped(event)
    if isinstance(event, Finish) and event.reason == "error" and method != "respond":
        if event.param:  # its own input failed it (a grammar that could not go on)
            raise InvalidRequestError(event.param, event.error or "cannot be followed")
        raise GenerationError(f"the request failed: {event.error or 'generation failed'}")


def _stopped(event: Event) -> None:
    """A request stopped from outside while its caller still reads it (the engine closed, or ``abort``)
    raises, streamed or not: its answer is not whole, and must not look finished."""
    _closed(event)
    if isinstance(event, Finish) and event.reason == "abort":
        raise GenerationError("the request was aborted before it finished")


def _closed(event: Event) -> None:
    if closed(event):
        raise EngineClosedError("the engine was closed before this request finished", usage=event.usage)


def _translated(translator: Any, events: Iterator[Event], tells_cache: bool) -> Iterator[Any]:
    """``tells_cache``: the first item says how the prompt met the cache (Anthropic's message_start), so
    it waits for the request's slot (``Started``), as the server's first frame does."""
    try:
        first = next(events)  # Queued: the prompt's length, before any output
        started = next(events) if tells_cache and isinstance(first, Queued) else None
        yield from translator.start(start_usage(first, started))
        yield from translator.feed(first)
        if started is not None:
            _stopped(started)
            yield from translator.feed(started)
        for event in events:
            _stopped(event)
            yield from translator.feed(event)
    finally:
        events.close()  # type: ignore[attr-defined]


async def _atranslated(translator: Any, events: AsyncIterator[Event], tells_cache: bool) -> AsyncIterator[Any]:
    try:
        first = await anext(events)
        started = await anext(events) if tells_cache and isinstance(first, Queued) else None
        for item in [*translator.start(start_usage(first, started)), *translator.feed(first)]:
            yield item
        if started is not None:
            _stopped(started)
            for item in translator.feed(started):
                yield item
        async for event in events:
            _stopped(event)
            for item in translator.feed(event):
                yield item
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _merge(request: Any, fields: dict[str, Any], model: type[BaseModel], method: str) -> Mapping[str, Any]:
    """The request as a body: ``request`` (a dict, or a model given as its fields: unknown ones are
    reported as over HTTP) or the keyword ``fields``, where an unknown name is a mistake in the
    caller's code and an error."""
    if request is None:
        _check_names(fields, model, method)
        return plain(_as_json(fields))
    if fields:
        raise InvalidRequestError("request", "pass a request object or keyword fields, not both")
    if isinstance(request, BaseModel):
        return plain(request.model_dump(exclude_unset=True, by_alias=True))
    if not isinstance(request, Mapping):
        raise InvalidRequestError("request", f"must be a dict or a request model, not {type(request).__name__}")
    return plain(_as_json(request))


def _as_json(value: Any, depth: int = 0) -> Any:
    """A Python caller's values as a JSON body has them: tuples as lists, numpy's numbers (a notebook's
    ``np.int64(64)``) as Python's (the request types are strict, as over HTTP), a model (an answer's
    message, block or item, sent back in the next turn) as its fields, as an SDK sends one. Past the
    depth a body may nest, left for ``plain`` to refuse."""
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, BaseModel):
        return _as_json(value.model_dump(mode="json", by_alias=True, exclude_none=True), depth)
    if isinstance(value, Mapping):  # whole-number keys as strings, as JSON writes them (logit_bias={15: 100})
        return {_json_key(key): _as_json(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_as_json(item, depth + 1) for item in value]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def _json_key(key: Any) -> Any:
    return str(int(key)) if isinstance(key, numbers.Integral) and not isinstance(key, bool) else key


def _warn_ignored(ignored: list[str], stacklevel: int) -> None:
    if ignored:
        warnings.warn(f"ignored fields: {', '.join(ignored)}", IgnoredFieldsWarning, stacklevel=stacklevel)


def _check_names(fields: dict[str, Any], model: type[BaseModel], method: str) -> None:
    known = {key for name, info in model.model_fields.items() for key in (name, info.alias) if key}
    for name in fields:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"its parameters are: {', '.join(sorted(known))}"
            raise InvalidRequestError(name, f"is not a parameter of {method}(); {hint} (a request passed as "
                                            "a dict keeps unknown fields and warns of them, as the server does)")
