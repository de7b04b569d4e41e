"""Responses: items and tools -> EngineRequest, engine events -> stream events and Response."""

from __future__ import annotations

import json

import openai.types.responses as sdk
import pytest
from pydantic import TypeAdapter
from translation import TIMINGS, translate

from mashbox.api.base import parse
from mashbox.api.openai_responses import ResponsesRequest, Translator, to_engine
from mashbox.engine.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from mashbox.engine.request import Message, Named, ToolCall
from mashbox.errors import InvalidRequestError

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=3, reasoning_tokens=2)
SDK_EVENT = TypeAdapter(sdk.ResponseStreamEvent)
TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": False},
    {"type": "namespace", "name": "agents", "description": "sub-agents",
     "tools": [{"type": "function", "name": "spawn", "parameters": {}},
               {"type": "function", "name": "exec_command", "parameters": {}}]},
    {"type": "custom", "name": "apply_patch", "description": "Patch files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: BEGIN"}},
    {"type": "local_shell"},
    {"type": "web_search", "external_web_access": False},
]


def _request(**fields) -> ResponsesRequest:
    return parse(ResponsesRequest, {"model": "gpt-x", "input": "hi", **fields})


def _stream(request: ResponsesRequest, events) -> tuple[Translator, list[dict]]:
    translator = Translator(request, "qwen")
    return translator, translate(translator, events)


def test_input_string_and_instructions():
    engine = to_engine(_request(instructions="Be brief."))
    assert engine.messages == (Message("system", "Be brief."), Message("user", "hi"))


def test_input_items_map_in_order():
    items = [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "sum"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "out1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "out2"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "why"}]},
        {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch", "input": "*** Begin"},
        {"type": "custom_tool_call_output", "call_id": "c3", "output": "patched"},
        {"type": "local_shell_call", "call_id": "c4", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "env": {}, "working_directory": "/w"}},
        {"type": "local_shell_call_output", "id": "c4", "output": "a.txt"},
    ]
    engine = to_engine(_request(input=items, tools=TOOLS))
    assert engine.messages == (
        Message("system", "dev"),
        Message("user", "a\nb"),
        Message("assistant", "ok", reasoning="sum",
                tool_calls=(ToolCall("c1", "exec_command", "{}"), ToolCall("c2", "spawn", "{}"))),
        Message("tool", "out1", tool_call_id="c1"),
        Message("tool", "out2", tool_call_id="c2"),
        Message("assistant", reasoning="why",
                tool_calls=(ToolCall("c3", "apply_patch", json.dumps({"input": "*** Begin"})),)),
        Message("tool", "patched", tool_call_id="c3"),
        Message("assistant",
                tool_calls=(ToolCall("c4", "local_shell", json.dumps({"command": ["ls"], "workdir": "/w"})),)),
        Message("tool", "a.txt", tool_call_id="c4"),
    )


def test_tools_map_namespaces_custom_and_local_shell():
    request = _request(tools=TOOLS)
    tools = {t.name: t for t in to_engine(request).tools}
    assert list(tools) == ["exec_command", "spawn", "agents__exec_command", "apply_patch", "local_shell"]
    assert tools["apply_patch"].parameters["required"] == ["input"]
    assert "start: BEGIN" in tools["apply_patch"].description
    assert tools["local_shell"].parameters["required"] == ["command"]
    refs = request.tool_map()
    assert (refs.ref("spawn").namespace, refs.ref("agents__exec_command").name) == ("agents", "exec_command")
    assert refs.ref("exec_command").namespace is None
    assert request.ignored_fields() == ["tools[apply_patch].format", "tools[web_search]"]  # lark: shown, not held


