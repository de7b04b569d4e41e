"""Agent tasks (/v1/tasks, Engine.task) with the official client, agentlin-client, strict,
against a real server on the embedded SmolLM2."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sqlite3
import threading
import time
from types import SimpleNamespace
from typing import Literal

import agentlin_client
import httpx
import jsonschema
import pytest
from server import frames, serve, undescribed

from mashbox.api.local_tasks import function_tool, prepare, run_async, run_sync
from mashbox.engine.events import (
    Finish,
    Queued,
    Started,
    TextDelta,
    Timings,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from mashbox.server.backend import InProcessBackend
from mashbox.server.settings import Settings
from mashbox.errors import EngineClosedError, InvalidRequestError, StorageError
from mashbox.server.errors import api_error
from mashbox.server import task_store
from mashbox.server.task_store import TaskStore

SHORT = {"max_tokens": 8, "stop": [" "], "temperature": 0}  # an answer that ends by itself, at its first space
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def backend(smol_engine):
    return InProcessBackend.of(smol_engine)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tasks") / "tasks.sqlite3")


@pytest.fixture(scope="module")
def url(backend, db):
    yield from serve(backend, Settings(tasks_db=db))


def client(url: str, key: str = "unused") -> agentlin_client.Client:
    return agentlin_client.Client(base_url=url + "/v1", api_key=key, _strict_response_validation=True, max_retries=0)


@pytest.fixture(scope="module")
def tasks(url):
    return client(url).tasks


def events_of(stream_response) -> list[dict]:
    """The envelopes of a streamed create, checked: JSON-RPC, numbered 1, 2, 3, ..., with agent_step."""
    body = "".join(stream_response.iter_text())
    out = []
    for name, data in frames(body):
        envelope = json.loads(data)
        assert envelope["jsonrpc"] == "2.0" and name == envelope["result"]["type"]
        out.append(envelope)
    results = [e["result"] for e in out]
    assert [r["sequence_number"] for r in results] == list(range(1, len(results) + 1))
    assert all(isinstance(r["agent_step"], int) and r["task_id"] == results[0]["task"]["id"] for r in results)
    return out


def test_create(tasks, caplog):
    with caplog.at_level(logging.INFO, logger="mashbox.server"):
        answer = tasks.create(stream=False, user_message_content="Name three planets.", request_id="req-7",
                              inference_args={"max_tokens": 200})
    assert answer.jsonrpc == "2.0" and answer.id == "req-7" and answer.error is None
    task = answer.result
    assert task.status == "completed" and task.object == "task" and task.id.startswith("task_")
    message = task.output[-1]
    assert message.type == "message" and message.message_content[0].text
    used = task.usage["output_tokens"]
    assert 0 < used < 200 and task.usage["total_tokens"] == task.usage["input_tokens"] + used
    assert message.status == "completed" and "incomplete_details" not in task.model_dump()  # ended by itself
    assert any(f"task {task.id} ended completed after" in r.getMessage() for r in caplog.records)  # as it began


def test_max_tokens_cuts_the_answer_short(tasks):
    """An answer cut by max_tokens is not a complete one: the task fails, its error says why and
    what to do, incomplete_details too, and what was produced stays in the output, incomplete."""
    task = tasks.create(stream=False, user_message_content="Name three planets.",
                        inference_args={"max_tokens": 6}).result
    assert task.status == "failed" and task.usage["output_tokens"] == 6
    assert task.error.code == -32011 and "max_tokens (6)" in task.error.message
    assert task.error.data == {"reason": "max_output_tokens", "max_tokens": 6}
    assert task.incomplete_details == {"reason": "max_output_tokens"} and task.output[-1].status == "incomplete"
    assert task.output[-1].message_content[0].text
    with tasks.with_streaming_response.create(stream=True, user_message_content="Name three planets.",
                                              inference_args={"max_tokens": 6}) as response:
        results = [e["result"] for e in events_of(response)]
    done = [r["item"] for r in results if r["type"] == "task.output_item.done"]
    assert [item["status"] for item in done] == ["incomplete"]
    assert results[-1]["type"] == "task.failed"
    assert results[-1]["task"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert results[-1]["task"]["error"]["code"] == -32011


def test_a_forced_call_cut_by_max_tokens_fails_the_task(tasks):
    """tool_choice required with too few tokens for the call: not `completed` with nothing in it."""
    task = tasks.create(stream=False, user_message_content="Weather in Paris?", client_tools=[WEATHER],
                        inference_args={"tool_choice": "required", "max_tokens": 12}).result
    assert task.status == "failed" and task.input_required is None and task.usage["output_tokens"] == 12
    assert task.error.code == -32011 and "raise max_tokens" in task.error.message


def test_a_client_tool_named_none_is_forced_by_name(tasks):
    none = {**WEATHER, "function": {**WEATHER["function"], "name": "none"}}
    task = tasks.create(stream=False, user_message_content="Weather in Paris?", client_tools=[none],
                        inference_args={"tool_choice": {"name": "none"}, "max_tokens": 40}).result
    assert task.status == "input-required" and task.input_required.name == "none"


def test_create_stream(tasks):
    with tasks.with_streaming_response.create(stream=True, user_message_content="Say hello.", request_id="req-s",
                                              inference_args={"max_tokens": 64, "temperature": 0}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        envelopes = events_of(response)
    assert {e["id"] for e in envelopes} == {"req-s"}
    results = [e["result"] for e in envelopes]
    # the spec's lifecycle events each carry the whole task, as it is at that event
    lifecycle = [r for r in results if "task" in r]
    assert [r["type"] for r in lifecycle] == ["task.created", "task.queued", "task.working", "task.completed"]
    assert [r["task"]["status"] for r in lifecycle] == ["created", "queued", "working", "completed"]
    assert lifecycle[0]["task"]["output"] == [] and lifecycle[-1]["task"]["output"]
    kinds = [r["type"] for r in results]
    assert kinds[:3] == ["task.created", "task.queued", "task.working"] and kinds[-1] == "task.completed"
    assert kinds[3:7] == ["task.output_item.added", "task.content_part.added", "task.output_text.delta",
                          "task.output_text.delta"]
    text = "".join(r["delta"] for r in results if r["type"] == "task.output_text.delta")
    final = results[-1]["task"]
    assert final["status"] == "completed" and final["output"][0]["message_content"][0]["text"] == text
    assert tasks.info(final["id"]).result.output[0].message_content[0].text == text


def test_the_clients_own_stream_path(url, tasks):
    """agentlin-client's create(stream=True) is no stream: it sends stream: true and reads the whole
    answer as JSON (it has no stream class for tasks). The server answers as the spec says, SSE, so
    the strict client refuses the content type and a lax one returns the SSE text, whole."""
    with pytest.raises(agentlin_client.APIResponseValidationError, match="text/event-stream"):
        tasks.create(stream=True, user_message_content="Hi.", inference_args=SHORT)
    lax = agentlin_client.Client(base_url=url + "/v1", api_key="unused", max_retries=0)
    text = lax.tasks.create(stream=True, user_message_content="Hi.", inference_args=SHORT)
    assert isinstance(text, str)
    names = [name for name, _ in frames(text)]
    assert names[0] == "task.created" and names[-1] == "task.completed"


def test_client_tool_then_continuation(tasks):
    first = tasks.create(stream=False, user_message_content="What is the weather in Paris?", client_tools=[WEATHER],
                         inference_args={"max_tokens": 40, "tool_choice": "required"}).result
    assert first.status == "input-required"
    call = first.input_required
    assert call.type == "tool_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    assert first.output[-1].call_id == call.call_id
    assert [c["call_id"] for c in first.input_required_calls] == [call.call_id]  # over HTTP: every call held
    history = [{"type": "message", "role": "user", "message_content": "What is the weather in Paris?"},
               call.model_dump(exclude_none=True),
               {"type": "tool_result", "call_id": call.call_id, "message_content": "Sunny, 21 C", "block_list": []}]
    second = tasks.create(stream=False, user_message_content="", history_messages=history, client_tools=[WEATHER],
                          inference_args={"max_tokens": 30}, extra_body={"previous_task_id": first.id}).result
    assert second.status == "completed" and second.previous_task_id == first.id
    assert second.output[-1].type == "message" and second.output[-1].message_content[0].text


def test_structured_output(tasks):
    task = tasks.create(stream=False, user_message_content="Describe a person.", structured_output=PERSON,
                        inference_args={"max_tokens": 80}).result
    assert task.status == "completed"
    jsonschema.validate(json.loads(task.output[-1].message_content[0].text), PERSON)


def test_a_schema_the_grammar_cannot_follow_mid_answer_fails_the_task_naming_it(tasks):
    """llguidance meets its limit only once the answer enters a choice of 3,000 objects: the task failed as
    an internal error (-32603), where its own schema was what could not be followed."""
    schema = {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(3000)]}},
        "required": ["v"]}
    task = tasks.create(stream=False, user_message_content="Go.", structured_output=schema,
                        inference_args={"max_tokens": 40}).result
    assert task.status == "failed" and task.error.code == -32602, task.error
    assert task.error.data == {"param": "structured_output"} and "cannot be enforced" in task.error.message


def _streamed(url: str, body: dict, on_event, timeout: float = 120) -> list[dict]:
    """Stream a create in raw HTTP, calling ``on_event(result)`` for each event as it comes."""
    out = []
    with httpx.stream("POST", url + "/v1/tasks", json={"stream": True, **body}, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(result := json.loads(line[6:])["result"])
                on_event(result)
    return out


def test_cancel_mid_stream(url, tasks, smol_engine):
    def on_event(result):
        if result["type"] == "task.output_text.delta" and result["sequence_number"] == 7:
            assert tasks.cancel(result["task_id"]).status == "canceled"

    results = _streamed(url, {"user_message_content": "Tell a long story.", "inference_args": {"max_tokens": 500}},
                        on_event)
    assert results[-1]["type"] == "task.canceled"
    task = tasks.info(results[-1]["task_id"]).result
    assert task.status == "canceled" and task.output[0].status == "incomplete"
    assert len(task.output[0].message_content[0].text) < 500 * 4
    deltas = sum(r["type"] == "task.output_text.delta" for r in results)
    assert task.usage["input_tokens"] > 10 and deltas <= task.usage["output_tokens"] < 500  # what it used
    assert results[-1]["task"]["usage"] == task.usage
    _until(lambda: smol_engine.stats().running == 0)  # its slot is free


def test_line_separators_in_a_streamed_event_are_escaped_for_line_readers(url):
    """U+2028, U+2029 and U+0085 went out raw in data lines: the docs' reader (httpx's iter_lines, which
    splits as str.splitlines does) got each such event cut in two, neither half JSON."""
    note = "a\u2028b\u2029c\x85d"
    results = _streamed(url, {"user_message_content": "Hi.", "inference_args": SHORT, "metadata": {"note": note}},
                        lambda result: None)
    assert results[0]["type"] == "task.created" and results[0]["task"]["metadata"] == {"note": note}
    assert results[-1]["type"] in ("task.completed", "task.failed")


def test_a_cancel_with_no_body_and_no_headers_is_taken(url, tasks):
    """``POST /v1/tasks/{id}/cancel`` as a bare HTTP/1.1 request (no Content-Type, no
    Content-Length): the running task is canceled, with the tokens it used."""
    task = tasks.create(stream=False, user_message_content="Tell a long story.", extra_body={"background": True},
                        inference_args={"max_tokens": 400}).result
    host = url.removeprefix("http://")
    with socket.create_connection(tuple(host.split(":"))) as sock:
        sock.sendall(f"POST /v1/tasks/{task.id}/cancel HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 "), answer
    result = json.loads(body)["result"]
    assert result["status"] == "canceled" and result["usage"]["input_tokens"] > 5


@pytest.mark.parametrize(("body", "content_type", "status", "code"), [
    (b"{bad", "application/json", 400, -32700), (b"", "application/json", 400, -32700),  # JSON-RPC's parse error
    (b"[1]", "application/json", 400, -32602), (b"{}", "text/plain", 415, -32600)])
def test_a_body_that_does_not_parse_is_jsonrpcs_parse_error(url, body, content_type, status, code):
    """It was -32602 (invalid params), and -32700 went to a body of another content type."""
    answer = httpx.post(url + "/v1/tasks", content=body, headers={"content-type": content_type})
    assert answer.status_code == status and answer.json()["error"]["code"] == code, answer.text


def test_an_action_answer_fits_the_document(url, tasks):
    """A cancel's answer holds the task's fields beside the envelope's: the document said an envelope of
    no other fields."""
    task = tasks.create(stream=False, user_message_content="Tell a long story.", extra_body={"background": True},
                        inference_args={"max_tokens": 400}).result
    answer = httpx.post(url + f"/v1/tasks/{task.id}/cancel", timeout=60)
    assert answer.status_code == 200 and answer.json()["status"] == "canceled", answer.text
    doc = httpx.get(url + "/openapi.json").json()
    assert not undescribed(doc, "/v1/tasks/{task_id}/cancel", "post", answer)


def test_pause_and_resume(url, tasks, smol_engine):
    seen = []

    def on_event(result):
        seen.append(result["type"])
        if result["type"] == "task.output_text.delta" and seen.count("task.output_text.delta") == 2:
            paused = tasks.pause(result["task_id"])
            assert paused.status == "paused" and tasks.info(result["task_id"]).result.status == "paused"
            _until(lambda: smol_engine.stats().running == 0)  # a paused task holds no slot
            threading.Timer(0.5, lambda: tasks.resume(result["task_id"])).start()

    results = _streamed(url, {"user_message_content": "Count to ten.", "inference_args": {"max_tokens": 16}},
                        on_event)
    kinds = [r["type"] for r in results]
    assert kinds.index("task.paused") < kinds.index("task.working", 3) and kinds[-1] == "task.failed"
    final = results[-1]["task"]
    # the paused step's item stays incomplete; the step ran again as a new item, cut by max_tokens this time
    assert [item["status"] for item in final["output"]] == ["incomplete", "incomplete"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"} and final["usage"]["steps"] == 1


def test_list_retrieve_delete(tasks):
    made = [tasks.create(stream=False, user_message_content=f"Hi, {name}.", session_id="list-test",
                         inference_args=SHORT).result.id for name in ("Ann", "Bo", "Cy")]
    page = tasks.list(limit=2, session_id="list-test")
    assert [t.id for t in page.result] == made[::-1][:2]
    assert [t.id for t in page] == made[::-1]  # the client pages on with starting_after
    assert [t.id for t in tasks.list(status=["completed"], session_id="list-test")] == made[::-1]
    assert tasks.info(made[0]).result.id == made[0]
    assert tasks.delete(made[0]).result.id == made[0]
    with pytest.raises(agentlin_client.NotFoundError):
        tasks.info(made[0])
    for cursor in ("starting_after", "ending_before"):  # a cursor deleted (or expired) since: said, not guessed
        with pytest.raises(agentlin_client.BadRequestError, match=f"no task .*'param': '{cursor}'"):
            tasks.list(session_id="list-test", **{cursor: made[0]})
    assert [t.id for t in tasks.list(session_id="list-test", ending_before=made[2])] == [] and \
        [t.id for t in tasks.list(session_id="list-test", ending_before=made[1])] == [made[2]]


def test_restart(backend, tmp_path):
    db = str(tmp_path / "tasks.sqlite3")
    for url in serve(backend, Settings(tasks_db=db)):  # a server that stops, then another on its file
        done = client(url).tasks.create(stream=False, user_message_content="Hi.",
                                        inference_args={"max_tokens": 3}).result
    with sqlite3.connect(db) as conn:  # a task that was running when its server stopped
        conn.execute("INSERT INTO tasks (tenant, id, status, session_id, user_id, updated_at, body) VALUES "
                     "('default', 'task_running', 'working', '', '', 1e12, ?)",
                     (json.dumps({**done.model_dump(), "id": "task_running", "status": "working"}),))
    for url in serve(backend, Settings(tasks_db=db)):
        again = client(url).tasks
        assert again.info(done.id).result.output[0].message_content[0].text == \
            done.output[0].message_content[0].text
        stopped = again.info("task_running").result
        assert stopped.status == "failed" and "stopped" in stopped.error.message


def test_bad_input(url, tasks):
    raw = tasks.with_raw_response.create(stream=False, user_message_content="Hi.", inference_args=SHORT,
                                         extra_body={"frobnicate": 1})
    assert raw.headers["x-mashbox-ignored-fields"] == "frobnicate" and raw.parse().result.status == "completed"
    for n, (body, param) in enumerate([
            ({"inference_args": {"temperature": "hot"}}, "inference_args.temperature"),
            ({"inference_args": {"max_tokens": 0}}, "inference_args.max_tokens"),
            ({"inference_args": {"logprobs": True}}, "inference_args.logprobs"),  # refused as on the other routes
            ({"inference_args": {"top_logprobs": 5}}, "inference_args.top_logprobs"),
            ({"client_tools": [{"type": "function"}]}, "client_tools.0.function"),
            ({"client_tools": [WEATHER, WEATHER]}, "client_tools.1.function.name"),  # a call could not say which
            ({"structured_output": PERSON, "stream": True}, "structured_output"),
            ({"structured_output": {"type": "json_schema"}}, "structured_output"),  # no schema: not "any JSON"
            ({"structured_output": {"type": "json_schema", "json_schema": {"name": "x"}}}, "structured_output"),
            ({"client_tools": [WEATHER], "inference_args": {"tool_choice": {"name": "nope"}}},
             "inference_args.tool_choice"),
            ({"inference_args": {"tool_choice": "required"}}, "inference_args.tool_choice"),  # no tool to call
            # a stop string cut the JSON short, yet the task "completed"; a forced call was dropped unsaid
            ({"structured_output": PERSON, "inference_args": {"stop": ["}"]}}, "inference_args.stop"),
            ({"structured_output": PERSON, "client_tools": [WEATHER], "inference_args": {"tool_choice": "required"}},
             "inference_args.tool_choice"),
            ({"history_messages": [{"type": "bogus"}]}, "history_messages.0.type"),
            # kept with the task for a day and sent back by every list: 9 MB each filled the disk, a list took GBs
            ({"metadata": {"k": "x" * 20_000}}, "metadata"), ({"session_id": "s" * 2_000}, "session_id"),
            ({"user_id": "u" * 2_000}, "user_id"),
            ({"stream": "yes"}, "stream"), ({"stream": None}, "stream")]):
        response = httpx.post(url + "/v1/tasks", json={"user_message_content": "Hi.", "stream": False,
                                                       "task_id": f"bad-{n}", **body})
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["jsonrpc"] == "2.0" and error["error"]["code"] == -32602
        assert error["error"]["data"]["param"] == param
        with pytest.raises(agentlin_client.NotFoundError):  # a bad request leaves no task
            tasks.info(f"bad-{n}")
    with pytest.raises(agentlin_client.BadRequestError):
        tasks.create(stream=False, user_message_content="Hi.", inference_args={"max_tokens": 0})
    with pytest.raises(agentlin_client.NotFoundError):
        tasks.cancel("task_nope")
    done = raw.parse().result.id
    for response in (httpx.post(url + f"/v1/tasks/{done}/pause"),  # a completed task cannot be paused
                     httpx.post(url + "/v1/tasks", json={"user_message_content": "Hi.", "stream": False,
                                                         "task_id": done})):
        assert response.status_code == 409 and response.json()["error"]["code"] == -32009, response.text
        assert response.json()["error"]["data"]["param"] == "task_id"
        assert response.headers["x-should-retry"] == "false"  # the SDK sent each 409 three times
    sent = []
    retrying = agentlin_client.Client(base_url=url + "/v1", api_key="unused", max_retries=2, http_client=httpx.Client(
        event_hooks={"request": [sent.append]}))
    with pytest.raises(agentlin_client.ConflictError):
        retrying.tasks.pause(done)
    assert len(sent) == 1, sent
    assert tasks.info(done).result.status == "completed"
    missing = httpx.post(url + "/v1/tasks", json={"user_message_content": "Hi."})  # the spec requires stream
    assert missing.status_code == 400 and missing.json()["error"]["data"]["param"] == "stream", missing.text


def test_tenants(backend, tmp_path):
    keys = {"key-a": "alice", "key-b": "bob"}
    for url in serve(backend, Settings(tasks_db=str(tmp_path / "t.sqlite3"), api_keys=keys)):
        alice, bob = client(url, "key-a").tasks, client(url, "key-b").tasks
        task = alice.create(stream=False, user_message_content="Hi.", inference_args={"max_tokens": 2}).result
        assert [t.id for t in alice.list()] == [task.id] and list(bob.list()) == []
        with pytest.raises(agentlin_client.NotFoundError):
            bob.info(task.id)
        with pytest.raises(agentlin_client.AuthenticationError):
            client(url, "wrong").tasks.list()


def test_engine_task(smol_engine):
    calls = []

    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"Sunny in {city}"

    task = smol_engine.task(user_message_content="What is the weather in Paris?", client_tools=[get_weather],
                            inference_args={"max_tokens": 40, "tool_choice": "required"}, max_steps=3)
    assert calls and [o.type for o in task.output[:2]] == ["tool_call", "tool_result"]
    assert task.output[1].message_content[0].text == f"Sunny in {calls[0]}"
    assert task.status == "completed" and task.usage["steps"] >= 2
    events = list(smol_engine.task(user_message_content="Hi.", stream=True, inference_args=SHORT))
    assert events[0].type == "task.created" and events[-1].type == "task.completed"
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(InvalidRequestError, match="get_weather") as refused:  # the dict's or the function's?
        smol_engine.task(user_message_content="Hi.", client_tools=[weather, get_weather], inference_args=SHORT)
    assert refused.value.param == "client_tools"


def test_store_expires_unfinished_and_deletes_finished(tmp_path):
    now = [1000.0]
    store = TaskStore(tmp_path / "t.sqlite3", ttl_s=60, clock=lambda: now[0])
    for task_id, status in [("waiting", "input-required"), ("done", "completed"), ("running", "working")]:
        store.save("t", {"object": "task", "id": task_id, "status": status, "created_at": 1, "output": []})
    now[0] += 59
    assert store.sweep(set()) == [] and store.get("t", "done")["status"] == "completed"
    now[0] += 2
    assert store.sweep({("t", "running")}) == [("t", "running")]  # a live one is its run's to expire
    waiting = store.get("t", "waiting")
    assert waiting["status"] == "expired" and waiting["error"]["code"] == -32002
    assert store.get("t", "done") is None and store.get("t", "running")["status"] == "working"
    now[0] += 61
    store.sweep(set())
    assert store.get("t", "waiting") is None  # expired is final: deleted a time to live later


def test_a_second_server_on_the_same_file_leaves_the_firsts_running_tasks_alone(tmp_path):
    """Two servers (two models, say) share the default file: the second's first open failed every task the
    first was running. Tasks left running by servers that stopped still fail at the next open."""
    first, second = (TaskStore(tmp_path / "t.sqlite3", ttl_s=60) for _ in range(2))
    running = {"object": "task", "id": "job", "status": "working", "created_at": 1, "output": []}
    first.save("t", running)
    assert second.get("t", "job")["status"] == "working"
    first.close(), second.close()
    third = TaskStore(tmp_path / "t.sqlite3", ttl_s=60)
    assert third.get("t", "job")["status"] == "failed"
    third.close()


def test_a_tasks_file_that_cannot_be_opened_is_said(tmp_path):
    """A cache folder that is a file, a read-only one, a database that is none: every /v1/tasks call was a
    500 "internal error: OperationalError"; now its message names the file and what to do."""
    (tmp_path / "cache").write_text("a file where the folder should be")
    store = TaskStore(tmp_path / "cache" / "tasks.sqlite3", ttl_s=60)
    with pytest.raises(StorageError) as failed:
        store.get("t", "job")
    error = api_error(failed.value, 1)
    assert error.status == 500 and str(tmp_path / "cache" / "tasks.sqlite3") in error.message
    assert "--tasks-db" in error.message


class FullDisk(TaskStore):
    """A tasks file on a disk that filled up: it opens and reads, every write fails as SQLite says it."""

    def _conn(self):
        db = super()._conn()

        def execute(sql, *args):
            if sql.lstrip().startswith("INSERT"):
                raise sqlite3.OperationalError("database or disk is full")
            return db.execute(sql, *args)

        return SimpleNamespace(execute=execute)


def _refused(url: str, task_id: str, max_tokens: int) -> str:
    """Create a task the server cannot keep: its 500's message."""
    answer = httpx.post(url + "/v1/tasks", json={"user_message_content": "Hi.", "stream": False, "task_id": task_id,
                                                 "inference_args": {"max_tokens": max_tokens}}, timeout=60)
    assert answer.status_code == 500, answer.text
    return answer.json()["error"]["message"]


