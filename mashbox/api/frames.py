"""Server-sent event frames: how each protocol writes one event of its stream, ends it, and keeps
a quiet stream alive."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
COMMENT = b": keep-alive\n\n"  # an SSE comment: clients skip it
PING = b'event: ping\ndata: {"type":"ping"}\n\n'  # Anthropic's keep-alive event


def _json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def data_frame(payload: dict[str, Any]) -> bytes:
    """Chat and Completions: ``data: {json}``."""
    return f"data: {_json(payload)}\n\n".encode()


def event_frame(payload: dict[str, Any]) -> bytes:
    """Messages and Responses: ``event: <type>`` then ``data: {json}``."""
    return f"event: {payload['type']}\ndata: {_json(payload)}\n\n".encode()
