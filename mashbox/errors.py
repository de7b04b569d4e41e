"""Errors a user of the Engine sees. Each says what went wrong and what to do."""

from __future__ import annotations


class MashboxError(Exception):
    """Base of every error mashbox raises on purpose."""


class InvalidRequestError(MashboxError, ValueError):
    """A request field is wrong; ``param`` names it (dotted path)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.message = message


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit in the context; refused before any work. ``tokens`` is the
    prompt's length (or a lower bound of it), ``ctx`` the context's."""

    def __init__(self, param: str, message: str, *, tokens: int, ctx: int) -> None:
        super().__init__(param, message)
        self.tokens = tokens
        self.ctx = ctx


class ModelLoadError(MashboxError):
    """A model is not installed, its path is wrong or its file is corrupt."""


class EngineClosedError(MashboxError):
    """The engine was closed: it answers nothing more. Make a new ``Engine``."""


class NotReadyError(MashboxError):
    """The model is still loading, or its worker is starting again."""
