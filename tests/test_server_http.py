"""The HTTP contract on a real server: status codes, error shapes, headers, HEAD, SSE framing."""

from __future__ import annotations

import json
import logging
import re
import socket
import time

import httpx
import pytest
from anthropic.types import ModelInfo
from openapi_spec_validator import validate
from server import frames, undescribed

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MESSAGE = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client


@pytest.fixture
def loading(loading_server):
    with httpx.Client(base_url=loading_server.url, timeout=10) as client:
        yield client


def openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param
    return error


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/health", "/health", "/"])
def test_health(http, path):
    response = http.get(path)
    assert response.status_code == 200
    assert response.json()["status"] == "ok"
    assert response.headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("path", ["/", "/v1/health", "/v1/chat/completions", "/v1/messages?beta=true", "/nowhere"])
def test_head_on_every_path(http, path):
    response = http.head(path)
    assert response.status_code == 200
    assert response.content == b""
    assert "x-request-id" in response.headers


def test_request_ids_differ_and_come_with_errors(http):
    ids = {http.get("/v1/health").headers["x-request-id"], http.get("/nowhere").headers["x-request-id"]}
    assert len(ids) == 2


def test_a_clients_request_id_is_kept_where_it_is_a_plain_token(http, caplog):
    sent = "edge-7f3a.1:b/2=="
    with caplog.at_level("INFO", logger="mashbox"):
        answer = http.get("/nowhere", headers={"x-request-id": sent})
    assert answer.headers["x-request-id"] == answer.headers["request-id"] == sent
    assert any(sent in r.getMessage() for r in caplog.records), "the log line names the client's id"
    for forged in ("a b", 'x" tenant=admin', "x" * 129, "é".encode()):
        ours = http.get("/v1/health", headers={"x-request-id": forged}).headers["x-request-id"]
        assert ours.startswith("req_") and ours != forged


def test_loading_health_and_head(loading):
    assert loading.get("/v1/health").status_code == 503
    assert loading.get("/").json()["status"] == "loading"
    head = loading.head("/")
    assert head.status_code == 503 and head.content == b"" and head.headers["retry-after"] == "2"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_loading_openai_routes_answer_503(loading, path):
    response = loading.post(path, json={"prompt": "x", "input": "x", **CHAT})
    openai_error(response, 503)
    assert response.headers["retry-after"] == "2"
    assert "x-request-id" in response.headers


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_loading_messages_answer_529(loading, path):
    response = loading.post(path, json=MESSAGE)
    anthropic_error(response, 529, "overloaded_error")
    assert response.headers["retry-after"] == "2"
    assert response.headers["x-should-retry"] == "true"


def test_unknown_path_is_404_in_openai_shape(http):
    openai_error(http.get("/v1/nothing"), 404)
    openai_error(http.post("/v1/responses/compact", json={"input": "x"}), 404)


def test_wrong_method_is_405_not_500(http):
    openai_error(http.get("/v1/responses", headers={"connection": "Upgrade", "upgrade": "websocket"}), 405)


def test_models(http, tiny_server):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == tiny_server.backend.model_id
    assert model["object"] == "model" and model["owned_by"] == "mashbox-labs" and model["created"] == 0
    assert model["max_model_len"] == 32768 and model["slots"] == 4
    assert model["weights"] == tiny_server.backend.info.weights.rsplit("/", 1)[-1] and "/" not in model["weights"]


def test_models_in_anthropic_shape(http, tiny_server):
    body = http.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert body["has_more"] is False and body["first_id"] == tiny_server.backend.model_id
    ModelInfo.model_validate(body["data"][0])
    assert body["data"][0]["max_input_tokens"] == 32767  # a prompt of the context's length is refused: 1 is the answer's


def test_get_model(http, tiny_server):
    model_id = tiny_server.backend.model_id
    assert http.get(f"/v1/models/{model_id}").json()["id"] == model_id
    error = openai_error(http.get("/v1/models/gpt-4o"), 404, "model")
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_another_model_in_the_body_is_404(http, path):
    response = http.post(path, json={"prompt": "x", "input": "x", **CHAT, "model": "gpt-4o"})
    assert openai_error(response, 404, "model")["code"] == "model_not_found"