def test_a_task_that_cannot_be_kept_is_not_handed_out(backend, tmp_path, monkeypatch):
    """On a full disk every create answered 200 with a task id that every later look then said was no task
    (the save's failure only logged, with no file named)."""
    monkeypatch.setattr("mashbox.server.context.TaskStore", FullDisk)
    db = tmp_path / "t.sqlite3"
    for url in serve(backend, Settings(tasks_db=str(db))):
        message = _refused(url, "kept", 2)
        assert str(db) in message and "--tasks-db" in message and "disk is full" in message
        assert httpx.get(url + "/v1/tasks/kept", timeout=60).status_code == 404
        assert httpx.get(url + "/health", timeout=60).json()["status"] == "ok"


class FirstSaveLocked(TaskStore):
    """A tasks file locked by another program for the first save only (SQLite waits, then gives up)."""

    def save(self, tenant, task):
        if not getattr(self, "tried", False):
            self.tried = True
            time.sleep(3)  # meanwhile the task runs to its end, and its later saves queue behind this one
            raise StorageError(f"saving task {task['id']} in {self.path} failed (database is locked)")
        super().save(tenant, task)


def test_a_task_whose_create_was_refused_never_appears(backend, tmp_path, monkeypatch):
    """The create answered 500 "try again", yet the task ran on and its later saves put it in the file: a
    client that tried again ran it twice."""
    monkeypatch.setattr("mashbox.server.context.TaskStore", FirstSaveLocked)
    db = tmp_path / "t.sqlite3"
    for url in serve(backend, Settings(tasks_db=str(db))):
        assert "database is locked" in _refused(url, "once", 8)
        for _ in range(100):  # until its run, canceled, has ended here
            if httpx.get(url + "/v1/tasks/once", timeout=60).status_code == 404:
                break
            time.sleep(0.1)
        time.sleep(0.5)  # any save it queued has run
        assert httpx.get(url + "/v1/tasks/once", timeout=60).status_code == 404
        with sqlite3.connect(db) as file:
            assert file.execute("SELECT count(*) FROM tasks WHERE id='once'").fetchone() == (0,)


