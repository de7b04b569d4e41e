"""The shared pieces of mashbox.api: parse errors, the extra-field policy, output dumps, blocks."""

from __future__ import annotations

from typing import ClassVar

import pytest
from translation import USER

from mashbox.api import base
from mashbox.api.base import OutModel, RequestModel, engine_request, parse, plain
from mashbox.api.blocks import BlockTracker
from mashbox.api.anthropic_messages import MessagesRequest
from mashbox.api.openai_chat import ChatRequest
from mashbox.api.openai_completions import CompletionRequest
from mashbox.api.openai_responses import ResponsesRequest
from mashbox.api.task_items import CreateTask
from mashbox.engine.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    Timings,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from mashbox.errors import InvalidRequestError

FINISH = Finish("stop", Usage(10, 4, 2), Timings(8, 5.0, 4, 6.0, 2, 0.5))


def test_parse_passes_a_parsed_request_through():
    request = parse(ChatRequest, {"messages": USER})
    assert parse(ChatRequest, request) is request


def test_parse_takes_another_model_as_its_fields():
    class Body(RequestModel):
        messages: list[dict]

    assert parse(ChatRequest, Body(messages=USER)).messages[0].content == "hi"


def test_parse_error_is_invalid_request_with_readable_message():
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatRequest, {"messages": USER, "top_p": 0})
    assert err.value.param == "top_p"
    assert "greater than 0" in err.value.message
    assert str(err.value).startswith("top_p: ")


def test_parse_of_a_non_object_body():
    with pytest.raises(InvalidRequestError, match="should be a JSON object, not an array"):
        parse(ChatRequest, ["not", "an", "object"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value", "said"), [
    ("chat_template_kwargs", "x", "a string"), ("stream_options", 5, "a number"), ("prediction", [1], "an array"),
    ("logit_bias", "x", "a string"), ("response_format", 5, "a number")])
def test_an_object_field_of_another_type_is_named_without_a_class_name(field, value, said):
    """pydantic's words named mashbox's own classes: "a valid dictionary or instance of TemplateKwargs"."""
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatRequest, {"messages": USER, field: value})
    assert err.value.param == field and err.value.message == f"Input should be a JSON object, not {said}"


@pytest.mark.parametrize(("request_class", "body", "param", "said"), [
    (ChatRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "a string or an array, not a number"),
    (ChatRequest, {"messages": USER, "stop": {"a": 1}}, "stop", "a string or an array, not a JSON object"),
    (ResponsesRequest, {"input": None}, "input", "a string or an array, not null"),
    (CreateTask, {"stream": False, "user_message_content": [5]}, "user_message_content.0",
     "a string or a JSON object, not a number")])
def test_a_value_no_branch_of_a_union_takes_is_told_every_branch(request_class, body, param, said):
    """pydantic's first branch spoke alone: "Input should be a valid string" for a field that takes an array too."""
    with pytest.raises(InvalidRequestError) as err:
        parse(request_class, body)
    assert err.value.param == param and err.value.message == f"Input should be {said}"


def test_ignored_fields_lists_extras_and_accepted_ignored_fields():
    request = parse(ChatRequest, {"messages": USER, "store": False, "merge": True, "user": "u", "zeta": 1})
    assert request.ignored_fields() == ["merge", "store", "user", "zeta"]


@pytest.mark.parametrize("request_class, body",
                         [(ChatRequest, {"messages": USER}), (CompletionRequest, {"prompt": "a"})])
