"""The Agent Tasks routes (``/v1/tasks``, also under ``/tasks``): every answer is the JSON-RPC
envelope (docs/tasks.md); a streamed create is SSE whose events carry it too.

Cancel, pause and resume answer the envelope with the task's own fields beside it: the official
client reads those answers as a bare task object, so ``id`` there is the task's id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from mashbox.api.base import parse
from mashbox.api.frames import COMMENT, sse_json
from mashbox.api.task_items import STATUSES, CreateTask, Envelope
from mashbox.errors import InvalidRequestError
from mashbox.server import security
from mashbox.server.context import Context
from mashbox.server.generation import ignored_header, refuse_overlong, request_id, unless_gone
from mashbox.server.sse import EventStream
from mashbox.server.task_runs import Live

Ctx = NamedDependency[Context]
Body = JSONBody[dict[str, Any]]
MAX_PAGE = 100


def paths(suffix: str = "") -> list[str]:
    return [f"/v1/tasks{suffix}", f"/tasks{suffix}"]


def envelope(rid: Any, result: Any) -> dict[str, Any]:
    return Envelope(id=rid, result=result).dump()


def _tenant(ctx: Context, request: Request) -> str:
    return security.tenant(ctx.settings, request.headers)


@post(paths(), status_code=200, summary="Create an agent task")
async def create_task(ctx: Ctx, request: Request, data: Body) -> Response[Any]:
    ctx.served()
    sent = data.get("request_id") if isinstance(data, dict) else None
    if isinstance(sent, str | int) and not isinstance(sent, bool):  # a refusal of the body echoes it too
        request.scope["state"]["request_id"] = sent
    refuse_overlong(ctx, data, "history_messages")  # before it is validated: a history past the context is cheap
    req = parse(CreateTask, data)
    rid = req.request_id if req.request_id is not None else request_id(request)
    request.scope["state"]["request_id"] = rid  # an error from here on (a 429, a 409) echoes it too
    live = await ctx.tasks.start(req, _tenant(ctx, request))
    headers = ignored_header(req.ignored_fields())
    if req.stream:
        async def left() -> None:
            ctx.tasks.abandon(live)

        return EventStream(_frames(ctx, live, rid), idle_s=ctx.settings.idle_timeout_s, on_close=left, headers=headers)
    if not live.background and await unless_gone(request.receive, _finished(live)) is None:
        ctx.tasks.abandon(live)
    return Response(envelope(rid, live.task.dump()), headers=headers)


async def _finished(live: Live) -> bool:
    while not live.finished:
        await live.changed(60)
    return True


async def _frames(ctx: Context, live: Live, rid: Any) -> AsyncIterator[bytes]:
    async for event in live.follow(ctx.settings.keepalive_s):
        if event is None:
            yield COMMENT
        else:
            yield f"event: {event['type']}\ndata: {sse_json(envelope(rid, event))}\n\n".encode()


@get(paths(), summary="List agent tasks")
async def list_tasks(ctx: Ctx, request: Request) -> dict[str, Any]:
    query = request.query_params
    statuses = [s for key in ("status", "status[]") for value in query.getall(key, []) for s in value.split(",") if s]
    if bad := [s for s in statuses if s not in STATUSES]:
        raise InvalidRequestError("status", f"unknown status {bad[0]!r}; expected some of {list(STATUSES)}")
    tasks = await ctx.tasks.page(_tenant(ctx, request), _limit(query.get("limit")), after=query.get("starting_after"),
                                 before=query.get("ending_before"), statuses=statuses,
                                 session_id=query.get("session_id"), user_id=query.get("user_id"))
    return envelope(request_id(request), tasks)


def _limit(text: str | None) -> int:
    if text is None:
        return 20
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_PAGE:  # not "²" nor "５"
        raise InvalidRequestError("limit", f"must be a whole number from 1 to {MAX_PAGE} (got {text!r})")
    return int(text)


@get(paths("/{task_id:str}"), summary="Retrieve an agent task")
async def get_task(ctx: Ctx, request: Request, task_id: FromPath[str]) -> dict[str, Any]:
    return envelope(request_id(request), await ctx.tasks.find(_tenant(ctx, request), task_id))


@delete(paths("/{task_id:str}"), status_code=200, summary="Delete an agent task")
async def delete_task(ctx: Ctx, request: Request, task_id: FromPath[str]) -> dict[str, Any]:
    return envelope(request_id(request), await ctx.tasks.delete(_tenant(ctx, request), task_id))


async def _act(ctx: Context, request: Request, task_id: str, action: Any) -> dict[str, Any]:
    task = await ctx.tasks.act(_tenant(ctx, request), task_id, action)
    return {**task, **envelope(task["id"], task)}


@post(paths("/{task_id:str}/cancel"), status_code=200, summary="Cancel an agent task")
async def cancel_task(ctx: Ctx, request: Request, task_id: FromPath[str]) -> dict[str, Any]:
    return await _act(ctx, request, task_id, "cancel")


@post(paths("/{task_id:str}/pause"), status_code=200, summary="Pause an agent task")
async def pause_task(ctx: Ctx, request: Request, task_id: FromPath[str]) -> dict[str, Any]:
    return await _act(ctx, request, task_id, "pause")


@post(paths("/{task_id:str}/resume"), status_code=200, summary="Resume a paused agent task")
async def resume_task(ctx: Ctx, request: Request, task_id: FromPath[str]) -> dict[str, Any]:
    return await _act(ctx, request, task_id, "resume")


TASK_HANDLERS = [create_task, list_tasks, get_task, delete_task, cancel_task, pause_task, resume_task]