def test_a_delete_whose_task_ends_before_its_cancel_deletes_it(backend, tmp_path, monkeypatch):
    """A DELETE found the task running and asked it to cancel, but it had ended meanwhile: the DELETE was a
    409 ("the task is canceled: only a task that is ... can be canceled") and the task stayed."""
    from mashbox.server.task_runs import TaskRuns

    act = TaskRuns.act

    async def late(self, tenant, task_id, action):  # the task ends between the DELETE's look and its cancel
        live = self._live.get((tenant, task_id))
        while live is not None and not live.finished:
            await live.changed(1)
        return await act(self, tenant, task_id, action)

    monkeypatch.setattr(TaskRuns, "act", late)
    for url in serve(backend, Settings(tasks_db=str(tmp_path / "t.sqlite3"))):
        body = {"user_message_content": "Hi.", "stream": False, "task_id": "ending", "background": True,
                "inference_args": {"max_tokens": 20}}
        assert httpx.post(url + "/v1/tasks", json=body, timeout=60).status_code == 200
        deleted = httpx.delete(url + "/v1/tasks/ending", timeout=60)
        assert deleted.status_code == 200 and deleted.json()["result"]["id"] == "ending", deleted.text
        assert httpx.get(url + "/v1/tasks/ending", timeout=60).status_code == 404