def test_messages_answer_with_the_model_asked_for(http):
    response = http.post("/v1/messages?beta=true", json={**MESSAGE, "model": "claude-sonnet-4"})
    assert response.status_code == 200
    assert response.json()["model"] == "claude-sonnet-4"


def test_model_left_out_answers_with_the_served_id(http, tiny_server):
    assert http.post("/v1/chat/completions", json=CHAT).json()["model"] == tiny_server.backend.model_id


def test_415_for_a_body_that_is_not_json(http):
    response = http.post("/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": "text/plain"})
    openai_error(response, 415)
    response = http.post("/v1/messages", content=json.dumps(MESSAGE), headers={"content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["type"] == "error"


@pytest.mark.parametrize(("body", "says"), [
    (b"{not json", "the body is not valid JSON: object keys must be strings (byte 1)"),
    (b'{"messages": [', "the body is not valid JSON: it ends in the middle of a value (input data was truncated)"),
    (b"", "the body is not valid JSON: it is empty; send a JSON object"),
    (b"[1, 2]", "the body must be a JSON object: expected `object`, got `array`"),
])
def test_invalid_json_is_400_saying_so_on_every_route(http, body, says):
    headers = {"content-type": "application/json"}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert openai_error(http.post(path, content=body, headers=headers), 400)["message"] == says
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert anthropic_error(http.post(path, content=body, headers=headers), 400, "invalid_request_error") == says


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "temperature": 9}, "temperature"),
    ({**CHAT, "logprobs": True}, "logprobs"),
    ({"max_tokens": 3}, "messages"),
    ({"max_tokens": 3, "messages": [{"role": "user", "text": "Hi"}]}, "messages.0.content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
])
def test_bad_fields_are_400_naming_the_field(http, body, param):
    openai_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_what_this_server_does_not_keep_is_400_naming_the_field_with_a_code(http):
    error = openai_error(http.post("/v1/responses", json={"previous_response_id": "resp_1", "input": "x"}), 400,
                         "previous_response_id")
    assert error["code"] == "unsupported_parameter" and "previous_response_id" in error["message"]
    error = openai_error(http.post("/v1/responses", json={"input": [{"type": "item_reference", "id": "msg_1"}]}), 400,
                         "input.0.type")
    assert error["code"] == "unsupported_value" and "item_reference ('msg_1')" in error["message"]
    assert "send the items themselves" in error["message"]


def test_messages_400_in_anthropic_shape(http):
    message = anthropic_error(http.post("/v1/messages", json={**MESSAGE, "top_p": 0}), 400, "invalid_request_error")
    assert message.startswith("top_p")


@pytest.mark.parametrize("words", [40000, 400000])  # counted, and refused from a lower bound untokenized
def test_context_length_is_400_in_the_words_agents_match(http, words):
    prompt = "hello " * words
    turn = [{"role": "user", "content": prompt}]
    for path, body, param in [("/v1/completions", {"prompt": prompt}, "prompt"),
                              ("/v1/chat/completions", {"messages": turn}, "messages"),
                              ("/v1/responses", {"input": prompt}, "input")]:
        error = openai_error(http.post(path, json=body), 400, param)
        assert error["code"] == "context_length_exceeded" and "a context of 32768 takes at most 32767 prompt tokens" in error["message"]
        assert re.search(r"maximum context length is \d+ tokens", error["message"])  # Pi's words for OpenAI's
    message = anthropic_error(http.post("/v1/messages", json={**MESSAGE, "messages": turn}), 400,
                              "invalid_request_error")
    assert re.fullmatch(r"prompt is too long: (\d+) tokens > 32767 maximum", message), message
    assert int(message.split()[4]) > 32768


def test_a_prompt_that_fills_the_context_is_too_long_by_one(http):
    """A prompt of exactly the context's tokens leaves no room for an answer: refused, in numbers that
    hold (Claude Code computes how much to compact from them)."""
    count = lambda n: http.post("/v1/messages/count_tokens", json={"messages": [
        {"role": "user", "content": "hello " * n}]}).json()["input_tokens"]
    fixed = count(1000) - 1000
    assert count(1001) == fixed + 1001, "one token a word"
    turn = [{"role": "user", "content": "hello " * (32768 - fixed)}]
    message = anthropic_error(http.post("/v1/messages", json={**MESSAGE, "messages": turn}), 400, "invalid_request_error")
    assert message == "prompt is too long: 32768 tokens > 32767 maximum"
    turn = [{"role": "user", "content": "hello " * (32767 - fixed)}]
    assert http.post("/v1/messages/count_tokens", json={"messages": turn}).json()["input_tokens"] == 32767


