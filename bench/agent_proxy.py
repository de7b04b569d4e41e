"""A logging HTTP proxy between a coding agent and a model server, for bench/agents.py.

Forwards every request unchanged (but for ``Accept-Encoding``, dropped so that answers stay
readable) and streams every answer back as it comes. For each exchange it records, under the label
of the agent running at the time: the request body, the answer's raw bytes, when the request came,
when the answer's headers came and when its first model output came (a text, reasoning or tool-call
event of a stream, or a whole non-streamed answer). ``summary`` reads the tool calls and the text
back out of a recorded answer, for any of the four protocols.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
       "content-length", "accept-encoding", "host"}
OUTPUT_EVENTS = {"content_block_start", "content_block_delta", "response.output_text.delta",
                 "response.output_item.added", "response.reasoning_text.delta",
                 "response.reasoning_summary_text.delta", "response.function_call_arguments.delta"}


@dataclass
class Exchange:
    label: str
    method: str
    path: str
    body: dict | None
    started: float
    status: int = 0
    headers_at: float | None = None
    first_output_at: float | None = None
    ended_at: float | None = None
    raw: bytearray = field(default_factory=bytearray)
    error: str = ""

    @property
    def is_turn(self) -> bool:
        """A model turn: a POST that offers tools (an agent's own loop, not a side request)."""
        return self.method == "POST" and bool((self.body or {}).get("tools"))

    def ttft(self) -> float | None:
        return None if self.first_output_at is None else self.first_output_at - self.started


class Proxy:
    """``with Proxy(upstream) as proxy:`` serves on ``proxy.url``; ``proxy.label`` tags what comes."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.label = ""
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.server.serve_forever, name="agent-proxy", daemon=True).start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def of(self, label: str) -> list[Exchange]:
        with self.lock:
            return [x for x in self.exchanges if x.label == label]

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.upstream.hostname, self.upstream.port or 80, timeout=3600)


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:
            pass

        def do_HEAD(self) -> None:
            self._forward()

        do_GET = do_POST = do_PUT = do_DELETE = do_OPTIONS = do_HEAD

        def _forward(self) -> None:
            raw = self._read_body()
            exchange = Exchange(proxy.label, self.command, self.path, _json(raw), time.monotonic())
            with proxy.lock:
                proxy.exchanges.append(exchange)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            upstream = proxy.connect()
            try:
                upstream.request(self.command, proxy.upstream.path.rstrip("/") + self.path, raw, headers)
                self._relay(upstream.getresponse(), exchange)
            except (OSError, http.client.HTTPException) as error:
                exchange.error = repr(error)
                self.close_connection = True
            finally:
                exchange.ended_at = time.monotonic()
                upstream.close()

        def _read_body(self) -> bytes | None:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else None

        def _relay(self, answer: http.client.HTTPResponse, exchange: Exchange) -> None:
            exchange.status, exchange.headers_at = answer.status, time.monotonic()
            self.send_response_only(answer.status, answer.reason)
            for key, value in answer.getheaders():
                if key.lower() not in HOP:
                    self.send_header(key, value)
            if self.command == "HEAD":
                self.send_header("Content-Length", answer.getheader("Content-Length") or "0")
                self.end_headers()
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            watcher, listening = OutputWatcher(), True
            while chunk := answer.read1(65536):
                exchange.raw += chunk
                if exchange.first_output_at is None and watcher.feed(chunk):
                    exchange.first_output_at = time.monotonic()
                listening = listening and self._send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if exchange.first_output_at is None and exchange.raw.lstrip().startswith(b"{"):
                exchange.first_output_at = time.monotonic()
            self._send(b"0\r\n\r\n")

        def _send(self, data: bytes) -> bool:
            """Pass ``data`` to the agent; False once it hung up (Codex does at response.completed, before
            the stream's [DONE]): the agent's choice, not the server's fault, and the answer is still read."""
            try:
                self.wfile.write(data)
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                return False
            return True

    return Handler


class OutputWatcher:
    """Reads an SSE stream as it comes; ``feed`` is True once an event carries model output."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, chunk: bytes) -> bool:
        self.buffer += chunk.replace(b"\r\n", b"\n")
        *events, self.buffer = self.buffer.split(b"\n\n")
        return any(_is_output(data) for _name, data in map(_parse_event, events))


def _parse_event(block: bytes) -> tuple[str | None, dict | None]:
    name, data = None, []
    for line in block.decode(errors="replace").split("\n"):
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    return name, _json("\n".join(data).encode()) if data else None


def _is_output(event: dict | None) -> bool:
    if not isinstance(event, dict):
        return False
    if event.get("type") in OUTPUT_EVENTS:
        return event.get("type") != "response.output_item.added" or event["item"].get("type") != "message"
    return any((c.get("delta") or {}).get(k) for c in event.get("choices") or []
               for k in ("content", "reasoning_content", "reasoning", "tool_calls"))


def _json(raw: bytes | None) -> dict | None:
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class Summary:
    """What one answer held: its tool calls ``(name, arguments)``, its text, why it ended, and the
    protocol errors seen (an error event, a non-2xx status, a cut stream)."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    text: str = ""
    stop: str = ""
    errors: list[str] = field(default_factory=list)
    usage: dict = field(default_factory=dict)


def summary(exchange: Exchange) -> Summary:
    result = Summary()
    if exchange.error or exchange.status >= 400:
        result.errors.append(exchange.error or f"HTTP {exchange.status}: {bytes(exchange.raw[:300])!r}")
    raw = bytes(exchange.raw)
    whole = _json(raw) if raw.lstrip().startswith(b"{") else None
    events = [whole] if whole else [e for _n, e in map(_parse_event, raw.replace(b"\r\n", b"\n").split(b"\n\n")) if e]
    chat_calls: dict[int, list[str]] = {}
    for event in events:
        _read_event(event, result, chat_calls)
    result.calls += [(name, args) for name, args in chat_calls.values()]
    return result


def _read_event(event: dict, out: Summary, chat_calls: dict[int, list[str]]) -> None:
    kind = event.get("type")
    if kind == "error" or (kind is None and "error" in event):
        out.errors.append(json.dumps(event)[:300])
    elif kind == "message" or kind == "message_start":
        _read_anthropic_message(event.get("message", event), out)
    elif kind == "content_block_start":
        _read_anthropic_block(event["content_block"], out)
    elif kind == "content_block_delta":
        _read_anthropic_delta(event["delta"], out)
    elif kind == "message_delta":
        out.stop = event["delta"].get("stop_reason") or out.stop
        out.usage |= event.get("usage") or {}
    elif kind in ("response", "response.completed", "response.incomplete", "response.failed"):
        _read_response(event.get("response", event), out)
    elif "choices" in event:
        _read_chat(event, out, chat_calls)


def _read_anthropic_message(message: dict, out: Summary) -> None:
    out.usage |= message.get("usage") or {}
    for block in message.get("content") or []:
        _read_anthropic_block(block, out)
        out.text += block.get("text", "")
    out.stop = message.get("stop_reason") or out.stop


def _read_anthropic_block(block: dict, out: Summary) -> None:
    if block.get("type") == "tool_use":
        out.calls.append((block["name"], json.dumps(block.get("input") or {})))


def _read_anthropic_delta(delta: dict, out: Summary) -> None:
    if delta.get("type") == "text_delta":
        out.text += delta["text"]
    elif delta.get("type") == "input_json_delta" and out.calls:
        name, args = out.calls[-1]
        out.calls[-1] = (name, (args if args != "{}" else "") + delta["partial_json"])


def _read_response(response: dict, out: Summary) -> None:
    out.usage |= response.get("usage") or {}
    out.stop = response.get("status", "") + (f" ({response['incomplete_details']})"
                                              if response.get("incomplete_details") else "")
    if response.get("error"):
        out.errors.append(json.dumps(response["error"])[:300])
    for item in response.get("output") or []:
        if item.get("type") in ("function_call", "custom_tool_call"):
            out.calls.append((item["name"], item.get("arguments") or item.get("input") or ""))
        for part in item.get("content") or [] if item.get("type") == "message" else []:
            out.text += part.get("text", "")


def _read_chat(event: dict, out: Summary, calls: dict[int, list[str]]) -> None:
    out.usage |= event.get("usage") or {}
    for choice in event["choices"]:
        delta = choice.get("delta") or choice.get("message") or {}
        out.text += delta.get("content") or ""
        out.stop = choice.get("finish_reason") or out.stop
        for call in delta.get("tool_calls") or []:
            slot = calls.setdefault(call.get("index", len(calls)), ["", ""])
            slot[0] += (call.get("function") or {}).get("name") or ""
            slot[1] += (call.get("function") or {}).get("arguments") or ""
