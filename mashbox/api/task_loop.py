"""The agent loop of one task: generations over the engine, tool calls, and the task's lifecycle.

``TaskLoop.run`` yields the task's events: ``task.created``, ``task.queued`` when the engine takes
its first generation, ``task.working`` once that has a slot, then each step's output. A step is one
generation with the task's tools. After it: no call, or a call of a ``stop_tools`` name, completes
the task (a step that also called client tools stops ``input-required``: their calls are the client's
still); a generation cut short by ``max_tokens`` with no whole call fails it (``error`` says so,
``incomplete_details`` too, and its items stay in the output as ``incomplete``; a call cut short never
runs); a call of
a server tool runs it and adds its ``tool_result``; then calls of client tools stop it
``input-required`` (the client continues with a new task), or the next step starts (a forced
``tool_choice`` holds for the first step only). More
than ``max_steps`` steps fail the task, and so does an engine that closes under it (the server
stopping: its open item ``incomplete``). ``Control`` cancels, pauses and resumes it at the next token;
a generation so stopped is aborted (``abort``, by its request id) and its usage counted from its
``Finish``.

Nothing here knows HTTP: ``generate`` is the Engine's ``astream`` or the server backend's. Server
tools are none unless the caller gives some (``ServerTool``); nothing runs code by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from mashbox.api.base import engine_request, json_object
from mashbox.api.task_events import (
    STATUS_EVENT,
    StepTranslator,
    TaskLifecycleEvent,
    tool_result_events,
)
from mashbox.api.task_items import (
    CreateTask,
    IncompleteDetails,
    RpcError,
    TaskObject,
    client_tools,
    offered_tools,
    to_messages,
)
from mashbox.engine.events import Event, Finish, Queued, Usage
from mashbox.engine.request import EngineRequest, Message, Named, Tool, ToolCall, ToolChoice, repeated
from mashbox.errors import ContextLengthError, EngineClosedError, InvalidRequestError

Generate = Callable[[EngineRequest], AsyncIterator[Event]]
Abort = Callable[[str], None]  # stop a request by its id: its events go on to a Finish with its usage
Action = Literal["cancel", "pause", "resume", "expire"]
DEFAULT_MAX_STEPS = 10
STEP_LIMIT = -32010  # JSON-RPC error codes of a failed task
OUTPUT_LIMIT = -32011
GENERATION_FAILED = -32603
INVALID_PARAMS = -32602  # of one whose request could not be followed after all (a schema, mid-answer)
EXPIRED = -32002  # of an expired one
SERVER_STOPPED = -32012  # of one that the server stopped (shutting down) while it ran
STOP_WAIT = 5.0  # seconds an interrupted generation has to deliver its Finish (its usage)
_PARAMS = {"messages": "history_messages", "response_schema": "structured_output", "tools": "client_tools",
           "tool_choice": "inference_args.tool_choice"}


def request_param(err: InvalidRequestError, req: CreateTask) -> InvalidRequestError:
    """An engine's refusal, naming the field of the create request it comes from (a prompt too
    long for the context: the history where there is one, else the message)."""
    param = "user_message_content" if err.param == "messages" and not req.history_messages else err.param
    if isinstance(err, ContextLengthError):  # still one: its code, context_length_exceeded, is what agents read
        return ContextLengthError(_PARAMS.get(param, param), err.message, tokens=err.tokens, ctx=err.ctx)
    return InvalidRequestError(_PARAMS.get(param, param), err.message, code=err.code)


@dataclass(frozen=True, slots=True)
class ServerTool:
    """A tool the loop runs itself: ``run(arguments) -> str`` (or any JSON value; may be async)."""

    tool: Tool
    run: Callable[[dict[str, Any]], Any]


class Control:
    """What the task's owner asks of it: seen by the loop at its next token."""

    def __init__(self) -> None:
        self.wanted: Action | None = None
        self._signal = asyncio.Event()

    def ask(self, action: Action) -> None:
        if self.wanted in ("cancel", "expire") and action in ("pause", "resume"):
            return  # an end already asked for is not undone
        self.wanted = action
        self._signal.set()

    async def wait(self) -> Action:
        await self._signal.wait()
        self._signal.clear()
        action, self.wanted = self.wanted, None
        assert action is not None
        return action


