"""Where mashbox's log goes when it serves: stderr, one line a record, INFO and up."""

from __future__ import annotations

import logging
import sys


def to_stderr() -> None:
    """Send the ``mashbox`` loggers' records to the real stderr (the server's requests, the worker's
    engine: a format widened at load, packed weights saved, a cache page skipped). Once a process."""
    log = logging.getLogger("mashbox")
    if any(getattr(h, "mashbox", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.__stderr__ or sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.mashbox = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    logging.getLogger("uvicorn.error").addFilter(_not_unfinished)


UNFINISHED = "ASGI callable returned without completing response."


def _not_unfinished(record: logging.LogRecord) -> bool:
    """uvicorn's ERROR for a response left unfinished: a stream whose client read nothing for the idle
    timeout is closed so, deliberately (said at WARNING with its request id, ``sse``)."""
    return record.getMessage() != UNFINISHED