class EndsUnsaved(TaskStore):
    """A tasks file that another program holds locked just as a task ends: that save fails."""

    locked = True

    def save(self, tenant, task):
        if self.locked and task["status"] in ("completed", "failed"):
            raise StorageError(f"saving task {task['id']} in {self.path} failed (database is locked)")
        super().save(tenant, task)


def test_a_task_whose_end_the_file_did_not_take_is_still_seen_ended_and_saved_later(backend, tmp_path, monkeypatch):
    """The last save failed: the file kept the task `working` with no output for good, and every look
    said so (a cancel then answered 409 "the task is working: only a task that is ... working can be ...")."""
    monkeypatch.setattr("mashbox.server.context.TaskStore", EndsUnsaved)
    monkeypatch.setattr(EndsUnsaved, "locked", True)
    db = tmp_path / "t.sqlite3"
    for url in serve(backend, Settings(tasks_db=str(db))):
        body = {"user_message_content": "Hi.", "stream": False, "task_id": "ends", "inference_args": {"max_tokens": 2}}
        ended = httpx.post(url + "/v1/tasks", json=body, timeout=60).json()["result"]["status"]  # cut: failed
        seen = httpx.get(url + "/v1/tasks/ends", timeout=60).json()["result"]
        assert seen["status"] == ended in ("completed", "failed") and seen["output"]
        with sqlite3.connect(db) as file:
            assert file.execute("SELECT status FROM tasks WHERE id='ends'").fetchone() == ("working",)
        EndsUnsaved.locked = False  # the lock let go: the next look saves it
        assert httpx.get(url + "/v1/tasks", timeout=60).json()["result"][0]["status"] == ended
        with sqlite3.connect(db) as file:
            assert file.execute("SELECT status FROM tasks WHERE id='ends'").fetchone() == (ended,)


