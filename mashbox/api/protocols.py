"""The protocols mashbox speaks, in the one registry the Engine facade and the server both read.

Each names its request model, the module that translates it (``to_engine(request)`` into an
``EngineRequest``; ``Translator(request, model)`` from engine events back), the Engine method that
answers it, and how its stream is framed. ``prepare`` is the front half of every request, the same
for the Engine facade and the server: parse, check the model, build the engine request, and name the
fields ignored (the facade warns of them, the server says them in a header); ``counting`` the same
for Anthropic's count_tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mashbox.api import (
    anthropic_messages,
    openai_chat,
    openai_completions,
    openai_responses,
)
from mashbox.api.base import RequestModel, parse
from mashbox.api.frames import COMMENT, DONE, PING, data_frame, event_frame
from mashbox.engine.events import Event, Queued, Started, Usage
from mashbox.engine.request import EngineRequest
from mashbox.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError


@dataclass(frozen=True, slots=True)
class Protocol:
    name: str
    method: str  # the Engine's method (chat, complete, respond, message)
    module: ModuleType
    request: type[RequestModel]
    frame: Callable[[dict[str, Any]], bytes]
    done: bytes = b""
    keepalive: bytes = COMMENT
    any_model: bool = False  # Anthropic requests may name any model; the answer names it back
    turns: str | None = "messages"  # the body's list of conversation items
    start_tells_cache: bool = False  # the stream's first frame says how the prompt met the cache (Anthropic's)

    def named(self, err: InvalidRequestError) -> InvalidRequestError:
        """``err``, where it names the engine's conversation (a prompt too long, a chat template that refuses
        it), naming the field as this protocol names it (Responses: input)."""
        if err.param != "messages" or not self.turns or self.turns == err.param:
            return err  # the tools, where the conversation alone would fit, are named as they are
        if isinstance(err, ContextLengthError):
            return ContextLengthError(self.turns, err.message, tokens=err.tokens, ctx=err.ctx)
        return InvalidRequestError(self.turns, err.message, code=err.code)


CHAT = Protocol("chat", "chat", openai_chat, openai_chat.ChatRequest, data_frame, DONE)
COMPLETIONS = Protocol("completions", "complete", openai_completions, openai_completions.CompletionRequest,
                       data_frame, DONE, turns=None)
RESPONSES = Protocol("responses", "respond", openai_responses, openai_responses.ResponsesRequest, event_frame,
                     DONE, turns="input")  # [DONE] last, as open-responses.md says (the SDKs stop at it)
MESSAGES = Protocol("messages", "message", anthropic_messages, anthropic_messages.MessagesRequest, event_frame,
                    keepalive=PING, any_model=True, start_tells_cache=True)
PROTOCOLS = {p.method: p for p in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)}  # by Engine method


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request read and checked: its protocol model, the engine request, the fields it ignores."""

    req: Any
    engine: EngineRequest
    ignored: list[str]


def prepare(protocol: Protocol, body: Mapping[str, Any], served: str,
            sampling: Mapping[str, float] | None = None) -> Prepared:
    """Read ``body`` as a ``protocol`` request for the model ``served``; InvalidRequestError naming the
    field when it is wrong, ModelNotFoundError when it names another model. ``sampling`` gives the
    sampling fields (``temperature``, ``top_p``, ...) a body leaves out, where its protocol has them."""
    given = {k: v for k, v in (sampling or {}).items() if body.get(k) is None and k in protocol.request.model_fields}
    req = parse(protocol.request, {**body, **given})
    model = getattr(req, "model", None)
    if model not in (None, served) and not protocol.any_model:
        raise ModelNotFoundError(model, served)
    return Prepared(req, protocol.module.to_engine(req), req.ignored_fields())


def counting(body: Mapping[str, Any]) -> Prepared:
    """The engine request whose prompt an Anthropic count_tokens body counts, and the fields it ignores."""
    req = parse(anthropic_messages.CountTokensRequest, body)
    return Prepared(req, anthropic_messages.to_engine(req), req.ignored_fields())


def start_usage(first: Event, started: Event | None) -> Usage | None:
    """What a stream's first frame tells of its usage: the prompt's tokens, as known before any output
    (``first``: the run's first event), and those the prefix cache served once it had a slot (``started``)."""
    if not isinstance(first, Queued):
        return None
    return Usage(first.prompt_tokens, 0, started.cached if isinstance(started, Started) else 0)
