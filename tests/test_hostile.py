"""Hostile but plausible bodies on the five generation routes, over real HTTP: each answered with a
4xx in the route's own error shape, before any costly work, and the server healthy afterwards."""

from __future__ import annotations

import json
import re

import httpx
import pytest

USER = [{"role": "user", "content": "hi"}]
ROUTES = {  # route -> (path, a valid body, the field holding the conversation)
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}, "messages"),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "prompt"),
    "responses": ("/v1/responses", {"input": USER, "max_output_tokens": 2}, "input"),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 2}, "messages"),
    "count_tokens": ("/v1/messages/count_tokens", {"messages": USER}, "messages"),
}
ANTHROPIC = ("messages", "count_tokens")


@pytest.fixture
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client
        assert client.get("/health").json()["status"] == "ok"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def post(http: httpx.Client, route: str, raw: str) -> httpx.Response:
    return http.post(ROUTES[route][0], content=raw.encode(), headers={"content-type": "application/json"})


def error_message(route: str, response: httpx.Response, status: int = 400) -> str:
    """The message of an error answer, checked to be in the route's shape."""
    assert response.status_code == status, response.text
    body = response.json()
    if route in ANTHROPIC:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_a_body_nested_too_deeply_is_a_400(http, route, depth):
    path, body, field = ROUTES[route]
    raw = json.dumps(body)[:-1] + f', "{field}": {nested(depth)}}}'
    assert "nested too deeply" in error_message(route, post(http, route, raw))


@pytest.mark.parametrize("route", ROUTES)
def test_deep_but_decodable_nesting_anywhere_is_never_a_500(http, route):
    path, body, field = ROUTES[route]
    for where in (field, "metadata", "tools", "unknown_field"):
        raw = json.dumps({k: v for k, v in body.items() if k != where})[:-1] + f', "{where}": {nested(200)}}}'
        response = post(http, route, raw)
        assert response.status_code < 500, (where, response.text)


@pytest.mark.parametrize("route", ["chat", "responses", "messages", "count_tokens"])
def test_more_messages_than_the_context_has_tokens_are_refused_unread(http, route, tiny_server):
    path, body, field = ROUTES[route]
    ctx = tiny_server.backend.info.ctx
    hostile = {**body, field: USER * 200_000}
    assert 200_000 > ctx
    message = error_message(route, http.post(path, json=hostile))
    if route in ANTHROPIC:  # the words Claude Code matches to compact its history
        assert message == f"prompt is too long: 200000 tokens > {ctx - 1} maximum"
    else:
        assert "at least 200000 tokens" in message and str(ctx) in message


@pytest.mark.parametrize("route", ROUTES)
def test_a_text_longer_than_any_tokenization_could_fit_is_refused_untokenized(http, route, tiny_server):
    """9 MB of text (under the 10 MB body cap): refused from its length, not after tokenizing it."""
    path, body, field = ROUTES[route]
    text = "word " * 1_800_000
    hostile = {**body, field: text if route == "completions" else [{"role": "user", "content": text}]}
    message = error_message(route, http.post(path, json=hostile))
    ctx = tiny_server.backend.info.ctx
    if route in ANTHROPIC:
        assert re.fullmatch(rf"prompt is too long: \d+ tokens > {ctx - 1} maximum", message), message
    else:
        assert "the prompt is at least" in message and str(ctx) in message


