"""Streams on a real server: a client that leaves or stops reading frees its slot; device
failures are re-sent once while the client has received nothing, and end a started stream with
the protocol's error event."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server import frames, serve

from mashbox.api.frames import data_frame, event_frame
from mashbox.engine.events import Event, Finish, Queued, Started, Timings, Usage
from mashbox.engine.request import EngineRequest
from mashbox.errors import EngineClosedError
from mashbox.server import logs
from mashbox.server.backend import InProcessBackend
from mashbox.server.settings import Settings

LONG = {"messages": [{"role": "user", "content": "Count to a million."}], "max_tokens": 20000, "stream": True}
SHORT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
FAILED = Finish("error", Usage(0, 0), Timings(0, 0.0, 0, 0.0, 0, 0.0), error="device lost")


def wait_for(condition: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_client_that_leaves_frees_its_slot(tiny_server):
    engine = tiny_server.engine
    with httpx.Client(base_url=tiny_server.url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=LONG) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert engine.stats().running == 1
    wait_for(lambda: engine.stats().running == 0, 5)


def test_a_client_that_reads_nothing_is_dropped(idle_server, caplog):
    """A client with a small receive buffer reads the headers, then nothing: on the server's own
    socket (no buffer shrunk for the test) its stream stops once the writes wait its idle timeout,
    the request is aborted and the connection closed, long before the answer's 20000 tokens. The log
    says so by its request id, without uvicorn's ERROR for the response left unfinished."""
    logs.to_stderr()  # as `mashbox run`
    caplog.set_level("WARNING")
    engine = idle_server.engine
    body = json.dumps({"input": "Count to a million.", "max_output_tokens": 20000, "stream": True}).encode()
    port = int(idle_server.url.rsplit(":", 1)[1])
    aborted = engine.stats().finished.get("abort", 0)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200")
        wait_for(lambda: engine.stats().running == 1, 5)
        before = engine.stats().generated_tokens
        wait_for(lambda: engine.stats().running == 0, 30)
        generated = engine.stats().generated_tokens
        sock.settimeout(10)
        while sock.recv(65536):  # what was sent before the stall, then the end: the server closed it
            pass
    assert engine.stats().finished.get("abort", 0) == aborted + 1
    # seen within ~200 KB of frames (~2k tokens here, with the idle second), not after megabytes (~14k)
    assert generated - before < 6000
    assert engine.stats().generated_tokens == generated  # nothing more was written to nobody
    request_id = re.search(rb"x-request-id: (\S+)", head).group(1).decode()
    assert f"{request_id}: its client read nothing for 1 s" in caplog.text
    assert logs.UNFINISHED not in caplog.text


class Flaky:
    """The in-process backend whose first ``failures`` runs fail on the device, before any output
    or (``after_output``) after the first event."""

    def __init__(self, inner: InProcessBackend, failures: int, after_output: bool = False) -> None:
        self.inner, self.failures, self.after_output, self.runs = inner, failures, after_output, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        self.runs += 1
        if self.failures <= 0:
            async for event in self.inner.astream(request):
                yield event
            return
        self.failures -= 1
        if self.after_output:
            events = self.inner.astream(request)
            async for event in events:  # up to the first output
                yield event
                if not isinstance(event, (Queued, Started)):
                    break
            await events.aclose()
        yield FAILED


@pytest.fixture
def flaky(long_engine):
    def start(failures: int, after_output: bool = False):
        backend = Flaky(InProcessBackend.of(long_engine), failures, after_output)
        server = serve(backend, Settings())
        return backend, httpx.Client(base_url=next(server), timeout=30), server

    started = []
    yield lambda *a: started.append(start(*a)) or started[-1][:2]
    for _, client, server in started:
        client.close()
        server.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_before_output_is_resent_once(flaky, stream):
    backend, client = flaky(1)
    response = client.post("/v1/chat/completions", json={**SHORT, "stream": stream})
    assert response.status_code == 200
    assert backend.runs == 2
    if stream:
        assert frames(response.text)[-1] == (None, "[DONE]")


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_failure_is_500(flaky, stream):
    backend, client = flaky(4)
    response = client.post("/v1/chat/completions", json={**SHORT, "stream": stream})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    response = client.post("/v1/messages", json={**SHORT, "stream": stream})
    assert response.status_code == 500 and response.json()["error"]["type"] == "api_error"


class Stopping(Flaky):
    """The backend that takes a run, then stops before giving it a slot (the server shutting down)."""

    async def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        yield Queued(1)
        raise EngineClosedError("the server is shutting down")


def test_a_stream_the_stop_cuts_before_its_output_says_so_in_words(long_engine):
    server = serve(Stopping(InProcessBackend.of(long_engine), 0), Settings())
    with httpx.Client(base_url=next(server), timeout=30) as client:
        chat = frames(client.post("/v1/chat/completions", json={**SHORT, "stream": True}).text)
        assert json.loads(chat[-2][1])["error"]["message"] == "the server is shutting down"
        messages = frames(client.post("/v1/messages", json={**SHORT, "stream": True}).text)
        assert json.loads(messages[-1][1])["error"]["message"] == "the server is shutting down"
    server.close()


