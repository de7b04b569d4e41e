"""Agent tasks in this process (``Engine.task`` / ``atask``): the same loop the server runs, with
Python callables as tools the loop calls itself.

A callable's name, docstring and parameters describe it to the model: each annotation as its JSON
schema (pydantic's: ``int``, ``list[str]``, ``Literal[...]``, ``Optional``, a model; written as
strings too, as ``from __future__ import annotations`` leaves them); it is called with the model's
arguments as keywords.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from pydantic import TypeAdapter
from pydantic.errors import PydanticInvalidForJsonSchema, PydanticSchemaGenerationError

from mashbox.api.base import new_id, parse
from mashbox.api.task_items import CreateTask, TaskObject
from mashbox.api.task_loop import Abort, Generate, ServerTool, TaskLoop, request_param
from mashbox.engine.request import Tool
from mashbox.errors import InvalidRequestError

STARRED = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def function_tool(fn: Callable[..., Any]) -> ServerTool:
    """A tool from a Python function's signature."""
    every = _parameters(fn)
    params = [p for p in every if p.kind not in STARRED]
    properties = {p.name: _schema(p.annotation) for p in params}
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    schema = {"type": "object", "properties": properties, "required": required}
    tool = Tool(_name(fn), inspect.getdoc(fn) or "", schema)
    names = {p.name for p in params}
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]  # math.sqrt's x
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in every)

    def run(arguments: dict[str, Any]) -> Any:
        given = [arguments[name] for name in positional if name in arguments]
        named = {k: v for k, v in arguments.items() if k not in positional and (takes_any or k in names)}
        return fn(*given, **named)

    return ServerTool(tool, run)


def _name(fn: Callable[..., Any]) -> str:
    """A function's name; a partial's, its function's; a callable object's, its class's."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """``fn``'s parameters, their annotations resolved where written as strings."""
    try:
        return list(inspect.signature(fn, eval_str=True).parameters.values())
    except (NameError, SyntaxError, TypeError):  # a string naming what the function's module does not hold
        return list(inspect.signature(fn).parameters.values())


def _schema(annotation: Any) -> dict[str, Any]:
    """An annotation's JSON schema; {} (any value) for none, or one pydantic cannot describe."""
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return {}
    try:
        return TypeAdapter(annotation).json_schema()
    except (PydanticSchemaGenerationError, PydanticInvalidForJsonSchema, TypeError):
        return {}


def prepare(fields: Any, generate: Generate, abort: Abort | None = None) -> TaskLoop:
    """The loop of a create request given as a dict (or a ``CreateTask``), callables split out."""
    fields = dict(fields) if isinstance(fields, dict) else fields.model_dump(exclude_unset=True)
    given = fields.pop("client_tools", None) or []
    functions = tuple(function_tool(t) for t in given if callable(t))
    fields["client_tools"] = [t for t in given if not callable(t)]
    fields.setdefault("stream", False)
    req = parse(CreateTask, fields)
    task = TaskObject(id=req.task_id or new_id("task_"), created_at=int(time.time()), session_id=req.session_id or "",
                      user_id=req.user_id or "", metadata=req.metadata or {}, previous_task_id=req.previous_task_id)
    return TaskLoop(req, task, generate, functions, abort=abort)


async def events(loop: TaskLoop) -> AsyncIterator[Any]:
    try:
        async for event in loop.run():
            yield event
    except InvalidRequestError as err:
        raise request_param(err, loop.req) from None


async def run_async(loop: TaskLoop) -> Any:
    """The task when it stops, or its events (stream)."""
    if loop.req.stream:
        return events(loop)
    async for _ in events(loop):
        pass
    return loop.task


def run_sync(loop: TaskLoop) -> Any:
    """``run_async`` from plain code or a notebook (whose own event loop may be running): the loop
    runs on a thread of its own."""
    stream = _threaded(lambda: events(loop))
    if loop.req.stream:
        return stream
    for _ in stream:
        pass
    return loop.task


def _threaded(make: Callable[[], AsyncIterator[Any]]) -> Iterator[Any]:
    """Iterate an async iterator that runs on its own thread; leaving early cancels it."""
    out: queue.Queue[tuple[str, Any]] = queue.Queue()
    running: dict[str, Any] = {}

    async def main() -> None:
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()
        try:
            async for item in make():
                out.put(("item", item))
        except BaseException as exc:  # handed to the caller's thread
            out.put(("error", exc))
            return
        out.put(("end", None))

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="mashbox-task", daemon=True)
    thread.start()
    ended = False
    try:
        while (got := out.get())[0] == "item":
            yield got[1]
        ended = True
        if got[0] == "error" and not isinstance(got[1], asyncio.CancelledError):
            raise got[1]
    finally:
        if not ended and "loop" in running:  # left early: cancel it (a loop that ended meanwhile is closed)
            with contextlib.suppress(RuntimeError):
                running["loop"].call_soon_threadsafe(running["task"].cancel)
        thread.join()