def test_ignored_fields_header(http):
    response = http.post("/v1/chat/completions", json={**CHAT, "frobnicate": 1, "merge": True})
    assert response.status_code == 200
    assert response.headers["x-mashbox-ignored-fields"] == "frobnicate, merge"
    assert "x-mashbox-ignored-fields" not in http.post("/v1/chat/completions", json=CHAT).headers


def test_ignored_field_names_with_control_characters_still_get_an_answer(http):
    response = http.post("/v1/chat/completions", json={**CHAT, "bad\r\nname\u0007é": 1, "x" * 5000: 2})
    assert response.status_code == 200
    header = response.headers["x-mashbox-ignored-fields"]
    assert "bad\\r\\nname\\x07\\xe9" in header and len(header) <= 2051 and header.isprintable()


def test_ignored_field_names_with_spaces_at_their_ends_still_get_an_answer(http):
    response = http.post("/v1/chat/completions", json={**CHAT, " padded ": 1})
    assert response.status_code == 200
    assert response.headers["x-mashbox-ignored-fields"] == "\\x20padded\\x20"


def test_conversation_without_content_is_a_400_naming_messages(http):
    for path in ("/v1/chat/completions", "/v1/messages/count_tokens"):
        body = {"messages": [{"role": "system", "content": ""}], "max_tokens": 2}
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        assert "messages" in response.text


def test_empty_prompt_is_a_400_naming_prompt(http):
    response = http.post("/v1/completions", json={"prompt": "", "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_session_is_logged(http, caplog):
    with caplog.at_level(logging.INFO, logger="mashbox.server"):
        response = http.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "sess-42"})
        http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, "prompt_cache_key": "pck-7"})
    request_id = response.headers["x-request-id"]
    assert any(request_id in r.getMessage() and "sess-42" in r.getMessage() for r in caplog.records)
    assert any("pck-7" in r.getMessage() for r in caplog.records)


def test_every_refused_request_is_logged_with_its_id_and_status(http, caplog):
    """400s, 404s and 415s (and the 503s of a restarting worker) wrote no line: an operator saw no
    error while clients were turned away."""
    with caplog.at_level(logging.INFO, logger="mashbox.server"):
        answers = [http.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}),
                   http.post("/v1/chat/completions", json={**CHAT, "model": "no-such-model"}),
                   http.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"}),
                   http.post("/v1/completions", json={"prompt": "", "max_tokens": 2})]  # refused by the engine
    lines = [r.getMessage() for r in caplog.records]
    for answer in answers:
        said = [line for line in lines if answer.headers["x-request-id"] in line and "answered" in line]
        assert answer.status_code >= 400 and len(said) == 1, (answer.status_code, lines)
        assert f"answered {answer.status_code}: " in said[0]


def test_count_tokens(http):
    assert http.post("/v1/messages/count_tokens", json=MESSAGE).json()["input_tokens"] > 3


def test_count_tokens_reads_a_request_as_messages_does(http):
    """The fields it ignores are said in the header (they were ignored silently), and a tool_choice naming
    no declared tool is refused as /v1/messages refuses it (it was counted)."""
    counted = http.post("/v1/messages/count_tokens", json={"messages": MESSAGE["messages"], "frobnicate": 1})
    assert counted.status_code == 200 and counted.headers["x-mashbox-ignored-fields"] == "frobnicate"
    tools = [{"name": "t", "input_schema": {"type": "object"}}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        refused = http.post(path, json={**MESSAGE, "tools": tools, "tool_choice": {"type": "tool", "name": "zzz"}})
        assert refused.status_code == 400 and "names a tool that is not in tools" in refused.text, refused.text


def test_chat_stream_framing(http):
    text = http.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                    "stream_options": {"include_usage": True}}).text
    events = frames(text)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_stream_framing(http):
    response = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = frames(response.text)
    assert events[-1] == (None, "[DONE]")
    assert json.loads(events[-2][1])["choices"][0]["finish_reason"] == "length"


