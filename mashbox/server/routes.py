"""The route handlers: each parses, hands the work on, and answers (server-api.md)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from mashbox.api.anthropic_messages import TokenCount
from mashbox.api.protocols import CHAT, COMPLETIONS, MESSAGES, RESPONSES, counting
from mashbox.errors import ModelNotFoundError
from mashbox.server.context import Context
from mashbox.server.generation import generate, ignored_header, refuse_overlong
from mashbox.server.health import health
from mashbox.server.metrics import CONTENT_TYPE
from mashbox.server.models import AnthropicModel, AnthropicModelList, Model, ModelList

Ctx = NamedDependency[Context]
Body = JSONBody[dict[str, Any]]


@get(["/v1/health", "/health"], summary="Health")
async def health_check(ctx: Ctx) -> Response[dict[str, Any]]:
    return _health(ctx)


@get("/", summary="Health, or the chat page")
async def root(ctx: Ctx) -> Response[Any]:
    return ctx.page.index() if ctx.page else _health(ctx)


@get("/ui/{version:str}/{name:str}", summary="The chat page's files", include_in_schema=False)
async def ui_asset(ctx: Ctx, version: FromPath[str], name: FromPath[str]) -> Response[bytes]:
    assert ctx.page is not None  # routed only with --ui
    return ctx.page.asset(version, name)


def _health(ctx: Context) -> Response[dict[str, Any]]:
    status, body = health(ctx.backend, ctx.admission.waiting, ctx.settings.cache_ram_mib * 2**20)
    return Response(body, status_code=status)


@get("/v1/models", summary="List models")
async def list_models(ctx: Ctx, request: Request) -> dict[str, Any]:
    ctx.served()
    info = ctx.backend.info
    assert info is not None
    if "anthropic-version" in request.headers:
        return AnthropicModelList.of(info).dump()
    return ModelList(data=[Model.of(info, ctx.settings)]).dump()


@get("/v1/models/{model:str}", summary="Get a model")
async def get_model(ctx: Ctx, request: Request, model: FromPath[str]) -> dict[str, Any]:
    served, info = ctx.served(), ctx.backend.info
    if model != served or info is None:
        raise ModelNotFoundError(model, served)
    if "anthropic-version" in request.headers:
        return AnthropicModel.of(info).dump()
    return Model.of(info, ctx.settings).dump()


@post("/v1/chat/completions", status_code=200, summary="Chat completion")
async def chat_completions(ctx: Ctx, request: Request, data: Body) -> Response[Any]:
    return await generate(ctx, CHAT, data, request)


@post("/v1/completions", status_code=200, summary="Text completion")
async def completions(ctx: Ctx, request: Request, data: Body) -> Response[Any]:
    return await generate(ctx, COMPLETIONS, data, request)


@post("/v1/messages", status_code=200, summary="Messages (Anthropic)")
async def messages(ctx: Ctx, request: Request, data: Body) -> Response[Any]:
    return await generate(ctx, MESSAGES, data, request)


@post("/v1/messages/count_tokens", status_code=200, summary="Count tokens")
async def count_tokens(ctx: Ctx, data: Body) -> Response[dict[str, Any]]:
    ctx.served()
    refuse_overlong(ctx, data, "messages")
    prepared = counting(data)
    count = TokenCount(input_tokens=await ctx.backend.count(prepared.engine))
    return Response(count.dump(), headers=ignored_header(prepared.ignored))


@post("/v1/responses", status_code=200, summary="Responses (OpenAI)")
async def responses(ctx: Ctx, request: Request, data: Body) -> Response[Any]:
    return await generate(ctx, RESPONSES, data, request)


@get("/metrics", summary="Metrics (Prometheus text)", include_in_schema=True)
async def metrics(ctx: Ctx) -> Response[bytes]:
    return Response(ctx.metrics.render(ctx.backend, ctx.admission.waiting), headers={"content-type": CONTENT_TYPE})


@get("/openapi.json", summary="This description")
async def openapi_json(ctx: Ctx) -> dict[str, Any]:
    return ctx.openapi


HANDLERS = [openapi_json, health_check, root, list_models, get_model, chat_completions, completions, messages,
            count_tokens, responses, metrics]
UI_HANDLERS = [ui_asset]  # with --ui