def test_a_failure_after_output_ends_the_stream_with_an_error_event(flaky, caplog):
    backend, client = flaky(3, True)
    with caplog.at_level(logging.INFO, logger="mashbox.server"):
        chat = frames(client.post("/v1/chat/completions", json={**SHORT, "stream": True}).text)
        failing = lambda: [r.getMessage() for r in caplog.records if "failed after" in r.getMessage()]
        wait_for(failing, 10)  # logged as the stream closes, which may come after its last frame is read
    failed = failing()
    assert failed[0].endswith(": device lost")  # its counts are unknown: not said to be 0
    assert "0 prompt + 0 new tokens" not in caplog.text
    error = json.loads(chat[-2][1])
    assert error["error"]["message"] == "device lost" and chat[-1][1] == "[DONE]"
    assert error["error"]["request_id"] == error["id"] == json.loads(chat[0][1])["id"]
    messages = frames(client.post("/v1/messages", json={**SHORT, "stream": True}).text)
    assert messages[-1][0] == "error"
    assert json.loads(messages[-1][1])["request_id"] == json.loads(messages[0][1])["message"]["id"]
    responses = frames(client.post("/v1/responses", json={"input": "Hi", "stream": True}).text)
    assert [name for name, _ in responses[-3:-1]] == ["error", "response.failed"] and responses[-1][1] == "[DONE]"
    failed = json.loads(responses[-2][1])["response"]
    assert failed["id"] == json.loads(responses[0][1])["response"]["id"] and failed["status"] == "failed"
    assert json.loads(responses[-3][1])["request_id"] == failed["id"]  # as the contract says of every route's
    assert backend.runs == 3


def test_a_client_that_leaves_before_a_whole_answer_frees_its_slot(tiny_server):
    engine = tiny_server.engine
    outcome: list[BaseException] = []

    def ask() -> None:
        with httpx.Client(base_url=tiny_server.url, timeout=1.5) as client:
            try:
                client.post("/v1/chat/completions", json={**LONG, "stream": False})
            except httpx.ReadTimeout as exc:  # the client gives up and closes its connection
                outcome.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    wait_for(lambda: engine.stats().running == 1, 5)  # running while its client waits
    asking.join(10)
    assert outcome and isinstance(outcome[0], httpx.ReadTimeout)
    wait_for(lambda: engine.stats().running == 0, 5)


class Stalled(Flaky):
    """The in-process backend whose runs wait for ``release`` before they start, as behind slots all
    taken (it says it has none free): requests queue."""

    def __init__(self, inner: InProcessBackend) -> None:
        super().__init__(inner, 0)
        self.release = threading.Event()

    @property
    def info(self):
        return dataclasses.replace(self.inner.info, slots=0)

    async def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        while not self.release.is_set():
            await asyncio.sleep(0.02)
        async for event in self.inner.astream(request):
            yield event


@pytest.mark.parametrize(("per_tenant", "status", "kind"), [(1, 429, "rate_limit_error"), (2, 529, "overloaded_error")])
def test_a_full_queue_is_429_or_529(long_engine, per_tenant, status, kind):
    backend = Stalled(InProcessBackend.of(long_engine))
    server = serve(backend, Settings(max_waiting_per_tenant=per_tenant, max_waiting=1))
    with httpx.Client(base_url=next(server), timeout=30) as client:
        waiting = threading.Thread(target=client.post, args=("/v1/chat/completions",), kwargs={"json": SHORT})
        waiting.start()
        wait_for(lambda: client.get("/v1/health").json()["waiting"] == 1)
        refused = client.post("/v1/chat/completions", json=SHORT)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        refused = client.post("/v1/messages", json=SHORT)
        assert refused.status_code == status and refused.json()["error"]["type"] == kind
        assert "retry-after" in refused.headers
        backend.release.set()
        waiting.join(30)
    server.close()


def test_requests_that_arrive_together_for_free_slots_are_all_taken(long_engine):
    """4 slots free, at most 1 waiting: 4 requests at once are all answered (each counted as waiting
    until the engine gave it its slot, 3 of them were refused with 429)."""
    server = serve(InProcessBackend.of(long_engine), Settings(max_waiting_per_tenant=1, max_waiting=1))
    with httpx.Client(base_url=next(server), timeout=30) as client:
        start = threading.Barrier(4)

        def ask(_):
            start.wait()
            return client.post("/v1/chat/completions", json=SHORT).status_code

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == [200] * 4
    server.close()


class Held(Flaky):
    """The in-process backend whose runs, once accepted (``Queued``), wait for ``release`` before
    their first output, as behind a long prefill; ``closed`` counts runs stopped while held."""

    def __init__(self, inner: InProcessBackend) -> None:
        super().__init__(inner, 0)
        self.release = threading.Event()
        self.closed = 0

    async def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        events = self.inner.astream(request)
        yield await anext(events)
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.02)
        except BaseException:
            self.closed += 1
            await events.aclose()
            raise
        async for event in events:
            yield event


@pytest.fixture
def held(long_engine):
    backend = Held(InProcessBackend.of(long_engine))
    server = serve(backend, Settings(keepalive_s=0.2))
    yield backend, next(server)
    backend.release.set()
    server.close()