def test_messages_stream_framing(http):
    events = frames(http.post("/v1/messages", json={**MESSAGE, "stream": True}).text)
    assert all(name == json.loads(data)["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]


def test_responses_stream_framing(http):
    *events, done = frames(http.post("/v1/responses", json={"input": "x", "max_output_tokens": 3, "stream": True}).text)
    assert done == (None, "[DONE]")  # after the end event, as open-responses.md says
    payloads = [json.loads(data) for _, data in events]
    assert [name for name, _ in events] == [p["type"] for p in payloads]
    assert [p["sequence_number"] for p in payloads] == list(range(1, len(payloads) + 1))
    assert payloads[-1]["type"] == "response.incomplete" or payloads[-1]["response"]["status"] == "incomplete"


def test_metrics(http):
    http.post("/v1/chat/completions", json=CHAT)
    response = http.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    finished = [line for line in response.text.splitlines() if line.startswith("mashbox:request_finished_total{")]
    assert any('protocol="chat"' in line and 'finished_reason="length"' in line for line in finished)



def test_metrics_count_answers_not_bad_requests(http):
    """A request the engine refuses (an empty prompt, one over the context, an unknown tool to force) is
    a 400, not a request answered: no finish reason counts it (it once counted as an abort)."""
    def finished() -> float:
        lines = http.get("/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("mashbox:request_finished_total{"))

    before = finished()
    for body in ({"prompt": "", "max_tokens": 5}, {"prompt": "word " * 40000, "max_tokens": 5}):
        assert http.post("/v1/completions", json=body).status_code == 400
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    forced = {**CHAT, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}
    assert http.post("/v1/chat/completions", json=forced).status_code == 400
    assert finished() == before
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert finished() == before + 1


def error_answers(http: httpx.Client) -> dict[str, float]:
    """mashbox:error_answers_total by status, as /metrics has it now."""
    lines = http.get("/metrics").text.splitlines()
    found = [re.search(r'status="(\w+)"\} (\S+)$', line) for line in lines if line.startswith("mashbox:error_answers_total{")]
    return {m[1]: float(m[2]) for m in found if m}


def test_metrics_count_error_answers_by_status(http):
    errors = lambda: error_answers(http)  # noqa: E731
    before = errors()
    assert http.post("/v1/completions", json={"prompt": "", "max_tokens": 5}).status_code == 400
    assert http.post("/v1/chat/completions", json={**CHAT, "model": "nope"}).status_code == 404
    assert http.get("/nowhere").status_code == 404
    assert http.post("/v1/messages", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    after = errors()
    assert after.get("400", 0) - before.get("400", 0) == 2
    assert after.get("404", 0) - before.get("404", 0) == 2
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert errors() == after, "an answered request is no error"

def test_a_client_that_leaves_mid_body_is_neither_answered_nor_a_failure(http, tiny_server, caplog):
    """A client that sent half its body and left was counted as a 500 answered, with no log line: a 5xx
    alert for clients that went away. It is one info line, and no error counted."""
    body = json.dumps(CHAT).encode()
    host, port = tiny_server.url.removeprefix("http://").split(":")
    before = error_answers(http)
    with caplog.at_level("INFO", logger="mashbox"):
        for _ in range(3):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
                             b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
                time.sleep(0.2)
        time.sleep(0.5)
    assert error_answers(http) == before
    assert sum("left before its body was read whole" in r.getMessage() for r in caplog.records) == 3


def test_openapi_is_valid_3_1_and_names_the_model(http, tiny_server):
    doc = http.get("/openapi.json").json()
    validate(doc)
    assert doc["openapi"].startswith("3.1")
    assert tiny_server.backend.model_id in doc["info"]["description"]
    assert doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]


@pytest.mark.parametrize(("path", "body", "schema"), [
    ("/v1/messages", {**MESSAGE, "model": "any"}, "MessageStreamEvent"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 16}, "ResponseStreamEvent"),
])
def test_every_event_of_a_stream_fits_the_openapi_description(http, path, body, schema):
    """The streams were described by their first event's schema alone (message_start, response.created):
    every later event failed it."""
    from jsonschema import Draft202012Validator
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012

    doc = http.get("/openapi.json").json()
    registry = Registry().with_resource("urn:doc", DRAFT202012.create_resource(doc))
    check = Draft202012Validator({"$ref": f"urn:doc#/components/schemas/{schema}"}, registry=registry)
    text = http.post(path, json={**body, "stream": True}).text
    events = [json.loads(data) for _, data in frames(text) if data != "[DONE]"]
    assert len({e["type"] for e in events}) >= 5
    for event in events:
        assert not list(check.iter_errors(event)), (event["type"], [e.message for e in check.iter_errors(event)][:3])


def test_openapi_names_the_id_a_model_from_a_path_is_served_under(tmp_path):
    """Made before the model loads, the document named the path the server was started with, an id every
    request then refused (404 model_not_found)."""
    from mashbox.engine.load.catalog import resolve, served_id
    from mashbox.server.launch import Launch, _backend
    from mashbox.server.openapi import document
    from mashbox.server.settings import Settings

    model = tmp_path / "My-Model.Q4_1.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # resolves; never loads
    assert served_id(str(model)) == "My-Model.Q4_1" == resolve(str(model)).id
    assert served_id(str(tmp_path)) == tmp_path.name and served_id("smollm2-135m") == "smollm2-135m"
    for in_process in (True, False):
        backend = _backend(Launch(str(model), Settings(), {}, in_process=in_process))
        try:
            assert document(backend.model_id, "0")["info"]["x-model"] == "My-Model.Q4_1"
        finally:
            backend.close()


def test_answers_fit_what_the_document_says_of_their_status(http, loading, tiny_server):
    """Anthropic's model shapes (a client that sends anthropic-version), a 403 on /health (said to be a Health
    body) and a 503 from /v1/models while loading (not said at all) were answers the document did not describe."""
    doc = http.get("/openapi.json").json()
    anthropic = {"anthropic-version": "2023-06-01"}
    model = f"/v1/models/{tiny_server.backend.model_id}"
    for path, response in [("/v1/models", http.get("/v1/models")), ("/v1/models", http.get("/v1/models", headers=anthropic)),
                           ("/v1/models/{model}", http.get(model, headers=anthropic)),
                           ("/health", http.get("/health", headers={"Origin": "http://elsewhere.example"})),
                           ("/v1/models", loading.get("/v1/models")),
                           ("/v1/models/{model}", loading.get("/v1/models/x"))]:
        assert response.status_code in (200, 403, 503)
        assert not undescribed(doc, path, "get", response), (path, response.status_code, response.text)


def test_a_null_stream_is_taken_and_described(http):
    """Taken as not streamed (as OpenAI's API takes it), where the document said a boolean only."""
    doc = http.get("/openapi.json").json()
    for name in ("ChatRequest", "CompletionRequest", "MessagesRequest", "ResponsesRequest"):
        assert {"type": "null"} in doc["components"]["schemas"][name]["properties"]["stream"]["anyOf"], name
    answer = http.post("/v1/chat/completions", json={**CHAT, "stream": None})
    assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"


def test_openapi_describes_every_route(http):
    from mashbox.server.routes import HANDLERS
    from mashbox.server.task_routes import TASK_HANDLERS

    doc = http.get("/openapi.json").json()
    for handler in [*HANDLERS, *TASK_HANDLERS]:
        for path in handler.paths - {p for p in handler.paths if p.startswith("/tasks")}:  # /tasks: /v1/tasks' alias
            described = path.replace(":str}", "}")
            assert set(m.lower() for m in handler.http_methods) <= set(doc["paths"][described]), path


@pytest.mark.parametrize(("path", "method", "body", "status"), [
    ("/v1/chat/completions", "chat", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ("/v1/completions", "complete", {"prompt": "a", "max_tokens": 0}, 400),
    ("/v1/responses", "respond", {"input": "a", "tools": [{"type": "function"}]}, 400),
    ("/v1/messages", "message", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ("/v1/messages/count_tokens", "count_tokens", {"messages": "hi"}, 400),
])
def test_the_server_and_the_engine_refuse_a_request_alike(http, tiny_server, path, method, body, status):
    """One front half for both: the same rule gives the same error (field, words) on each."""
    from mashbox import InvalidRequestError

    with pytest.raises(InvalidRequestError) as raised:
        getattr(tiny_server.engine, method)(body)
    answer = http.post(path, json=body)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["message"] == raised.value.message or error["message"] == f"{raised.value.param}: {raised.value.message}"
    if "param" in error:
        assert error["param"] == raised.value.param


def test_the_server_app_imports_no_torch():
    """The HTTP process stays light: torch (and the model) live in the worker."""
    import subprocess
    import sys

    code = "import sys; import mashbox.server.app, mashbox.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_a_session_that_looks_like_log_fields_is_quoted_and_a_refusal_ends_its_line(http, caplog):
    """``prompt_cache_key: "abc tenant=admin"`` was logged as ``session=abc tenant=admin tenant=default``;
    a request refused after its first line (a prompt too long for the context) never got its second."""
    with caplog.at_level(logging.INFO, logger="mashbox.server"):
        http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, "prompt_cache_key": "abc tenant=admin"})
        refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 33000}]})
    lines = [r.getMessage() for r in caplog.records]
    assert any('session="abc tenant=admin" tenant=default' in line for line in lines), lines
    assert refused.status_code == 400, refused.text
    request_id = refused.headers["x-request-id"]
    assert any(line.startswith(f"{request_id} POST '/v1/chat/completions' answered 400: ") for line in lines), lines