def test_a_task_another_server_runs_is_not_canceled_here_and_says_so(backend, tmp_path):
    """Two servers sharing a tasks file: the other's cancel answered "the task is working: only a task that
    is ... working can be canceled". A DELETE removes it (its server may have died while it ran)."""
    db = tmp_path / "t.sqlite3"
    elsewhere = TaskStore(db, ttl_s=3600)  # the other server, holding the file's lock as it runs
    elsewhere.save("default", {"id": "theirs", "object": "task", "status": "working", "created_at": 1, "output": []})
    for url in serve(backend, Settings(tasks_db=str(db))):
        answer = httpx.post(url + "/v1/tasks/theirs/cancel", timeout=60)
        assert answer.status_code == 409, answer.text
        assert "not on this server: another server sharing this tasks file runs it" in answer.json()["error"]["message"]
        assert httpx.get(url + "/v1/tasks/theirs", timeout=60).json()["result"]["status"] == "working"
        assert httpx.delete(url + "/v1/tasks/theirs", timeout=60).status_code == 200
        assert httpx.get(url + "/v1/tasks/theirs", timeout=60).status_code == 404
    elsewhere.close()


def test_a_tasks_file_deleted_while_the_server_runs_is_made_again_with_its_tasks(backend, tmp_path):
    """A cache cleared under a running server (``rm ~/.cache/mashbox/tasks.sqlite3``): SQLite refuses every write
    to a file deleted under it, so each task after that was a 500 until a restart. The file is made again where
    it was, with the tasks it held (read from the file still open), and new ones are kept."""
    db = tmp_path / "cache" / "t.sqlite3"
    ask = {"user_message_content": "Hi.", "stream": False, "inference_args": {"max_tokens": 3}}  # cut: failed
    for url in serve(backend, Settings(tasks_db=str(db))):
        before = httpx.post(url + "/v1/tasks", json={**ask, "task_id": "before"}, timeout=60)
        assert before.json()["result"]["error"]["code"] == -32011, before.text
        db.unlink()
        answer = httpx.post(url + "/v1/tasks", json={**ask, "task_id": "after"}, timeout=60)
        assert answer.status_code == 200 and answer.json()["result"]["error"]["code"] == -32011, answer.text
        listed = httpx.get(url + "/v1/tasks", timeout=60).json()["result"]
        assert [t["id"] for t in listed] == ["after", "before"]
        with sqlite3.connect(db) as file:
            assert sorted(file.execute("SELECT id, status FROM tasks")) == [("after", "failed"), ("before", "failed")]


def test_a_tasks_file_moved_away_is_made_again_and_one_put_in_its_place_is_used(tmp_path):
    """Where no file can be made there yet (no folder, a file that is no database in its place) the calls fail
    naming the file, and the tasks stay held by the old file, still open, until one can: they were lost."""
    path = tmp_path / "tasks" / "t.sqlite3"
    store = TaskStore(path, ttl_s=60)
    store.save("t", {"id": "kept", "status": "working"})
    path.rename(tmp_path / "elsewhere.sqlite3")
    shutil.rmtree(path.parent)
    path.parent.write_text("a file where the folder was")
    with pytest.raises(StorageError, match="cannot be kept in"):
        store.get("t", "kept")
    path.parent.unlink()
    path.parent.mkdir()
    path.write_text("no database" * 100)
    for _ in range(2):
        with pytest.raises(StorageError, match="cannot be kept in"):
            store.save("t", {"id": "new", "status": "working"})
    path.unlink()
    store.save("t", {"id": "new", "status": "working"})
    assert store.get("t", "kept")["status"] == "working", "a task running here is not failed on the new file"
    other = TaskStore(tmp_path / "other.sqlite3", ttl_s=60)
    other.save("t", {"id": "theirs", "status": "completed"})
    other.close()
    (tmp_path / "other.sqlite3").replace(path)
    assert store.get("t", "theirs") == {"id": "theirs", "status": "completed"}
    assert store.get("t", "kept") is None, "a file put in its place is used as it is"
    store.save("t", {"id": "more", "status": "completed"})
    store.close()
    with sqlite3.connect(path) as file:
        assert sorted(file.execute("SELECT id FROM tasks")) == [("more",), ("theirs",)]


def test_a_tasks_file_overwritten_while_in_use_is_said(tmp_path):
    """A read of a file that is no longer a database was a 500 "internal error: DatabaseError"."""
    path = tmp_path / "tasks.sqlite3"
    store = TaskStore(path, ttl_s=60)
    store.save("t", {"id": "job", "status": "completed"})
    with path.open("r+b") as file:
        file.write(b"not a database at all" * 8)
    with pytest.raises(StorageError) as failed:
        store.get("t", "job")
    assert str(path) in str(failed.value) and "reading task job" in str(failed.value)
    store.close()


def test_expiry_needs_no_request(backend, tmp_path):
    """A task left paused expires on the server's own timer: its stream, which asks nothing, ends
    with task.expired; a finished task is deleted from the file a time to live later."""
    db = tmp_path / "t.sqlite3"
    for url in serve(backend, Settings(tasks_db=str(db), tasks_ttl_s=1.0, keepalive_s=60)):
        tasks, started = client(url).tasks, time.monotonic()
        results = _streamed(url, {"user_message_content": "Count to ten.", "inference_args": {"max_tokens": 64}},
                            _pause_at_second_delta(tasks), timeout=15)
        assert [r["type"] for r in results[-2:]] == ["task.paused", "task.expired"]
        expired = results[-1]["task"]
        assert expired["status"] == "expired" and expired["error"]["code"] == -32002
        assert expired["output"][0]["status"] == "incomplete" and time.monotonic() - started >= 1.0
        done = tasks.create(stream=False, user_message_content="Hi.", inference_args={"max_tokens": 2}).result.id
        deadline = time.monotonic() + 10
        while _row(db, done) is not None:
            assert time.monotonic() < deadline, "the finished task was not deleted"
            time.sleep(0.1)


def _pause_at_second_delta(tasks):
    deltas = []

    def on_event(result):
        if result["type"] == "task.output_text.delta" and len(deltas) < 2:
            deltas.append(result)
            if len(deltas) == 2:
                assert tasks.pause(result["task_id"]).status == "paused"

    return on_event


def _row(db, task_id: str):
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT status FROM tasks WHERE id=?", (task_id,)).fetchone()


@pytest.mark.parametrize(("background", "final"), [(False, "canceled"), (True, "failed")])
def test_a_client_gone_cancels_its_task_unless_background(url, tasks, background, final):
    body = {"stream": True, "background": background, "user_message_content": "Tell a long story.",
            "inference_args": {"max_tokens": 96, "temperature": 0}}
    with httpx.stream("POST", url + "/v1/tasks", json=body, timeout=60) as response:
        for line in response.iter_lines():
            result = json.loads(line[6:])["result"] if line.startswith("data: ") else {}
            if result.get("type") == "task.output_text.delta":
                task_id = result["task_id"]
                break  # and hang up
    task = _until_final(tasks, task_id)
    assert task.status == final
    if background:  # it ran with nobody listening until max_tokens cut it (so: failed, its text kept)
        assert task.usage["output_tokens"] == 96 and task.output[0].message_content[0].text
        assert task.error.code == -32011
    else:
        assert task.output[0].status == "incomplete"  # stopped mid-generation