def test_stream_options_not_read_are_reported(request_class, body):
    """Unstreamed, the options are not read (OpenAI: a 400); streamed, a key they do not know is not either."""
    options = {"include_usage": True, "include_obfuscation": False}
    assert parse(request_class, {**body, "stream_options": options}).ignored_fields() == [
        "stream_options", "stream_options.include_obfuscation"]
    streamed = parse(request_class, {**body, "stream": True, "stream_options": options})
    assert streamed.ignored_fields() == ["stream_options.include_obfuscation"]
    asked = parse(request_class, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert asked.ignored_fields() == []


def test_ignored_fields_name_nested_extras_with_a_value():
    """A key of a nested part no field reads was dropped unsaid (Codex's ``text.verbosity``): named by its path,
    ``[]`` for any item of a list; one with no value is not."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}, "zz": 1}]}]
    assert parse(ChatRequest, {"messages": messages}).ignored_fields() == ["messages[].content[].zz"]
    body = {"input": "hi", "text": {"verbosity": "low"}, "reasoning": {"effort": "low", "zap": 1},
            "tools": [{"type": "web_search", "external_web_access": False}]}  # left out whole: named as a whole
    assert parse(ResponsesRequest, body).ignored_fields() == ["reasoning.zap", "text.verbosity", "tools[web_search]"]
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "x"}
    assert parse(MessagesRequest, {"messages": USER, "max_tokens": 5, "thinking": thinking}).ignored_fields() == [
        "thinking.display"]


def test_items_the_server_wrote_sent_back_name_nothing():
    """An answer's own items, sent back as the next turn's input or a task's history, carry keys no input field
    reads (an item's id, status, a call's language, a local shell action's type): they are no news to the client."""
    from mashbox.api.responses_output import FunctionCallOut, LocalShellActionOut, LocalShellCallOut
    from mashbox.api.task_items import CreateTask, ToolCallOut

    shell = LocalShellCallOut(id="lsh_1", status="completed", call_id="c1", action=LocalShellActionOut(command=["ls"]))
    call = FunctionCallOut(id="fc_1", status="completed", call_id="c2", name="f", arguments="{}")
    assert parse(ResponsesRequest, {"input": [shell.dump(), call.dump()]}).ignored_fields() == []
    done = ToolCallOut(id="tc_1", status="completed", call_id="c1", name="get_weather", arguments="{}")
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {}}}
    task = {"stream": False, "user_message_content": "", "history_messages": [done.dump()], "client_tools": [tool]}
    assert parse(CreateTask, task).ignored_fields() == []


class _Out(OutModel):
    keep_none: ClassVar[frozenset[str]] = frozenset({"kept"})
    kept: int | None = None
    dropped: int | None = None
    nested: _Out | None = None


def test_out_model_drops_none_unless_kept():
    dumped = _Out(nested=_Out(dropped=1)).dump()
    assert dumped == {"kept": None, "nested": {"kept": None, "dropped": 1}}


def test_engine_request_errors_name_the_field():
    with pytest.raises(InvalidRequestError) as err:
        engine_request(messages=())
    assert err.value.param == "messages"


def _trace(events) -> str:
    tracker = BlockTracker()
    changes = [c for e in events for c in tracker.feed(e)]
    return " ".join(f"{c.kind}:{c.block.kind}" if c.block else c.kind for c in changes)


@pytest.mark.parametrize(
    ("events", "trace"),
    [
        ([TextDelta("a"), TextDelta("b"), FINISH], "open:text delta:text delta:text close:text finish"),
        ([TextDelta(""), FINISH], "finish"),
        (
            [ReasoningDelta("r"), TextDelta("t"), ReasoningDelta("r2"), FINISH],
            "open:reasoning delta:reasoning close:reasoning open:text delta:text close:text "
            "open:reasoning delta:reasoning close:reasoning finish",
        ),
        (
            [TextDelta("t"), ToolCallStart(0, "c", "f"), ToolCallDelta(0, "{}"), ToolCallEnd(0), FINISH],
            "open:text delta:text close:text open:tool delta:tool close:tool finish",
        ),
        ([ToolCallStart(0, "c", "f"), FINISH], "open:tool close:tool finish"),
        ([ToolCallStart(0, "c", "f"), ToolCallEnd(0), ToolCallDelta(0, "x"), FINISH], "open:tool close:tool finish"),
    ],
)
def test_block_tracker_opens_a_block_when_the_kind_changes(events, trace):
    assert _trace(events) == trace


def test_block_tracker_keeps_the_answer():
    tracker = BlockTracker()
    events = [ReasoningDelta("hm"), TextDelta("Hel"), TextDelta("lo"), ToolCallStart(3, "id1", "read"),
              ToolCallDelta(3, '{"a"'), ToolCallDelta(3, ": 1}"), ToolCallEnd(3), FINISH]
    for event in events:
        tracker.feed(event)
    assert (tracker.reasoning(), tracker.text()) == ("hm", "Hello")
    [tool] = tracker.tools()
    assert (tool.tool_id, tool.name, tool.text, tool.tool_ordinal, tool.index) == ("id1", "read", '{"a": 1}', 0, 2)
    assert tracker.done() is FINISH


def test_block_tracker_answer_needs_finish():
    with pytest.raises(RuntimeError, match="Finish"):
        BlockTracker().done()