@pytest.mark.parametrize("namespaces", [
    [{"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "f"}]}],
    [{"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "f"}]}] * 2])
def test_two_tools_of_one_name_in_one_namespace_are_refused(namespaces):
    """The second was called ``a__f``, and both came back as ``f`` of ``a``: which one, no client could tell."""
    with pytest.raises(InvalidRequestError, match="two tools of the namespace 'a' are named 'f'") as err:
        to_engine(_request(tools=namespaces))
    assert err.value.param == "tools"


def test_a_namespace_tool_before_a_top_level_tool_of_its_name_gets_a_name_of_its_own():
    """Top-level after it, the top-level tool took the name: two tools named ``read_file``, and the namespace's
    never called (in history too, a call of it was the top-level one's)."""
    inner = {"type": "namespace", "name": "mcp__fs", "tools": [{"type": "function", "name": "read_file"}]}
    request = _request(tools=[inner, {"type": "function", "name": "read_file"}])
    assert [t.name for t in to_engine(request).tools] == ["mcp__fs__read_file", "read_file"]
    refs = request.tool_map()
    assert (refs.ref("mcp__fs__read_file").namespace, refs.ref("read_file").namespace) == ("mcp__fs", None)
    assert refs.visible("read_file", "mcp__fs") == "mcp__fs__read_file"


def test_a_namespace_tool_named_as_the_shell_and_a_choice_of_a_namespaces_function():
    """The shell takes ``local_shell`` outright: a namespace's ``local_shell`` before it was shadowed; and a
    ``tool_choice`` naming a namespace's function forced the top-level one of that name."""
    shell = {"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "local_shell"}]}
    request = _request(tools=[shell, {"type": "local_shell"}])
    assert [t.name for t in to_engine(request).tools] == ["fs__local_shell", "local_shell"]
    choice = {"type": "function", "name": "exec_command", "namespace": "agents"}
    assert to_engine(_request(tools=TOOLS, tool_choice=choice)).tool_choice == Named("agents__exec_command")


def test_allowed_tools_that_name_none_of_the_tools_say_so():
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "namespace", "name": "nowhere"}]}
    with pytest.raises(InvalidRequestError, match="names none of the request's tools") as err:
        to_engine(_request(tools=TOOLS, tool_choice=choice))
    assert err.value.param == "tool_choice.tools"


@pytest.mark.parametrize("choice", [
    {"type": "allowed_tools"}, {"type": "allowed_tools", "mode": "none", "tools": None},
    {"type": "allowed_tools", "mode": "auto", "tools": []},
])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_an_allowed_tools_choice_that_lists_no_tools_is_refused(choice, tools):
    """Open Responses requires its ``tools`` (one or more): without any, and without tools in the request,
    it was taken, and echoed in a response its schema refuses."""
    with pytest.raises(InvalidRequestError, match="lists the tools it allows") as err:
        to_engine(_request(tools=tools, tool_choice=choice))
    assert err.value.param == "tool_choice.tools"
    named = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "spawn"}]}
    with pytest.raises(InvalidRequestError, match="names none of the request's tools"):
        to_engine(_request(tool_choice=named))  # and a request without tools has none of those it names


@pytest.mark.parametrize(("entry", "names"), [
    ({"type": "local_shell"}, ["local_shell"]),  # a tool of no name, listed by its type: was a 400 "no tools"
    ({"type": "namespace", "name": "agents"}, ["spawn", "agents__exec_command"]),
    ({"type": "function", "name": "exec_command", "namespace": "agents"}, ["agents__exec_command"]),
])
def test_allowed_tools_lists_a_tool_by_its_type_or_its_namespace(entry, names):
    choice = {"type": "allowed_tools", "mode": "required", "tools": [entry]}
    assert [t.name for t in to_engine(_request(tools=TOOLS, tool_choice=choice)).tools] == names


def test_a_custom_tool_s_regex_is_the_pattern_its_input_is_held_to():
    phone = {"type": "custom", "name": "dial", "format": {"type": "grammar", "syntax": "regex",
                                                         "definition": "[0-9]{3}-[0-9]{4}"}}
    request = _request(tools=[phone])
    (tool,) = to_engine(request).tools
    assert tool.parameters["properties"]["input"]["pattern"] == "^(?:[0-9]{3}-[0-9]{4})$"
    assert request.ignored_fields() == []


@pytest.mark.parametrize(
    ("choice", "expected"),
    [(None, "auto"), ("none", "none"), ("required", "required"),
     ({"type": "function", "name": "spawn"}, Named("spawn")),
     ({"type": "function", "function": {"name": "exec_command"}}, Named("exec_command")),
     ({"type": "custom", "name": "apply_patch"}, Named("apply_patch")),
     ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "spawn"}]}, "required"),
     ({"type": "allowed_tools", "mode": "none", "tools": [{"type": "function", "name": "spawn"}]}, "none"),
     ({"type": "allowed_tools", "tools": [{"type": "function", "name": "spawn"}]}, "auto")],
)
def test_tool_choice(choice, expected):
    assert to_engine(_request(tools=TOOLS, tool_choice=choice)).tool_choice == expected


