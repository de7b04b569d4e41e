"""Server-sent event frames: how each protocol writes one event of its stream, ends it, and keeps
a quiet stream alive."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
COMMENT = b": keep-alive\n\n"  # an SSE comment: clients skip it
PING = b'event: ping\ndata: {"type":"ping"}\n\n'  # Anthropic's keep-alive event


# Characters that readers splitting lines as str.splitlines does (httpx's iter_lines) take for line ends: escaped,
# so that such a reader gets each data line whole (JSON escapes the other ones, controls, itself).
LINE_ENDS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_json(payload: dict[str, Any]) -> str:
    """An event's JSON for a ``data:`` line: UTF-8 as it is, but never a character that ends a line."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(LINE_ENDS)


def data_frame(payload: dict[str, Any]) -> bytes:
    """Chat and Completions: ``data: {json}``."""
    return f"data: {sse_json(payload)}\n\n".encode()


def event_frame(payload: dict[str, Any]) -> bytes:
    """Messages and Responses: ``event: <type>`` then ``data: {json}``."""
    return f"event: {payload['type']}\ndata: {sse_json(payload)}\n\n".encode()
