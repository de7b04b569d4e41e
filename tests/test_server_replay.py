"""Every request captured from a real client (shared/clients), replayed over HTTP.

Method, path (with its query), headers and body as the client sent them; the model id is swapped
for the served one and the token limit made small. Each answer must be well formed in its
protocol: the SDK types validate it, and Responses also validate against Open Responses.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic.types as at
import httpx
import openai.types.chat as oc
import openai.types.responses as orr
import pytest
from pydantic import TypeAdapter
from server import CLIENTS, OpenResponses, frames

DROPPED = {"host", "content-length"}
LIMITS = ("max_tokens", "max_output_tokens", "max_completion_tokens")
REFUSED = {  # capture -> (status, param): answers the contract asks for instead of a 200
    "schemathesis-openresponses_POST_v1_responses_example.json": (400, "previous_response_id"),
    "openresponses-compliance_GET_v1_responses_websocket.json": (405, None),
    "openresponses-compliance_POST_v1_responses_compact.json": (404, None),
}


@pytest.fixture(scope="module")
def schemas():
    return OpenResponses()


def _captures() -> list[Path]:
    return sorted(CLIENTS.glob("*.json"))


def _request(capture: dict, model: str) -> dict:
    headers = {k: v for k, v in capture["headers"].items() if k.lower() not in DROPPED}
    body = capture.get("body")
    if isinstance(body, dict):
        body = {**body, **({"model": model} if "model" in body else {})}
        body.update({name: 4 for name in LIMITS if name in body} or {"max_output_tokens": 4})
    content = None if body is None else json.dumps(body).encode()
    return {"method": capture["method"], "url": capture["path"], "headers": headers, "content": content}


def test_all_captures_are_here():
    assert len(_captures()) >= 21


@pytest.mark.parametrize("path", _captures(), ids=lambda p: p.stem)
def test_replay(path, tiny_server, schemas):
    capture = json.loads(path.read_text())
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        response = client.request(**_request(capture, tiny_server.backend.model_id))
    assert "x-request-id" in response.headers
    if path.name in REFUSED:
        status, param = REFUSED[path.name]
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param
        return
    assert response.status_code == 200, response.text
    if capture["method"] == "HEAD":
        assert response.content == b""
        return
    streamed = response.headers["content-type"].startswith("text/event-stream")
    assert streamed == bool(capture["body"].get("stream"))
    route = capture["path"].split("?")[0]
    check = {"/v1/chat/completions": _chat, "/v1/messages": _messages, "/v1/responses": _responses}[route]
    check(response, streamed, schemas)


def _chat(response: httpx.Response, streamed: bool, schemas: OpenResponses) -> None:
    if not streamed:
        oc.ChatCompletion.model_validate(response.json())
        return
    events = frames(response.text)
    assert events[-1] == (None, "[DONE]")
    for _, data in events[:-1]:
        oc.ChatCompletionChunk.model_validate_json(data)


def _messages(response: httpx.Response, streamed: bool, schemas: OpenResponses) -> None:
    if not streamed:
        at.Message.model_validate(response.json())
        return
    adapter = TypeAdapter(at.RawMessageStreamEvent)
    names = []
    for name, data in frames(response.text):
        assert json.loads(data)["type"] == name
        if name != "ping":  # the SDK reads ping and skips it; its event union leaves it out
            adapter.validate_json(data)
        names.append(name)
    assert names[0] == "message_start" and names[-1] == "message_stop"


def _responses(response: httpx.Response, streamed: bool, schemas: OpenResponses) -> None:
    if not streamed:
        orr.Response.model_validate(response.json())
        schemas.response(_open_tools(response.json()))
        return
    adapter = TypeAdapter(orr.ResponseStreamEvent)
    *sent, done = frames(response.text)
    assert done == (None, "[DONE]")  # the stream's end, as open-responses.md says
    events = [json.loads(data) for _, data in sent]
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    for event in events:
        adapter.validate_python(event)
        schemas.event({**event, "response": _open_tools(event["response"])} if "response" in event else event)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def _open_tools(response: dict) -> dict:
    """The response with only the tools Open Responses knows (function tools).

    server-api echoes ``tools`` as the request sent them, Codex's namespace and custom tools
    included; the Open Responses schema admits function tools only. server-api wins (DESIGN.md).
    """
    return {**response, "tools": [t for t in response.get("tools", []) if t.get("type") == "function"]}