@pytest.mark.parametrize("choice", [{"type": "function"}, {"type": "function", "name": ""}, {"type": "custom"},
                                    {"type": "function", "name": None}, {"type": "function", "function": {}}])
def test_a_function_tool_choice_without_a_name_is_refused_naming_it(choice):
    """It forced no tool and was taken for ``auto`` (200) where Chat and Messages refuse it (400)."""
    with pytest.raises(InvalidRequestError) as refused:
        to_engine(_request(tools=TOOLS, tool_choice=choice))
    assert refused.value.param == "tool_choice.name" and choice["type"] in refused.value.message


def test_a_tool_choice_of_a_hosted_tool_is_said_to_be_ignored_and_local_shell_is_forced():
    hosted = _request(tools=[{"type": "web_search"}, *TOOLS], tool_choice={"type": "web_search"})
    assert to_engine(hosted).tool_choice == "auto"
    assert hosted.ignored_fields() == ["tool_choice[web_search]", "tools[apply_patch].format", "tools[web_search]"]
    mcp = _request(tools=[{"type": "mcp", "server_label": "wiki"}, *TOOLS],
                   tool_choice={"type": "mcp", "server_label": "wiki", "name": "spawn"})  # its name is the server's
    assert to_engine(mcp).tool_choice == "auto" and "tool_choice[mcp]" in mcp.ignored_fields()
    shell = _request(tools=[{"type": "local_shell"}], tool_choice={"type": "local_shell"})
    assert to_engine(shell).tool_choice == Named("local_shell") and shell.ignored_fields() == []


@pytest.mark.parametrize(
    ("reasoning", "thinking"),
    [(None, None), ({"summary": "auto"}, None), ({"effort": "none"}, False), ({"effort": "minimal"}, False),
     ({"effort": "low"}, True), ({"effort": "high"}, True)],
)
def test_reasoning_effort_switches_thinking(reasoning, thinking):
    assert to_engine(_request(reasoning=reasoning)).enable_thinking is thinking


def test_max_output_tokens_and_ignored_fields():
    request = _request(max_output_tokens=50, max_tokens=10, store=False, include=["reasoning.encrypted_content"],
                       client_metadata={"a": "b"}, reasoning={"summary": "auto"}, truncation="auto")
    assert to_engine(request).sampling.max_tokens == 50
    assert request.ignored_fields() == [
        "client_metadata", "include[reasoning.encrypted_content]", "reasoning.summary", "store", "truncation"]


def test_an_items_field_it_does_not_read_is_reported_but_those_its_answers_carry():
    """An output item sent back (``id``, ``status``) says nothing; a field no item has is named."""
    items = [{"role": "user", "content": "hi", "name": "ann"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello"}]}]
    assert _request(input=items).ignored_fields() == ["input[].name"]


@pytest.mark.parametrize("instructions", [None, ""])
def test_empty_input_without_instructions_is_refused(instructions):
    with pytest.raises(InvalidRequestError) as err:
        to_engine(_request(input=[], instructions=instructions))
    assert err.value.param == "input"


def test_empty_instructions_are_an_empty_system_text_as_an_empty_system_item_is():
    """Either keeps the template's default system text out (Qwen's "You are Qwen..."): the instructions did not."""
    assert to_engine(_request(instructions="")).messages[0] == Message("system", "")
    assert to_engine(_request(input=[{"role": "system", "content": ""}, {"role": "user", "content": "hi"}])
                     ).messages[0] == Message("system", "")


ANSWER = [
    ReasoningDelta("plan"),
    TextDelta("Hel"),
    TextDelta("lo"),
    ToolCallStart(0, "a1", "spawn"),
    ToolCallDelta(0, '{"task":'),
    ToolCallDelta(0, ' "x"}'),
    ToolCallEnd(0),
    ToolCallStart(1, "a2", "apply_patch"),
    ToolCallDelta(1, '{"input": "*** Begin'),
    ToolCallDelta(1, ' Patch"}'),
    ToolCallEnd(1),
    ToolCallStart(2, "a3", "local_shell"),
    ToolCallDelta(2, '{"command": ["ls", "-l"], "workdir": "/w"}'),
    ToolCallEnd(2),
    Finish("tool_calls", USAGE, TIMINGS),
]


def test_stream_events_validate_under_the_sdk():
    _, events = _stream(_request(tools=TOOLS), ANSWER)
    for event in events:
        SDK_EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))


