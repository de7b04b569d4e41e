"""Server fixtures: the real app on uvicorn in a background thread, on a free port of 127.0.0.1.

Registered in conftest.py. Each server is started once per session over a session engine:
``smol_server`` (the real SmolLM2, for the SDK tests), ``tiny_server`` (a tiny random Llama with
a context large enough for agent prompts of 25k tokens), ``idle_server`` (same engine, 1 s idle
timeout) and ``loading_server`` (a backend whose model never finishes loading).
``oai`` and ``claude`` are the official SDKs on ``smol_server``, strict, one per test module.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
import uvicorn

from mashbox import Engine
from mashbox.server.app import create_app
from mashbox.server.backend import Backend, InProcessBackend
from mashbox.server.connection import Connection
from mashbox.server.launch import listen
from mashbox.server.settings import Settings


@dataclass
class Running:
    url: str
    backend: Backend
    engine: Engine | None


def serve(backend: Backend, settings: Settings) -> Iterator[str]:
    sock = listen("127.0.0.1", 0)  # `mashbox run`'s own listening socket
    config = uvicorn.Config(create_app(backend, settings), log_level="warning", lifespan="on",
                            http=Connection)  # as `mashbox run`
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _running(engine: Engine, settings: Settings) -> Iterator[Running]:
    backend = InProcessBackend.of(engine)
    for url in serve(backend, settings):
        yield Running(url, backend, engine)


@pytest.fixture(scope="session")
def smol_server(smol_engine) -> Iterator[Running]:
    yield from _running(smol_engine, Settings())


@pytest.fixture(scope="session")
def long_engine(tiny_model_dir) -> Iterator[Engine]:
    """The tiny random Llama with a 32k context: fast on agent prompts of 10-25k tokens."""
    with Engine(str(tiny_model_dir), ctx=32768, slots=4, allow_long_context=True, quiet=True) as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny_server(long_engine) -> Iterator[Running]:
    yield from _running(long_engine, Settings())


@pytest.fixture(scope="session")
def fuzz_server(tiny_engine, tmp_path_factory) -> Iterator[Running]:
    """The tiny random Llama with a 512-token context: any max_tokens a fuzzer draws ends fast."""
    yield from _running(tiny_engine, Settings(tasks_db=str(tmp_path_factory.mktemp("fuzz") / "tasks.sqlite3")))


@pytest.fixture(scope="session")
def idle_server(long_engine) -> Iterator[Running]:
    yield from _running(long_engine, Settings(idle_timeout_s=1.0))


@pytest.fixture(scope="session")
def loading_server() -> Iterator[Running]:
    release = threading.Event()

    def build() -> Engine:
        release.wait()
        raise RuntimeError("test over")

    backend = InProcessBackend("still-loading", build)
    for url in serve(backend, Settings(retry_after_s=2)):
        yield Running(url, backend, None)
    release.set()


@pytest.fixture(scope="module")
def oai(smol_server: Running) -> openai.OpenAI:
    """The official OpenAI SDK on ``smol_server``, validating every response strictly."""
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", _strict_response_validation=True,
                         max_retries=0)


@pytest.fixture(scope="module")
def claude(smol_server: Running) -> anthropic.Anthropic:
    """The official Anthropic SDK on ``smol_server``, validating every response strictly."""
    return anthropic.Anthropic(base_url=smol_server.url, api_key="unused", _strict_response_validation=True,
                               max_retries=0)


# -- helpers ------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"  # copies of shared/spec and shared/clients
OPEN_RESPONSES = FIXTURES / "open-responses-openapi.json"
CLIENTS = FIXTURES / "clients"


def frames(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event, comments (keep-alives) skipped; checks the
    blank-line framing."""
    assert text.endswith("\n\n"), text[-200:]
    out = []
    for block in text.strip("\n").split("\n\n"):
        if block.startswith(":"):
            continue
        lines = block.split("\n")
        event = lines[0].removeprefix("event: ") if lines[0].startswith("event: ") else None
        data = [line for line in lines if line.startswith("data: ")]
        assert len(data) == 1 and len(lines) == 1 + (event is not None), block
        out.append((event, data[0].removeprefix("data: ")))
    return out


class OpenResponses:
    """Validates Responses objects and stream events against the Open Responses OpenAPI schemas."""

    def __init__(self) -> None:
        doc = json.loads(OPEN_RESPONSES.read_text())
        self._components = doc["components"]
        self._events = {
            schema["properties"]["type"]["enum"][0]: name
            for name, schema in self._components["schemas"].items()
            if name.endswith("StreamingEvent") and "enum" in schema.get("properties", {}).get("type", {})
        }

    def response(self, body: dict) -> None:
        self._validate("ResponseResource", body)

    def event(self, event: dict) -> None:
        self._validate(self._events[event["type"]], event)

    def _validate(self, name: str, value: dict) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": self._components}
        jsonschema.Draft202012Validator(schema).validate(value)


def undescribed(doc: dict, path: str, method: str, response: httpx.Response) -> list[str]:
    """How ``response``'s JSON body fails the schema ``doc`` (the server's /openapi.json) gives ``path``'s
    ``method`` for its status ([] where it fits)."""
    answer = doc["paths"][path][method]["responses"][str(response.status_code)]
    schema = {**answer["content"]["application/json"]["schema"], "components": doc["components"]}
    return [error.message for error in jsonschema.Draft202012Validator(schema).iter_errors(response.json())]