def test_background_create_answers_at_once(tasks):
    first = tasks.create(stream=False, user_message_content="Tell a long story.", extra_body={"background": True},
                         inference_args={"max_tokens": 48}).result
    assert first.status in ("queued", "working")  # not waited for (on a busy machine it may have begun to write)
    assert all(item.status == "in_progress" for item in first.output)
    task = _until_final(tasks, first.id)  # cut by max_tokens: failed, with what it wrote
    assert task.status == "failed" and task.output[0].message_content[0].text and task.error.code == -32011


def _until(condition, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _until_final(tasks, task_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while (task := tasks.info(task_id).result).status not in ("completed", "canceled", "failed", "expired"):
        assert time.monotonic() < deadline, task.status
        time.sleep(0.05)
    return task


class Gated:
    """The backend whose runs wait for ``release`` before the engine sees them, as behind slots all
    taken (it says it has none free): tasks queue."""

    def __init__(self, inner: InProcessBackend) -> None:
        self.inner, self.release = inner, threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def info(self):
        return dataclasses.replace(self.inner.info, slots=0)

    async def astream(self, request):
        while not self.release.is_set():
            await asyncio.sleep(0.02)
        async for event in self.inner.astream(request):
            yield event


def test_a_full_queue_refuses_tasks_with_429(backend, tmp_path):
    gated = Gated(backend)
    settings = Settings(tasks_db=str(tmp_path / "t.sqlite3"), max_waiting_per_tenant=1, max_waiting=1)
    for url in serve(gated, settings):
        tasks, body = client(url).tasks, {"stream": False, "user_message_content": "Hi.", "inference_args": SHORT}
        waiting = threading.Thread(target=tasks.create, kwargs=body)
        waiting.start()
        deadline = time.monotonic() + 20
        while httpx.get(url + "/v1/health").json()["waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(url + "/v1/tasks", json={**body, "request_id": "r-9"})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        error = refused.json()
        assert error["jsonrpc"] == "2.0" and error["id"] == "r-9"  # the create's request_id
        assert error["error"]["code"] == -32029 and error["error"]["data"]["type"] == "rate_limit_error"
        with pytest.raises(agentlin_client.RateLimitError):
            tasks.create(**body)
        chat = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=chat).status_code == 429  # the same allowance
        gated.release.set()
        waiting.join(30)
        assert [t.status for t in tasks.list()] == ["completed"]  # the refused left no task


def scripted(*steps):
    """A stand-in for the engine's ``astream`` that answers each generation with the next step's
    events: (name, arguments) tool calls, then a Finish with ``reason``."""
    answers = iter(steps)

    async def generate(request):
        calls, reason = next(answers)
        yield Queued(10)
        yield Started(0)
        for index, (name, arguments) in enumerate(calls):
            yield ToolCallStart(index, f"call_{index}", name)
            yield ToolCallDelta(index, arguments)
            if reason not in ("length", "error") or index < len(calls) - 1:
                yield ToolCallEnd(index)
        yield Finish(reason, Usage(10, 8), Timings(10, 1.0, 8, 1.0, 0, 0.0))

    return generate


def test_every_client_call_of_a_step_waits_for_the_client():
    """Two client calls and a server tool in one step: the server's runs, the task stops
    input-required on the first client call, holding both (``input_required_calls``), and both
    client calls are in the output unanswered."""
    def get_time() -> str:
        return "12:00"

    generate = scripted(([("get_weather", '{"city": "Paris"}'), ("get_time", "{}"),
                          ("get_weather", '{"city": "Rome"}')], "tool_calls"))
    task = asyncio.run(run_async(prepare({"user_message_content": "Weather and time?", "client_tools": [WEATHER, get_time]},
                                 generate)))
    assert task.status == "input-required" and task.input_required.call_id == "call_0"
    assert [(c.call_id, c.name) for c in task.input_required_calls] == [("call_0", "get_weather"),
                                                                        ("call_2", "get_weather")]
    assert [(o.type, o.call_id) for o in task.output] == [("tool_call", "call_0"), ("tool_call", "call_1"),
                                                          ("tool_call", "call_2"), ("tool_result", "call_1")]
    assert task.output[3].message_content[0].text == "12:00"


def test_a_stop_tool_beside_client_calls_leaves_them_the_clients():
    """A stop tool called in the step that calls client tools ends the loop, but not as completed with the
    client's calls unanswered in the output: input-required, every client call held; no server tool after
    the stop runs."""
    ran = []

    def get_time() -> str:
        ran.append("get_time")
        return "12:00"

    generate = scripted(([("get_weather", '{"city": "Paris"}'), ("done", "{}"), ("get_time", "{}"),
                          ("get_weather", '{"city": "Rome"}')], "tool_calls"))
    fields = {"user_message_content": "Weather?", "client_tools": [WEATHER, get_time], "stop_tools": ["done"]}
    task = asyncio.run(run_async(prepare(fields, generate)))
    assert task.status == "input-required" and not ran
    assert [c.call_id for c in task.input_required_calls] == ["call_0", "call_3"]
    alone = asyncio.run(run_async(prepare(fields, scripted(([("done", "{}"), ("get_time", "{}")], "tool_calls")))))
    assert alone.status == "completed" and not ran


def test_many_tasks_in_a_row_each_end_cleanly(tiny_engine):
    """Engine.task runs its loop on a thread of its own: a loop that ends on its own is not cancelled as
    it closes (that raised "Event loop is closed" now and then, once in a CI run)."""
    for _ in range(500):  # each cut at its 2 tokens (failed, saying so), none raising
        task = tiny_engine.task(user_message_content="hi", inference_args={"max_tokens": 2})
        assert task.status == "failed" and task.error.data["reason"] == "max_output_tokens"


def test_a_python_tools_parameters_are_described_from_their_annotations_even_written_as_strings():
    """``from __future__ import annotations`` (as in this module, or a notebook cell under it) leaves
    annotations as strings: they are resolved, and typed as pydantic types them; the starred parameters
    are no arguments."""
    def add(a: int, b: float, *rest, tags: list[str] | None = None, mode: Literal["x", "y"] = "x",
            **more) -> float:
        """Add two numbers."""
        return a + b

    tool = function_tool(add)
    assert tool.tool.description == "Add two numbers."
    assert tool.tool.parameters == {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "number"},
        "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "mode": {"enum": ["x", "y"], "type": "string"}}}
    assert tool.run({"a": 2, "b": 0.5, "other": 1}) == 2.5
    assert function_tool(lambda city: city).tool.parameters["properties"] == {"city": {}}


def test_a_call_cut_by_max_tokens_never_runs():
    generate = scripted(([("get_weather", '{"city": "Par')], "length"))
    task = asyncio.run(run_async(prepare({"user_message_content": "Weather?", "client_tools": [WEATHER]}, generate)))
    assert task.status == "failed" and task.input_required is None and "a call of get_weather" in task.error.message
    assert task.incomplete_details.reason == "max_output_tokens" and task.output[0].status == "incomplete"
    # a whole call before the cut one still counts: the task waits for it alone
    generate = scripted(([("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Ro')], "length"))
    task = asyncio.run(run_async(prepare({"user_message_content": "Weather?", "client_tools": [WEATHER]}, generate)))
    assert task.status == "input-required" and task.input_required.call_id == "call_0"
    assert [o.status for o in task.output] == ["completed", "incomplete"] and task.incomplete_details is None


def test_a_call_cut_by_a_failure_stays_incomplete_and_never_runs():
    generate = scripted(([("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Ro')], "error"))
    task = asyncio.run(run_async(prepare({"user_message_content": "Weather?", "client_tools": [WEATHER]}, generate)))
    assert task.status == "failed" and task.input_required is None
    assert [o.status for o in task.output] == ["completed", "incomplete"]


class Stalled(Gated):
    """The backend whose generations stop after their first text, and never end (a wedged run)."""

    async def astream(self, request):
        async for event in self.inner.astream(request):
            yield event
            if isinstance(event, TextDelta):
                await asyncio.sleep(3600)


def test_a_working_task_with_no_event_for_its_time_to_live_expires(backend, tmp_path):
    """Not only paused tasks: a task still working whose generation gives nothing for the time to
    live expires on the server's timer, with what it wrote kept (incomplete), and frees its slot."""
    db = tmp_path / "t.sqlite3"
    for url in serve(Stalled(backend), Settings(tasks_db=str(db), tasks_ttl_s=1.0, keepalive_s=60)):
        tasks = client(url).tasks
        first = tasks.create(stream=False, user_message_content="Count to ten.", extra_body={"background": True},
                             inference_args={"max_tokens": 64}).result
        deadline = time.monotonic() + 15
        while _row(db, first.id) != ("expired",):  # the file, not the API: no request sweeps for it
            assert time.monotonic() < deadline, _row(db, first.id)
            time.sleep(0.05)
        task = tasks.info(first.id).result
        assert task.status == "expired" and task.error.code == -32002 and "no event" in task.error.message
        assert task.output[0].status == "incomplete" and task.output[0].message_content[0].text
        _until(lambda: backend.stats().running == 0)


def test_the_task_file_is_used_off_the_event_loop(backend, tmp_path, monkeypatch):
    """Every SQLite call of the task store runs on its own thread, never on the server's event loop."""
    threads = []
    for name in ("save", "get", "page", "sweep", "delete"):
        def recorded(self, *args, _call=getattr(TaskStore, name), **kwargs):
            threads.append(threading.current_thread().name)
            return _call(self, *args, **kwargs)

        monkeypatch.setattr(TaskStore, name, recorded)
    for url in serve(backend, Settings(tasks_db=str(tmp_path / "t.sqlite3"))):
        tasks = client(url).tasks
        done = tasks.create(stream=False, user_message_content="Hi.", inference_args=SHORT).result
        assert tasks.info(done.id).result.status == "completed" and [t.id for t in tasks.list()] == [done.id]
        running = tasks.create(stream=False, user_message_content="Tell a long story.", extra_body={"background": True},
                               inference_args={"max_tokens": 200}).result
        assert tasks.cancel(running.id).status == "canceled"
        assert tasks.delete(done.id).result.id == done.id
    assert len(threads) > 10 and all(name.startswith("mashbox-tasks-db") for name in threads), set(threads)


def test_a_continuation_answers_every_client_call():
    """A step with two client calls stops input-required; the client's continuation holds both calls
    (from the output) and a result for each: the next generation sees one assistant turn with both
    calls, then each result under its call's id."""
    seen = []
    first = scripted(([("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')], "tool_calls"))
    task = asyncio.run(run_async(prepare({"user_message_content": "Weather in Paris and Rome?", "client_tools": [WEATHER]},
                                 first)))
    assert task.status == "input-required" and [o.call_id for o in task.output] == ["call_0", "call_1"]
    assert [c.call_id for c in task.input_required_calls] == ["call_0", "call_1"]
    history = [{"type": "message", "role": "user", "message_content": "Weather in Paris and Rome?"},
               *[o.model_dump(exclude_none=True) for o in task.output],
               *[{"type": "tool_result", "call_id": o.call_id, "message_content": f"Sunny in {city}", "block_list": []}
                 for o, city in zip(task.output, ("Paris", "Rome"), strict=True)]]
    answer = scripted(([], "stop"))

    async def generate(request):
        seen.append(request)
        async for event in answer(request):
            yield event

    done = asyncio.run(run_async(prepare({"user_message_content": "", "history_messages": history,
                                  "client_tools": [WEATHER]}, generate)))
    assert done.status == "completed"
    messages = seen[0].messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [(c.id, c.name) for c in messages[1].tool_calls] == [("call_0", "get_weather"), ("call_1", "get_weather")]
    assert [(m.tool_call_id, m.content) for m in messages[2:]] == [("call_0", "Sunny in Paris"), ("call_1", "Sunny in Rome")]


def test_creates_at_once_with_one_task_id_start_one_task(url, tasks):
    """The id was claimed only after the store was read: 7 of 8 creates at once got 200 under one id,
    each answer a different one, the row the last save's, and the copies could not be canceled."""
    body = {"user_message_content": "Tell a long story.", "stream": False, "background": True,
            "task_id": "twins", "inference_args": {"max_tokens": 24}}

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(http.post(url + "/v1/tasks", json=body) for _ in range(6)))

    statuses = sorted(response.status_code for response in asyncio.run(together()))
    assert statuses == [200] + [409] * 5, statuses
    _until_final(tasks, "twins")


def test_refusals_of_a_create_name_the_field_and_echo_its_request_id(url):
    """``limit=²`` (a digit to str.isdigit, not to int) was a 500; a message too long for the context,
    with no history, was said to be the history; a body refused by its types answered with the
    server's id, not the request's ``request_id``."""
    listed = httpx.get(url + "/v1/tasks", params={"limit": "²"})
    assert listed.status_code == 400 and listed.json()["error"]["data"]["param"] == "limit", listed.text
    long = httpx.post(url + "/v1/tasks", json={"user_message_content": "word " * 5000, "stream": False})
    assert long.status_code == 400 and long.json()["error"]["data"]["param"] == "user_message_content", long.text
    assert long.json()["error"]["data"]["code"] == "context_length_exceeded", long.text  # as the other routes say
    typed = httpx.post(url + "/v1/tasks", json={"user_message_content": "Hi.", "stream": "yes", "request_id": "mine"})
    assert typed.status_code == 400 and typed.json()["id"] == "mine", typed.text
    history = [{"type": "message", "role": "user", "message_content": "w"}] * 50_000  # read whole before: seconds of
    huge = httpx.post(url + "/v1/tasks", json={"user_message_content": "Hi.", "stream": False,  # every stream stalled
                                               "history_messages": history}, timeout=60)
    assert huge.status_code == 400 and huge.json()["error"]["data"]["code"] == "context_length_exceeded", huge.text
    assert huge.json()["error"]["data"]["param"] == "history_messages", huge.text
    assert "50000 items of at least one each" in huge.text, huge.text


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_tool_that_raises_cancelled_error_is_a_failed_call_not_a_stopped_task(asynchronous):
    """Its CancelledError was taken for the task's own: the task came back still "working", unended."""
    def boom() -> str:
        raise asyncio.CancelledError("the tool's own")

    async def aboom() -> str:
        raise asyncio.CancelledError("the tool's own")

    generate = scripted(([("aboom" if asynchronous else "boom", "{}")], "tool_calls"), ([], "stop"))
    task = asyncio.run(run_async(prepare({"user_message_content": "Go.", "client_tools": [aboom if asynchronous
                                                                                          else boom]}, generate)))
    assert task.status == "completed", task.status
    assert task.output[1].type == "tool_result" and "CancelledError: the tool's own" in task.output[1].message_content[0].text


def test_ctrl_c_while_a_python_tool_works_stops_the_task_at_once():
    """The tool ran on the default executor, which asyncio.run waits for as it ends: Ctrl-C came back only
    when the tool returned (20 s here)."""
    started = threading.Event()

    def slow() -> str:
        started.set()
        time.sleep(20)
        return "done"

    loop = prepare({"user_message_content": "Go.", "client_tools": [slow]},
                   scripted(([("slow", "{}")], "tool_calls"), ([], "stop")))
    threading.Thread(target=lambda: started.wait(30) and os.kill(os.getpid(), signal.SIGINT), daemon=True).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):  # a real Ctrl-C, once the tool works
        run_sync(loop)
    assert started.is_set() and time.monotonic() - start < 10


def test_partials_callable_objects_and_positional_only_functions_are_tools():
    """A partial and a callable object raised AttributeError (no __name__); a positional-only parameter
    (``def f(x, /)``, math.sqrt) was passed by keyword, so every call failed."""
    import functools
    import math

    class Scale:
        def __call__(self, x: float) -> float:
            return 2 * x

    def add(a: int, b: int) -> int:
        return a + b

    def square(x: float, /) -> float:
        return x * x

    tools = {t.tool.name: t for t in map(function_tool, (functools.partial(add, 1), Scale(), square, math.sqrt))}
    assert set(tools) == {"add", "Scale", "square", "sqrt"}
    assert tools["add"].run({"b": 2}) == 3 and tools["Scale"].run({"x": 2}) == 4
    assert tools["square"].run({"x": 3}) == 9 and tools["sqrt"].run({"x": 16.0}) == 4.0


def test_each_generation_of_a_task_is_counted_on_metrics_as_a_request_is(url, tasks):
    """A task's generations count in request_finished_total and the latency histograms under protocol
    "tasks" (they counted in the token totals only)."""
    from test_metrics import samples

    def counts() -> tuple[float, float]:
        found = samples(httpx.get(url + "/metrics").content)
        return tuple(sum(v for (n, labels), v in found.items() if n == name and ("protocol", "tasks") in labels)
                     for name in ("mashbox:request_finished_total", "mashbox:e2e_request_latency_seconds_count"))

    before = counts()
    for question in ("Name a planet.", "Name a river."):
        assert tasks.create(stream=False, user_message_content=question, inference_args=SHORT).result.status == "completed"
    assert counts() == (before[0] + 2, before[1] + 2)


def test_an_engine_that_closes_mid_step_fails_the_task_as_stopped_and_keeps_what_it_wrote():
    """The server stopping under a running task: its answer so far stays in the output, ``incomplete``,
    and the task fails saying the server stopped (it was an internal error naming EngineClosedError, its
    item left ``in_progress``)."""
    async def generate(request):
        yield Queued(10)
        yield Started(0)
        yield TextDelta("Rome was")
        raise EngineClosedError("the server is shutting down", usage=Usage(12, 2, cached_tokens=4))

    task = asyncio.run(run_async(prepare({"user_message_content": "Rome?"}, generate)))
    assert task.status == "failed" and task.error.code == -32012, task.error
    assert task.error.message == ("the server stopped while this task was running (the server is shutting down); "
                                  "create it again")
    assert [(o.status, o.message_content[0].text) for o in task.output] == [("incomplete", "Rome was")]
    assert task.usage["input_tokens"] == 12 and task.usage["output_tokens"] == 2, task.usage  # it was None: lost
    assert task.usage["input_tokens_details"]["cached_tokens"] == 4


def test_an_engine_closed_before_it_took_the_task_refuses_it():
    async def generate(request):
        raise EngineClosedError("the server is shutting down")
        yield

    with pytest.raises(EngineClosedError):
        asyncio.run(run_async(prepare({"user_message_content": "Rome?"}, generate)))


def test_the_tasks_file_is_readable_by_its_owner_only(tmp_path):
    """It holds every tenant's answers: it was made 0644 (and its lock), where the cache's other files are 0600."""
    was = os.umask(0o022)
    try:
        checked = tmp_path / "checked.sqlite3"
        task_store.check(checked)
        (tmp_path / "t.sqlite3.lock").touch(mode=0o644)  # as an earlier mashbox left it
        store = TaskStore(tmp_path / "t.sqlite3", ttl_s=60)
        store.save("t", {"object": "task", "id": "job", "status": "completed", "created_at": 1, "output": []})
        store.close()
    finally:
        os.umask(was)
    for path in (checked, tmp_path / "t.sqlite3", tmp_path / "t.sqlite3.lock"):
        assert path.stat().st_mode & 0o777 == 0o600, path


def test_a_task_paused_when_its_server_stopped_says_so(tmp_path):
    store = TaskStore(tmp_path / "t.sqlite3", ttl_s=60)
    store.save("t", {"object": "task", "id": "job", "status": "paused", "created_at": 1, "output": []})
    store.close()
    again = TaskStore(tmp_path / "t.sqlite3", ttl_s=60)
    found = again.get("t", "job")
    again.close()
    assert found["status"] == "failed" and found["error"] == {
        "code": -32012, "message": "the server stopped while this task was paused; create it again"}


def test_an_in_process_server_stopping_under_a_task_fails_it_as_stopped(tiny_model_dir):
    """With --in-process the engine closing ended a running task's generation as an abort: the task failed
    -32603 "this Engine is closed ...", its item ``completed``; the backend says the server is shutting down, as
    the worker's does, and the task fails -32012 with its item incomplete."""
    from mashbox import Engine

    engine = Engine(str(tiny_model_dir), ctx=512, slots=1, quiet=True)
    backend = InProcessBackend.of(engine)

    async def generate(request):
        async for event in backend.astream(request):
            if isinstance(event, TextDelta):
                threading.Thread(target=engine.close).start()  # as the server stops, at the first text
            yield event

    task = asyncio.run(run_async(prepare({"user_message_content": "Tell a long story.",
                                          "inference_args": {"max_tokens": 400}}, generate)))
    assert task.status == "failed" and task.error.code == -32012, task.error
    assert "(the server is shutting down)" in task.error.message
    assert [o.status for o in task.output] == ["incomplete"]
    assert task.usage["input_tokens"] > 0 and task.usage["output_tokens"] > 0, task.usage  # its usage was lost


def test_an_engine_closed_under_its_own_task_fails_it_as_stopped(tiny_model_dir):
    """``Engine.task`` closed under a running task: it failed -32603 "generation failed", its usage lost; it fails
    -32012 as a server's task does, its item incomplete and its tokens counted."""
    from mashbox import Engine

    engine = Engine(str(tiny_model_dir), ctx=512, slots=1, quiet=True)

    async def run() -> list:
        seen = []
        async for event in await engine.atask(user_message_content="Tell a long story.", stream=True,
                                              inference_args={"max_tokens": 400}):
            if event.type == "task.output_text.delta" and not any(e.type == event.type for e in seen):
                threading.Thread(target=engine.close).start()  # at the first text, from another thread
            seen.append(event)
        return seen

    events = asyncio.run(run())
    task = events[-1].task
    assert events[-1].type == "task.failed" and task.error.code == -32012, task.error
    assert "the engine was closed" in task.error.message
    assert [o.status for o in task.output] == ["incomplete"]
    assert task.usage["input_tokens"] > 0 and task.usage["output_tokens"] > 0, task.usage


def test_a_schema_with_a_schema_property_is_the_schema_not_its_wrapper():
    from mashbox.api.task_items import CreateTask

    schema = {"type": "object", "properties": {"schema": {"type": "string"}}, "schema": {"type": "integer"}}
    wrapped = {"name": "answer", "strict": True, "schema": PERSON}
    assert CreateTask.model_validate({"user_message_content": "x", "stream": False,
                                      "structured_output": schema}).structured_output == schema
    assert CreateTask.model_validate({"user_message_content": "x", "stream": False,
                                      "structured_output": wrapped}).structured_output == PERSON