def test_a_stream_that_leaves_before_its_headers_is_stopped_at_once(held, monkeypatch):
    """A stream's headers wait up to SLOT_WAIT_S for its slot; a client that left meanwhile was seen only
    when that wait ended: its run went on, its ticket counted as waiting (live clients got 429s)."""
    monkeypatch.setattr("mashbox.server.generation.SLOT_WAIT_S", 30.0)
    backend, url = held

    async def leave():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            streaming = asyncio.ensure_future(client.post("/v1/chat/completions", json={**SHORT, "stream": True}))
            await asyncio.sleep(0.5)  # accepted, held before its slot
            assert not streaming.done() and (await client.get("/v1/health")).json()["waiting"] == 1
            streaming.cancel()
            await asyncio.gather(streaming, return_exceptions=True)
            deadline = time.monotonic() + 5
            while backend.closed < 1 or (await client.get("/v1/health")).json()["waiting"]:
                assert time.monotonic() < deadline, "the run that lost its client still waits"
                await asyncio.sleep(0.05)

    asyncio.run(leave())


@pytest.mark.parametrize(("path", "body", "opening", "beat", "last"), [
    ("/v1/chat/completions", SHORT, '"role":"assistant"', ": keep-alive", None),
    ("/v1/messages", SHORT, ": keep-alive", ": keep-alive", "message_stop"),  # message_start tells the cache: at the slot
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 16}, "event: response.in_progress", ": keep-alive",
     None),
])
def test_a_waiting_stream_gets_its_headers_and_opening_at_once_then_keep_alives(held, path, body, opening, beat, last):
    backend, url = held
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200  # the headers, with no output yet
            chunks = response.iter_raw()
            text = next(chunks).decode()
            assert opening in text
            while text.count(beat) < 3:
                text += next(chunks).decode()
            backend.release.set()
            text += b"".join(chunks).decode()
    events = frames(text)  # the keep-alives are comments or pings a client skips
    assert events[-1][0] == last and (last or events[-1][1] == "[DONE]")
    assert path != "/v1/responses" or events[-2][0] == "response.completed"
    assert path != "/v1/messages" or events[:2] == [("message_start", events[0][1]), ("ping", events[1][1])]
    assert any(name in (None, "content_block_delta", "response.output_text.delta") for name, _ in events[1:-1])


def test_an_answer_that_takes_longer_than_reading_a_request_may_is_not_cut(held, monkeypatch):
    """A connection's deadline is on reading its request: a request read whole waits for its answer as long
    as the answer takes."""
    from mashbox.server.connection import Connection

    monkeypatch.setattr(Connection, "read_s", 0.3)
    backend, url = held
    with httpx.Client(base_url=url, timeout=30) as client:
        threading.Timer(1.0, backend.release.set).start()  # the answer is held past the deadline
        answer = client.post("/v1/chat/completions", json=SHORT)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]


def test_a_client_that_leaves_while_its_request_waits_is_seen_within_a_second(held):
    backend, url = held
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json={**LONG}) as response:
            chunks = response.iter_raw()
            assert next(chunks).startswith(b'data: {"id"')  # the role chunk
            assert backend.closed == 0  # the engine may be running it meanwhile: its output is held
        left = time.monotonic()
        wait_for(lambda: backend.closed == 1 and client.get("/health").json()["live_rows"] == 0, 1.0)
    assert time.monotonic() - left < 1.0  # seen, and its slot freed


class Broken(Flaky):
    """A backend with a bug: its stream raises what no route expects."""

    async def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        raise RuntimeError("a bug")
        yield  # an async generator


def test_an_unexpected_error_is_logged_with_its_request_id(long_engine, caplog):
    """A 500's traceback was logged as "unexpected error" with no request id, so an operator could not
    tell which request it was."""
    server = serve(Broken(InProcessBackend.of(long_engine), 0), Settings())
    with caplog.at_level(logging.INFO, logger="mashbox.server"), \
            httpx.Client(base_url=next(server), timeout=30) as client:
        answer = client.post("/v1/chat/completions", json=SHORT)
    server.close()
    assert answer.status_code == 500
    assert any(r.getMessage() == f"{answer.headers['x-request-id']} failed: unexpected error" for r in caplog.records)


@pytest.mark.parametrize("frame", [data_frame, event_frame])
def test_a_frame_holds_no_character_a_line_reader_splits_on(frame):
    """Every protocol's data lines: U+2028, U+2029 and U+0085 escaped, so that a reader splitting as
    str.splitlines does (httpx's iter_lines) reads each data line whole; the JSON reads back the same."""
    payload = {"type": "content_block_delta", "delta": {"text": "x\u2028y\u2029z\x85w \u00e9\U0001f600"}}
    lines = [line for line in frame(payload).decode().splitlines() if line]
    data = [line for line in lines if line.startswith("data: ")]
    assert len(lines) == (1 if frame is data_frame else 2) and json.loads(data[0][6:]) == payload
    assert "\u00e9\U0001f600" in data[0], "other characters go as UTF-8"

