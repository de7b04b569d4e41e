"""Errors a user of the Engine sees. Each says what went wrong and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mashbox.engine.events import Usage


class MashboxError(Exception):
    """Base of every error mashbox raises on purpose."""


class InvalidRequestError(MashboxError, ValueError):
    """A request field is wrong; ``param`` names it (dotted path), ``code`` (optional) says what kind of
    wrong for programs (the OpenAI error body's ``code``)."""

    def __init__(self, param: str, message: str, *, code: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.message = message
        self.code = code


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit in the context; refused before any work. ``tokens`` is the
    prompt's length (or a lower bound of it), ``ctx`` the context's."""

    def __init__(self, param: str, message: str, *, tokens: int, ctx: int) -> None:
        super().__init__(param, message)
        self.tokens = tokens
        self.ctx = ctx

    @classmethod
    def of(cls, param: str, tokens: int, ctx: int, *, bound: str = "",
           hint: str = "shorten it or raise ctx") -> ContextLengthError:
        """A prompt of ``tokens`` (at least, where ``bound`` says how that is known) in a context of ``ctx``."""
        length = f"at least {tokens} tokens ({bound})" if bound else f"{tokens} tokens"  # OpenAI's opening words,
        # which agents match to compact their history and send it again (Pi's "maximum context length is N tokens")
        return cls(param, f"This model's maximum context length is {ctx} tokens; the prompt is {length}, and a "
                          f"context of {ctx} takes at most {ctx - 1} prompt tokens (one is the answer's): {hint}",
                   tokens=tokens, ctx=ctx)


class ModelNotFoundError(InvalidRequestError):
    """A request names a model other than the one loaded (``param`` is ``model``); the server answers
    it with 404 ``model_not_found``. Anthropic Messages requests may name any model."""

    def __init__(self, model: str, served: str) -> None:
        super().__init__("model", f"model {model!r} is not served here; {served!r} is "
                                  "(leave model out, or name that one)", code="model_not_found")
        self.model = model


class ConfigError(MashboxError, ValueError):
    """An engine setting the model or the machine cannot take (a ctx past the model's training, a KV
    cache larger than the memory free); refused before any allocation."""


class ModelLoadError(MashboxError):
    """A model is not installed, its path is wrong or its file is corrupt."""


class EngineClosedError(MashboxError):
    """The engine was closed: it answers nothing more. Make a new ``Engine``. ``usage`` is the tokens of the
    request it closed under, where they are known (a task stopped by its server stopping counts them)."""

    def __init__(self, message: str, *, usage: Usage | None = None) -> None:
        super().__init__(message)
        self.usage = usage


class NotReadyError(MashboxError):
    """The model is still loading, or its worker is starting again."""


class GenerationError(MashboxError):
    """A request failed while it ran (a device fault, an internal error); other requests go on. A
    non-streamed call raises it; a stream ends with its protocol's error event instead."""


class StorageError(MashboxError):
    """A file the server keeps (the agent tasks' database) cannot be used: the message says which and why.
    The server answers 500 with it; what is wrong is the server's set-up, not the request."""