def test_stream_order():
    _, events = _stream(_request(tools=TOOLS), ANSWER)
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "custom_tool_call_input.delta", "custom_tool_call_input.done", "output_item.done",
        "output_item.added", "output_item.done",
        "completed",
    ]
    created = events[0]["response"]
    assert (created["status"], created["usage"], created["output"]) == ("in_progress", None, [])
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2, 3, 4]
    call = events[15]["item"]
    assert (call["type"], call["name"], call["namespace"], call["call_id"]) == ("function_call", "spawn",
                                                                               "agents", "call_a1")
    assert events[21]["delta"] == "*** Begin Patch"


def test_completed_response_validates_under_the_sdk():
    translator, events = _stream(_request(tools=TOOLS, tool_choice="auto", parallel_tool_calls=True), ANSWER)
    body = translator.response().dump()
    assert events[-1]["response"] == body
    response = sdk.Response.model_validate(body)
    assert (response.status, response.model, response.parallel_tool_calls) == ("completed", "gpt-x", True)
    assert response.id.startswith("resp_")
    assert [item.type for item in response.output] == [
        "reasoning", "message", "function_call", "custom_tool_call", "local_shell_call"]
    reasoning, message, call, custom, shell = response.output
    assert reasoning.id.startswith("rs_") and reasoning.content[0].text == "plan"
    assert message.id.startswith("msg_") and message.content[0].text == "Hello"
    assert call.id.startswith("fc_") and call.arguments == '{"task": "x"}'
    assert (custom.name, custom.input) == ("apply_patch", "*** Begin Patch")
    assert (shell.action.command, shell.action.working_directory) == (["ls", "-l"], "/w")
    assert body["usage"] == {
        "input_tokens": 10, "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
        "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 15}
    assert len(response.tools) == 5


def test_length_gives_incomplete():
    translator, events = _stream(_request(max_output_tokens=2), [TextDelta("ab"), Finish("length", USAGE, TIMINGS)])
    body = translator.response().dump()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.completed"
    sdk.Response.model_validate(body)
    done = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert done == body["output"][0] and done["status"] == "incomplete"  # the item the limit cut, its text kept
    assert done["content"][0]["text"] == "ab"


@pytest.mark.parametrize(("reason", "status"), [("length", "incomplete"), ("error", "incomplete"),
                                                ("tool_calls", "completed")])
def test_an_item_the_end_cuts_is_incomplete_and_one_it_closed_before_is_completed(reason, status):
    cut = [TextDelta("Hi"), ToolCallStart(0, "a1", "spawn"), ToolCallDelta(0, '{"task": "x'), Finish(reason, USAGE, TIMINGS)]
    translator, events = _stream(_request(tools=TOOLS), cut)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["status"] for item in done] == ["completed", status]
    assert done[1]["arguments"] == '{"task": "x'
    for event in events:
        SDK_EVENT.validate_python(event)


def test_model_defaults_to_the_served_id():
    request = parse(ResponsesRequest, {"input": "hi"})
    translator, _ = _stream(request, [Finish("stop", USAGE, TIMINGS)])
    body = translator.response().dump()
    assert body["model"] == "qwen" and body["output"] == []
    sdk.Response.model_validate(body)


@pytest.mark.parametrize(("sent", "echoed"), [({}, False), ({"parallel_tool_calls": True}, True),
                                              ({"parallel_tool_calls": False}, False)])
def test_parallel_tool_calls_is_echoed_as_sent_and_defaults_to_false_as_the_server_api_says(sent, echoed):
    request = parse(ResponsesRequest, {"input": "hi", "tools": TOOLS, **sent})
    translator, _ = _stream(request, [Finish("stop", USAGE, TIMINGS)])
    assert translator.response().dump()["parallel_tool_calls"] is echoed
    assert to_engine(request).parallel_tool_calls is echoed  # and the grammar lets the model make that many calls