def test_text_parts_become_the_same_messages_on_every_protocol():
    """Parts are joined with a new line, as Anthropic's blocks are (and vLLM's parts): two lines of a tool
    result sent as parts stay two lines, and one conversation is one prompt whichever route it takes."""
    from mashbox.api import anthropic_messages, openai_chat, openai_responses

    chat = openai_chat.to_engine(parse(openai_chat.ChatRequest, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and Rome?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "line1"}, {"type": "text", "text": "line2"}]},
    ]}))
    responses = openai_responses.to_engine(parse(openai_responses.ResponsesRequest, {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris"},
                                     {"type": "input_text", "text": "and Rome?"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "line1"},
                                                                        {"type": "input_text", "text": "line2"}]},
    ]}))
    messages = anthropic_messages.to_engine(parse(anthropic_messages.MessagesRequest, {"max_tokens": 9, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and Rome?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "w", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [
            {"type": "text", "text": "line1"}, {"type": "text", "text": "line2"}]}]},
    ]}))
    texts = [[(m.role, m.content) for m in r.messages] for r in (chat, responses, messages)]
    assert texts[0] == texts[1] == texts[2]
    assert texts[0][0] == ("user", "Weather in Paris\nand Rome?") and texts[0][2] == ("tool", "line1\nline2")


def test_a_stop_string_too_long_is_named():
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatRequest, {"messages": USER, "stop": ["end", "x" * 10_001]})
    assert err.value.param == "stop" and "at most 10000 characters (one has 10001)" in err.value.message


def test_a_token_id_of_thousands_of_digits_is_refused_not_a_500():
    """Python reads no number of over 4,300 digits (a ValueError past the validator: a 500)."""
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatRequest, {"messages": USER, "logit_bias": {"9" * 5000: 1}})
    assert err.value.param == "logit_bias" and "5000 digits" in err.value.message
    for zeros in (30, 5000):  # a key of thousands of digits, all but one leading zeros
        assert parse(ChatRequest, {"messages": USER, "logit_bias": {"0" * zeros + "7": 1}}).sampling().logit_bias \
            == ((7, 1),)
    with pytest.raises(InvalidRequestError) as err:  # a content part that is no object
        parse(ChatRequest, {"messages": [{"role": "user", "content": [5]}]})
    assert err.value.param == "messages.0.content.0"
    assert err.value.message == "Input should be a JSON object, not a number"


def test_a_body_of_millions_of_bad_items_is_refused_at_once():
    """Read on the loop that streams every answer: 4.9 million items of the wrong type were validated, then each
    one's error named (a path built for every one), for over a minute in which no stream moved."""
    with pytest.raises(InvalidRequestError) as err:
        plain({"max_tokens": 5, "prompt": [1] * 4_900_000})
    assert err.value.param == "prompt" and "4900000 items" in err.value.message
    errors_read = []
    real = base._path
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(base, "_path", lambda err, data: errors_read.append(err) or real(err, data))
        with pytest.raises(InvalidRequestError) as err:
            parse(ChatRequest, {"messages": USER, "stop": [1] * 60_000})
    assert err.value.param.startswith("stop") and len(errors_read) <= 64


def test_bad_items_spread_over_many_arrays_are_refused_before_validation():
    """Each array under the cap, 80 of 50,000 items: validated and each error built, a 31 s stall (a verifier's
    find). The body's values are counted: past 200,000 it is refused where the count ran out."""
    with pytest.raises(InvalidRequestError) as err:
        plain({"messages": [{"role": "user", "content": [1] * 50_000}] * 80})
    assert err.value.param.startswith("messages.3.content.") and "200000th JSON value" in err.value.message
    conversation = [{"role": "user", "content": "w"}] * 150_000  # past the context: the route refuses it as too long
    assert plain({"messages": conversation}, turns=8192)["messages"] is conversation


def test_a_fault_deep_in_a_body_is_named_where_it_is():
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["x"] = {}
        node = node["x"]
    surrogate = {"messages": [{"role": "user", "content": "a\ud800"}]}
    for body, param, said in [({"tools": [deep]}, "tools.0.x.x.x.x...", "nests more than 128 levels deep"),
                              (surrogate, "messages.0.content", "surrogate")]:
        with pytest.raises(InvalidRequestError) as err:
            plain(body)
        assert err.value.param == param and said in err.value.message