def _raw(server, request: bytes) -> bytes:
    """Everything the server sends back to ``request``, sent as it is on a connection of its own, until it closes."""
    from urllib.parse import urlsplit

    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while got := sock.recv(65536):
            answer += got
        return answer


def test_a_target_in_absolute_form_is_routed_by_its_path_and_host(tiny_server):
    """RFC 9112 3.2.2: an origin server takes ``GET http://host/path`` (a proxy's form) by its path, the Host being the
    target's (it was a 404); a foreign authority there is refused as a foreign Host is."""
    netloc = tiny_server.url.removeprefix("http://").encode()
    get = lambda target: _raw(tiny_server, b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" % target)
    assert get(b"http://%s/health" % netloc).startswith(b"HTTP/1.1 200")
    assert b'"object":"list"' in get(b"HTTP://%s/v1/models?x=1" % netloc)
    assert get(b"http://evil.example/health").startswith(b"HTTP/1.1 403")


def test_faulty_framing_is_refused_and_its_connection_closed_and_upgrades_are_not_taken(tiny_server, caplog):
    """RFC 9112: both Content-Length and Transfer-Encoding (a smuggled request behind a proxy that reads the
    other) is answered, then the connection closed (a pipelined request after it was answered too); HTTP/2's
    preface is no HTTP/1 request (it was a 404 for ``PRI *``); an Upgrade (curl --http2 asks for h2c on every
    request) is answered in HTTP/1.1, with no warning to install a websocket library."""
    smuggled = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n0\r\n\r\n"
                b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = _raw(tiny_server, smuggled)
    assert answer.startswith(b"HTTP/1.1 400") and b"connection: close" in answer and answer.count(b"HTTP/1.1") == 1
    assert b"Transfer-Encoding with Content-Length" in answer
    assert _raw(tiny_server, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").startswith(b"HTTP/1.1 505")
    with caplog.at_level("WARNING"):
        upgraded = _raw(tiny_server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, close\r\n"
                                     b"Upgrade: websocket\r\n\r\n")
    assert upgraded.startswith(b"HTTP/1.1 200") and "upgrade" not in caplog.text.lower(), caplog.text


def test_a_connection_that_sends_no_whole_request_in_time_is_closed(tiny_server, monkeypatch):
    """Part of a request's headers, part of its body, or nothing: closed after ``read_s`` (each held a
    connection for as long as its client liked); the next request on a connection has its own time."""
    from urllib.parse import urlsplit

    from mashbox.server.connection import Connection

    monkeypatch.setattr(Connection, "read_s", 0.5)
    address = urlsplit(tiny_server.url)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"

    def closed_after(sent: bytes) -> float:
        with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
            sock.sendall(sent)
            start = time.monotonic()
            assert sock.recv(4096) == b""  # closed, nothing answered
            return time.monotonic() - start

    for sent in (b"", head[:30], head + b"Content-Length: 100\r\n\r\n{\"mess"):
        assert 0.3 < closed_after(sent) < 5
    body = json.dumps(CHAT).encode()
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        for _ in range(3):  # one connection, each request right after the answer before it
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            answer = b""
            while b"}}" not in answer and (got := sock.recv(65536)):  # the usage object ends the body
                answer += got
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"}"), answer[-200:]