@pytest.mark.parametrize(("sent", "echoed"), [({}, None), ({"max_output_tokens": 7}, 7), ({"max_tokens": 3}, 3),
                                              ({"max_output_tokens": 7, "max_tokens": 3}, 7)])
def test_the_output_limit_that_ran_is_echoed_under_any_of_its_names(sent, echoed):
    """``max_tokens`` (the other routes' name) held the answer to 3 tokens, and the response said null."""
    request = parse(ResponsesRequest, {"input": "hi", **sent})
    translator, _ = _stream(request, [Finish("stop", USAGE, TIMINGS)])
    assert translator.response().dump()["max_output_tokens"] == echoed == request.max_new_tokens()


def test_echoed_tool_choice_takes_the_responses_shape():
    request = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "spawn"}})
    translator, _ = _stream(request, [Finish("stop", USAGE, TIMINGS)])
    body = translator.response().dump()
    assert body["tool_choice"] == {"type": "function", "name": "spawn"}
    sdk.Response.model_validate(body)


def test_failure_after_start_sends_error_then_failed():
    translator, _ = _stream(_request(), [TextDelta("partial")])
    events = [e.dump() for e in translator.error("device lost")]
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[1]["response"]["status"] == "failed"
    assert events[1]["response"]["error"] == {"code": "server_error", "message": "device lost"}
    assert events[0]["sequence_number"] + 1 == events[1]["sequence_number"]
    assert (events[0]["message"], events[0]["error"]["message"]) == ("device lost", "device lost")
    for event in events:
        SDK_EVENT.validate_python(event)


def test_engine_error_finish_fails_the_stream():
    translator, events = _stream(_request(), [Finish("error", USAGE, TIMINGS, error="oom")])
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert translator.response().status == "failed"


def test_response_carries_the_open_responses_fields():
    request = _request(tools=TOOLS[:1], temperature=0.5, reasoning={"effort": "low"}, prompt_cache_key="s1",
                       metadata={"ticket": "T-12"})
    assert "metadata" not in request.ignored_fields()
    translator, _ = _stream(request, [TextDelta("x"), Finish("stop", USAGE, TIMINGS)])
    body = translator.response().dump()
    assert body["tools"] == [{"type": "function", "name": "exec_command", "description": None,
                              "parameters": {"type": "object"}, "strict": False}]
    assert (body["temperature"], body["top_p"], body["presence_penalty"], body["frequency_penalty"]) == (
        0.5, 1.0, 0.0, 0.0)
    assert body["reasoning"] == {"effort": "low", "summary": None}
    assert (body["truncation"], body["text"], body["store"], body["background"]) == (
        "disabled", {"format": {"type": "text"}}, False, False)
    assert body["previous_response_id"] is None and body["prompt_cache_key"] == "s1"
    assert body["metadata"] == {"ticket": "T-12"}  # the request's, as OpenAI's echoes it
    assert body["completed_at"] >= body["created_at"]
    sdk.Response.model_validate(body)


def test_an_allowed_tools_choice_is_echoed_with_its_mode():
    """Open Responses requires ``mode`` in the response's allowed_tools choice; a request may leave it out."""
    choice = {"type": "allowed_tools", "tools": [{"type": "function", "name": "spawn"}]}
    translator, _ = _stream(_request(tools=TOOLS, tool_choice={**choice, "extra": 1}), [Finish("stop", USAGE, TIMINGS)])
    assert translator.response().dump()["tool_choice"] == {**choice, "mode": "auto"}  # not a key the spec lacks


def test_allowed_tools_limits_what_the_model_may_call():
    from mashbox.api.base import parse
    from mashbox.api.openai_responses import ResponsesRequest, to_engine

    tools = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("a", "b", "c")]
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]}
    engine = to_engine(parse(ResponsesRequest, {"input": "x", "tools": tools, "tool_choice": choice}))
    assert [t.name for t in engine.tools] == ["b"] and engine.tool_choice == "required"
    engine = to_engine(parse(ResponsesRequest, {"input": "x", "tools": tools, "tool_choice": "auto"}))
    assert [t.name for t in engine.tools] == ["a", "b", "c"]