@pytest.mark.parametrize("where", ["tools", "messages"])
def test_tools_or_call_arguments_longer_than_any_tokenization_could_fit_are_refused_untokenized(http, where):
    """9 MB in a tool's description, or in a call's arguments in the history: only the messages' text was
    counted, so each was rendered and tokenized (twice for tools) before its refusal, 10-25 s of the
    worker that every other request waited on."""
    text = "word " * 1_800_000
    body = {"messages": USER, "max_tokens": 2}
    if where == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": text}}]
    else:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"text": text})}}
        body["messages"] = [*USER, {"role": "assistant", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    response = http.post("/v1/chat/completions", json=body)
    assert "the prompt is at least" in error_message("chat", response), response.text
    assert response.json()["error"]["param"] == where


@pytest.mark.parametrize("route", ROUTES)
def test_a_lone_surrogate_is_a_400(http, route):
    path, body, field = ROUTES[route]
    value = '"\\ud800 hi"' if route == "completions" else '[{"role": "user", "content": "\\ud800 hi"}]'
    raw = json.dumps({**body, field: "HERE"}).replace('"HERE"', value)
    message = error_message(route, post(http, route, raw))
    assert "\\ud800 at byte" in message and "half of a UTF-16 surrogate pair" in message, message  # not "truncated"


TOOLS = {  # route -> a tool whose schema nests HERE
    "chat": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": "HERE"}}}],
    "responses": [{"type": "function", "name": "f", "parameters": {"type": "object", "x": "HERE"}}],
    "messages": [{"name": "f", "input_schema": {"type": "object", "x": "HERE"}}],
    "count_tokens": [{"name": "f", "input_schema": {"type": "object", "x": "HERE"}}],
}


@pytest.mark.parametrize("route", TOOLS)
def test_a_schema_nested_deeper_than_its_readers_take_is_a_400_naming_it(http, route):
    """600 levels decode (the decoder takes about a thousand), but sending the request to the worker (pickle)
    and echoing Responses' tools (pydantic) recurse too: a 500 with a RecursionError, retried by the SDKs."""
    path, body, _ = ROUTES[route]
    raw = json.dumps({**body, "tools": TOOLS[route]}).replace('"HERE"', nested(600))
    response = post(http, route, raw)
    message = error_message(route, response)
    named = message if route in ANTHROPIC else response.json()["error"]["param"]
    assert "nests more than 128 levels deep" in message and named.startswith("tools.0."), response.text
    assert len(named) < 100, named  # where the nesting begins, not a path 128 levels long


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_calls_arguments_may_escape_a_lone_surrogate(http, route):
    """Valid text whose JSON escapes half a UTF-16 pair (a model may write one; its agent sends it back):
    the template's reading of the arguments handed the tokenizer a lone surrogate, a 500."""
    arguments = '{"q": "\\ud800 x", "\\udfff": 1}'
    if route == "chat":
        call = {"id": "c", "type": "function", "function": {"name": "s", "arguments": arguments}}
        turns = [*USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    else:
        turns = [*USER, {"type": "function_call", "call_id": "c", "name": "s", "arguments": arguments},
                 {"type": "function_call_output", "call_id": "c", "output": "ok"}]
    path, body, field = ROUTES[route]
    assert http.post(path, json={**body, field: turns}).status_code == 200


def test_a_wrong_method_says_which_methods_the_path_takes(http):
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405  # and, as RFC 9110 says it must, which methods it takes
    assert set(response.headers["allow"].split(", ")) == {"OPTIONS", "POST"}


def test_a_body_over_the_limit_is_a_413_that_says_the_limit(http):
    raw = '{"prompt": "' + "x" * 10_000_001 + '"}'
    assert "larger than 10 MB" in error_message("completions", post(http, "completions", raw), 413)


@pytest.mark.parametrize("coding", ["gzip", "zstd", "br"])
def test_a_compressed_body_is_a_415_that_says_so(http, coding):
    response = http.post("/v1/chat/completions", content=b"\x1f\x8b\x08\x00", headers={
        "content-type": "application/json", "content-encoding": coding})
    assert f"Content-Encoding {coding}" in error_message("chat", response, 415)


def test_a_path_the_router_reads_as_messages_answers_in_anthropics_shape(http):
    url = str(http.base_url).rstrip("/") + "//v1//messages"  # whole: a base URL would read //v1 as a host
    response = http.post(url, content=b"{}", headers={"content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["type"] == "error"


def test_a_backslash_then_the_text_ud800_is_no_surrogate(http):
    """A truncated body holding the text C:\\ud800\\dir (an escaped backslash, then ud800) was said to hold half
    a surrogate pair; what is wrong is that it ends too soon."""
    message = error_message("chat", post(http, "chat", '{"messages": [{"role": "user", "content": "C:\\\\ud800\\\\dir'))
    assert "ends in the middle of a value" in message and "surrogate" not in message, message


def test_a_byte_order_mark_is_named(http):
    raw = "\ufeff" + json.dumps(ROUTES["chat"][1])
    assert "byte order mark" in error_message("chat", post(http, "chat", raw))


@pytest.mark.parametrize("route", ["chat", "messages"])
def test_a_body_in_another_encoding_is_named_with_where_it_is_not_utf8(http, route):
    """A latin-1 body (charset=latin-1 declared) was "invalid UTF-8 encoded string" with no byte, and a
    UTF-16 one "invalid character (byte 0)": JSON over HTTP is UTF-8 whatever the charset says."""
    path, body, _ = ROUTES[route]
    text = json.dumps({**body, "metadata": {"note": "caf\u00e9"}}, ensure_ascii=False)
    latin = http.post(path, content=text.encode("latin-1"), headers={"content-type": "application/json; charset=latin-1"})
    message = error_message(route, latin)
    at = text.encode("latin-1").index(b"\xe9")
    assert f"byte {at} (0xE9) is not UTF-8" in message and "charset" in message, message
    for encoding in ("utf-16", "utf-16-le"):
        wide = http.post(path, content=json.dumps(body).encode(encoding), headers={"content-type": "application/json"})
        assert "UTF-16" in error_message(route, wide)

