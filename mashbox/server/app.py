"""``create_app``: the Litestar application in front of one Backend."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from litestar import Litestar, Request
from litestar.di import Provide

from mashbox.api.base import plain
from mashbox.server import openapi
from mashbox.server.backend import Backend
from mashbox.server.context import Context
from mashbox.server.errors import MAX_BODY, ApiError, handler
from mashbox.server.gate import Gate
from mashbox.server.routes import HANDLERS, UI_HANDLERS
from mashbox.server.settings import Settings
from mashbox.server.task_routes import TASK_HANDLERS


def create_app(backend: Backend, settings: Settings) -> Litestar:
    """The server's routes over ``backend``; the caller owns the backend and closes it."""
    ctx = Context(backend, settings, openapi.document(backend.model_id, _version()))
    app = Litestar(
        route_handlers=[*HANDLERS, *TASK_HANDLERS, *(UI_HANDLERS if settings.ui else [])],
        dependencies={"ctx": Provide(lambda: ctx, use_cache=True, sync_to_thread=False)},
        exception_handlers={Exception: handler(settings.retry_after_s, ctx.metrics)},
        request_max_body_size=MAX_BODY,
        lifespan=[lambda _app: ctx.tasks.sweeping()],
        request_class=BodyRequest,
        openapi_config=None,
        logging_config=None,
    )
    app.state.ctx = ctx  # BodyRequest reads the context's length
    app.asgi_handler = Gate(app.asgi_handler, ctx)
    return app


class BodyRequest(Request):
    """A request whose JSON body, if nested too deeply for the decoder or for what reads it after
    (``MAX_DEPTH``), is the client's error."""

    async def json(self) -> Any:
        try:
            body = await super().json()
        except RecursionError:
            raise ApiError(400, "the JSON body is nested too deeply to decode") from None
        info = self.app.state.ctx.backend.info
        return plain(body, info.ctx) if info else plain(body)  # a conversation past the context: the route's


def _version() -> str:
    try:
        return version("mashbox")
    except PackageNotFoundError:
        return "0"