class Interrupted(Exception):
    def __init__(self, action: Action) -> None:
        super().__init__(action)
        self.action = action


def plan(req: CreateTask, server_tools: tuple[ServerTool, ...] = (), cache_salt: str = "") -> EngineRequest:
    """The task's first generation; a request the loop cannot run raises ``InvalidRequestError``."""
    args, schema = req.args(), req.structured_output
    choice = args.choice()
    if schema is not None:
        _structured(req, args.sampling().stop, choice)
    _unique(req, server_tools)
    tools = offered_tools(req, client_tools(req) + tuple(t.tool for t in server_tools))
    if isinstance(choice, Named) and choice.name not in {t.name for t in tools}:
        raise InvalidRequestError("inference_args.tool_choice", f"names a tool the task does not offer: {choice.name!r}")
    messages = to_messages(req)
    if not messages:
        raise InvalidRequestError("user_message_content", "is empty and there is no history: nothing to answer")
    try:
        return engine_request(
            messages=tuple(messages), sampling=args.sampling(), tools=() if schema else tools,
            tool_choice="auto" if schema else choice, parallel_tool_calls=args.parallel_tool_calls is not False,
            enable_thinking=args.enable_thinking, cache_salt=cache_salt, response_schema=schema)
    except InvalidRequestError as err:
        raise request_param(err, req) from None


def _unique(req: CreateTask, server_tools: tuple[ServerTool, ...]) -> None:
    """Refuses two tools of one name (the request's, or an in-process function's): a call could not say
    which it means."""
    names = [t.name for t in client_tools(req)]
    given = len(names)
    names += [t.tool.name for t in server_tools]
    if (i := repeated(names)) is not None:
        where = f"client_tools.{i}.function.name" if i < given else "client_tools"
        raise InvalidRequestError(where, f"names {names[i]!r} again: each tool needs a name of its own")


def _structured(req: CreateTask, stop: tuple[str, ...], choice: ToolChoice) -> None:
    """Refuse what a task with ``structured_output`` cannot honour: its answer is one JSON value, whole."""
    if req.stream:
        raise InvalidRequestError("structured_output", "is only for tasks without stream; send stream: false")
    if stop:
        raise InvalidRequestError("inference_args.stop", "would cut the structured_output's JSON short (its "
                                                         "answer ends where the JSON does); leave stop out")
    if choice not in ("auto", "none"):
        raise InvalidRequestError("inference_args.tool_choice", "asks for a tool call, but a task with "
                                                                "structured_output calls no tools")


class TaskLoop:
    def __init__(self, req: CreateTask, task: TaskObject, generate: Generate, tools: tuple[ServerTool, ...] = (),
                 cache_salt: str = "", abort: Abort | None = None) -> None:
        self.req, self.task, self.control = req, task, Control()
        self._first = plan(req, tools, cache_salt)
        self._messages = list(self._first.messages or ())
        self._generate, self._abort = generate, abort
        self._server = {t.tool.name: t for t in tools}
        self._client = {t.name for t in client_tools(req)}
        self._stop = set(req.stop_tools or ())
        self._seq = self._step = 0

    def emit(self, cls: type, **fields: Any) -> Any:
        self._seq += 1
        return cls(task_id=self.task.id, agent_step=self._step, sequence_number=self._seq, **fields)

    def status(self, status: str) -> TaskLifecycleEvent:
        self.task.status = status  # type: ignore[assignment]
        return self.emit(TaskLifecycleEvent, type=STATUS_EVENT[status], task=self.task.model_copy(deep=True))

    async def run(self) -> AsyncIterator[Any]:
        yield self.status("created")
        steps = self.req.max_steps or DEFAULT_MAX_STEPS
        for self._step in range(1, steps + 1):
            async for event in self._one_step():
                yield event
            if self.task.status != "working":
                return
        message = f"the task stopped after {steps} steps (max_steps) without a final answer"
        self.task.error = RpcError(code=STEP_LIMIT, message=message, data={"max_steps": steps})
        yield self.status("failed")

    async def _one_step(self) -> AsyncIterator[Any]:
        """One generation and what follows it; a pause runs the generation again once resumed."""
        while True:
            translator = StepTranslator(self.task, self.emit)
            try:
                async for event in self._generation(translator):
                    yield event
            except Interrupted as stop:
                for event in translator.interrupt():
                    yield event
                action = stop.action
                if action == "pause":
                    yield self.status("paused")
                    action = await self.control.wait()
                    if action in ("resume", "pause"):
                        yield self.status("working")
                        continue
                if action == "expire":
                    how = "stayed paused" if self.task.status == "paused" else "had no event from its generation"
                    self.task.error = RpcError(code=EXPIRED, message=f"the task expired: it {how} for the "
                                                                     "tasks' time to live")
                yield self.status("expired" if action == "expire" else "canceled")
                return
            except EngineClosedError as exc:
                if self.task.status == "created":
                    raise  # the engine never took the task: its create is refused, as a route's request is
                for event in translator.interrupt():
                    yield event
                if exc.usage is not None:  # the tokens of the generation it stopped
                    self._count(exc.usage)
                self.task.error = RpcError(code=SERVER_STOPPED, message=f"the server stopped while this task was "
                                                                        f"running ({exc}); create it again")
                yield self.status("failed")
                return
            async for event in self._after(translator):
                yield event
            return

    async def _generation(self, translator: StepTranslator) -> AsyncIterator[Any]:
        request = replace(self._first, messages=tuple(self._messages), id=uuid.uuid4().hex)
        if self._step > 1 and request.tool_choice != "none":  # a forced call is forced once, not every step
            request = replace(request, tool_choice="auto")
        events = self._generate(request)
        try:
            while True:
                following = asyncio.ensure_future(anext(events))
                if (action := await self._asked_first(following)) is not None:
                    await self._halt(request.id, following, events)
                    raise Interrupted(action)
                event = following.result()
                if isinstance(event, Queued) and self.task.status == "created":
                    yield self.status("queued")
                elif not isinstance(event, Queued) and self.task.status in ("created", "queued"):
                    yield self.status("working")
                for out in translator.feed(event):
                    yield out
                if isinstance(event, Finish):
                    return
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def _asked_first(self, following: asyncio.Future[Event]) -> Action | None:
        """What the owner asks before the next engine event comes; None once it has come."""
        asked = asyncio.ensure_future(self.control.wait())
        try:
            await asyncio.wait({following, asked}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            following.cancel()
            raise
        finally:
            if not asked.done():
                asked.cancel()
                await asyncio.wait({asked})
        if asked.cancelled():
            return None
        if following.done():
            self.control.ask(asked.result())  # seen at the next event; this one is not lost
            return None
        return asked.result()

    async def _halt(self, request_id: str, following: asyncio.Future[Event], events: AsyncIterator[Event]) -> None:
        """End an interrupted generation, counting what it used from its Finish where the engine
        stops it within ``STOP_WAIT`` s (without ``abort``: at once, uncounted)."""
        if self._abort is not None:
            self._abort(request_id)
            try:
                async with asyncio.timeout(STOP_WAIT):
                    event = await following
                    while not isinstance(event, Finish):
                        event = await anext(events)
                self._count(event.usage)
                return
            except Exception:  # no Finish in time, or the stream failed: what it used stays unknown
                pass
        following.cancel()
        await asyncio.wait({following})

    async def _after(self, translator: StepTranslator) -> AsyncIterator[Any]:
        finish = translator.finish
        self._count(finish.usage)
        if finish.reason in ("error", "abort"):
            if finish.param:  # a schema the grammar could not follow (a limit met mid-answer): the request's
                field = _PARAMS.get(finish.param, finish.param)
                self.task.error = RpcError(code=INVALID_PARAMS, message=f"{field}: {finish.error}",
                                           data={"param": field})
            else:
                self.task.error = RpcError(code=GENERATION_FAILED, message=finish.error or "the generation stopped")
            yield self.status("failed")
            return
        calls = [c for c in translator.calls if c.status == "completed"]  # one cut by max_tokens never runs
        self._messages.append(Message("assistant", translator.text(),
                                      tuple(ToolCall(c.call_id, c.name, c.arguments) for c in calls),
                                      reasoning=translator.reasoning() or None))
        if finish.reason == "length" and not calls:  # cut short, nothing to go on with: not a complete answer
            limit = self._first.sampling.max_tokens
            where = f"max_tokens ({limit})" if limit else "the end of the context"
            self.task.incomplete_details = IncompleteDetails()
            self.task.error = RpcError(
                code=OUTPUT_LIMIT, data={"reason": "max_output_tokens", "max_tokens": limit},
                message=f"the answer was cut at {where} before it ended{_cut(translator)}; "
                        + ("raise max_tokens in inference_args" if limit else "start a shorter task"))
            yield self.status("failed")
            return
        waiting, stopped = [], False  # the client's calls: answered by the client, after the server's have run
        for call in calls:
            if call.name in self._stop:
                stopped = True  # no server call after it runs; the client's are still the client's
            elif call.name not in self._server and call.name in self._client:
                waiting.append(call)
            elif not stopped:
                text = await self._call(call.name, call.arguments)
                for event in tool_result_events(self.task, self.emit, call, text):
                    yield event
                self._messages.append(Message("tool", text, tool_call_id=call.call_id, name=call.name))
        if waiting:
            self.task.input_required, self.task.input_required_calls = waiting[0], waiting
            yield self.status("input-required")
        elif calls and not stopped:
            return  # the results go to the next step
        else:
            yield self.status("completed")

    async def _call(self, name: str, arguments: str) -> str:
        tool = self._server.get(name)
        if tool is None:
            return f"error: no tool named {name!r} is available"
        try:
            result = await _in_thread(tool.run, json_object(arguments))
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError as exc:
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise  # the task is stopped, not its tool
            return f"error: CancelledError: {exc}"  # the tool's own: the task went on "working", unended
        except Exception as exc:  # the model sees the failure and may try otherwise
            return f"error: {type(exc).__name__}: {exc}"
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)

    def _count(self, usage: Usage) -> None:
        old = self.task.usage or {}
        total = {"input_tokens": old.get("input_tokens", 0) + usage.prompt_tokens,
                 "output_tokens": old.get("output_tokens", 0) + usage.completion_tokens}
        cached = old.get("input_tokens_details", {}).get("cached_tokens", 0) + usage.cached_tokens
        reasoning = old.get("output_tokens_details", {}).get("reasoning_tokens", 0) + usage.reasoning_tokens
        self.task.usage = {**total, "total_tokens": total["input_tokens"] + total["output_tokens"],
                           "input_tokens_details": {"cached_tokens": cached},
                           "output_tokens_details": {"reasoning_tokens": reasoning}, "steps": self._step}


async def _in_thread(fn: Callable[[Any], Any], argument: Any) -> Any:
    """``fn(argument)`` on a daemon thread of its own: a task stopped while a slow tool works (Ctrl-C)
    ends at once; the default executor's thread held ``asyncio.run`` until the tool returned."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_result(result) if error is None else done.set_exception(error)

    def run() -> None:
        try:
            result, error = fn(argument), None
        except BaseException as exc:  # handed to the loop, whatever it is
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="mashbox-tool", daemon=True).start()
    return await done


def _cut(translator: StepTranslator) -> str:
    """What the cut answer was doing, for the task's error."""
    if translator.calls:
        return f", in the middle of a call of {translator.calls[-1].name}"
    return "" if translator.text() or translator.reasoning() else ", before any text or complete tool call"
