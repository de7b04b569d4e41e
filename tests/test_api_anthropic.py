"""Anthropic Messages: request -> EngineRequest, engine events -> stream events and Message."""

from __future__ import annotations

import anthropic.types as sdk
import pytest
from pydantic import TypeAdapter
from translation import TIMINGS, USER, translate

from mashbox.api.anthropic_messages import (
    CountTokensRequest,
    MessagesRequest,
    TokenCount,
    Translator,
    to_engine,
)
from mashbox.api.base import parse
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

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=3)
ANSWER = [
    ReasoningDelta("let me see"),
    TextDelta("Hi"),
    TextDelta("!"),
    ToolCallStart(0, "abc", "Read"),
    ToolCallDelta(0, '{"file_path":'),
    ToolCallDelta(0, ' "a"}'),
    ToolCallEnd(0),
    Finish("tool_calls", USAGE, TIMINGS),
]
SDK_EVENT = TypeAdapter(sdk.RawMessageStreamEvent)


def _request(**fields) -> MessagesRequest:
    return parse(MessagesRequest, {"model": "claude-x", "messages": USER, **fields})


def _stream(request: MessagesRequest, events=ANSWER) -> tuple[Translator, list[dict]]:
    translator = Translator(request, "qwen")
    return translator, translate(translator, events)


def test_system_blocks_drop_the_billing_header():
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
              {"type": "text", "text": "You are helpful."}, {"type": "text", "text": "Be brief."}]
    engine = to_engine(_request(system=system))
    assert engine.messages[0] == Message("system", "You are helpful.\nBe brief.")
    assert to_engine(_request(system="S")).messages[0] == Message("system", "S")


def test_conversation_with_tools_and_thinking():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "system", "content": "late system text"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "mashbox-local"},
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"p": 1}},
            {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "file"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no such"}]},
            {"type": "text", "text": "go on"},
        ]},
    ]
    engine = to_engine(_request(messages=messages))
    assert engine.messages == (
        Message("user", "a\nb"),
        Message("system", "late system text"),
        Message("assistant", "Reading.", reasoning="hmm",
                tool_calls=(ToolCall("toolu_1", "Read", '{"p": 1}'), ToolCall("toolu_2", "Bash", "{}"))),
        Message("tool", "file", tool_call_id="toolu_1"),
        Message("tool", "Error: no such", tool_call_id="toolu_2"),
        Message("user", "go on"),
    )


def test_a_tool_result_of_null_content_is_an_empty_result():
    """A tool that printed nothing: ``"content": null`` was a 400 ("Input should be a valid string")."""
    messages = [{"role": "user", "content": "run it"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": None}]}]
    assert to_engine(_request(messages=messages)).messages[-1] == Message("tool", "", tool_call_id="t1")


def test_tools_skip_server_tools():
    tools = [{"name": "Read", "description": "d", "input_schema": {"type": "object"}},
             {"type": "custom", "name": "Bash", "input_schema": {}},
             {"type": "web_search_20250305", "name": "web_search"},
             {"type": "mcp_toolset", "mcp_server_name": "srv"}]  # the MCP connector's: no name (it was a 400)
    request = _request(tools=tools)
    assert [t.name for t in to_engine(request).tools] == ["Read", "Bash"]
    assert request.ignored_fields() == ["tools[mcp_toolset]", "tools[web_search_20250305]"]
    with pytest.raises(InvalidRequestError, match="is required for a tool the model calls") as refused:
        _request(tools=[{"input_schema": {"type": "object"}}])
    assert refused.value.param == "tools.0.name"


def test_anthropic_s_client_tools_are_called_with_their_documented_input():
    """bash, the text editor and memory carry no input_schema (Anthropic's models know them) but run on the
    client: the model may call them, with their documented input (they were skipped as server tools)."""
    tools = [{"type": "bash_20250124", "name": "bash"},
             {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 1000},
             {"type": "memory_20250818", "name": "memory"}, {"type": "computer_20250124", "name": "computer",
                                                             "display_width_px": 1024, "display_height_px": 768}]
    request = _request(tools=tools, tool_choice={"type": "tool", "name": "bash"})
    bash, editor, memory = to_engine(request).tools
    assert (bash.name, bash.parameters["required"], to_engine(request).tool_choice) == ("bash", ["command"], Named("bash"))
    assert editor.parameters["properties"]["command"]["enum"][:3] == ["view", "create", "str_replace"]
    assert memory.name == "memory" and "rename" in memory.parameters["properties"]["command"]["enum"]
    assert request.ignored_fields() == ["tools[].max_characters", "tools[computer_20250124]"]  # its results are
    # screenshots; the editor's limit is a tool's own, which the server does not run
    with pytest.raises(InvalidRequestError, match="'computer', a tool of type 'computer_20250124'"):
        _request(tools=tools, tool_choice={"type": "tool", "name": "computer"})


def test_a_document_of_text_is_read_as_its_title_context_and_text():
    documents = [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Line one."},
                  "title": "notes.txt", "context": "From the user's disk."},
                 {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "A"},
                                                                                 {"type": "text", "text": "B"}]}}]
    content = [*documents, {"type": "text", "text": "Summarise."},
               {"type": "tool_result", "tool_use_id": "t1", "content": documents[1:]}]
    messages = to_engine(_request(messages=[{"role": "user", "content": content}])).messages
    assert messages[0].content == "notes.txt\n\nFrom the user's disk.\n\nLine one.\nA\nB\nSummarise."
    assert messages[1] == Message("tool", "A\nB", tool_call_id="t1")


@pytest.mark.parametrize(("block", "param", "words"), [
    ({"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "p"}, {"type": "image"}]}},
     "source.content.1.type", "a block of type 'image' in a document"),  # it said type content was not supported
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain"}}, "source.data", "is required"),
    ({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA"}}, "source",
     "source type 'base64' is not supported"),
    ({"type": "tool_result", "tool_use_id": "t", "content": {"type": "text", "text": "x"}}, "content",
     "a block alone is not taken"),  # it said only "Input should be a valid string"
])
def test_a_block_the_model_cannot_read_is_refused_naming_what_in_it(block, param, words):
    with pytest.raises(InvalidRequestError, match=words) as err:
        _request(messages=[{"role": "user", "content": [block]}])
    assert err.value.param == f"messages.0.content.0.{param}"


def test_a_message_of_no_content_is_refused_naming_it():
    """An empty list of blocks made no message: alone, nothing to answer (the fuzzer found a 500); after an
    assistant turn, that turn became a prefill and the answer went on with it (", 3" for "1, 2")."""
    count = [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1, 2"}]
    for messages, at in [([{"role": "user", "content": []}], 0), ([*count, {"role": "user", "content": []}], 2),
                         ([count[0], {"role": "assistant", "content": []}, {"role": "user", "content": "Go."}], 1)]:
        with pytest.raises(InvalidRequestError) as err:
            to_engine(_request(messages=messages))
        assert err.value.param == f"messages.{at}.content"
    assert not to_engine(_request(messages=[count[0], {"role": "assistant", "content": []}])).continue_final


@pytest.mark.parametrize(
    ("choice", "expected"),
    [(None, "auto"), ({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
     ({"type": "tool", "name": "Read"}, Named("Read")), ({"type": "none"}, "none")],
)
def test_tool_choice(choice, expected):
    read = {"name": "Read", "input_schema": {"type": "object"}}
    assert to_engine(_request(tool_choice=choice, tools=[read])).tool_choice == expected


@pytest.mark.parametrize(
    ("thinking", "enable", "budget"),
    [(None, None, None), ({"type": "enabled", "budget_tokens": 2048}, True, 2048),
     ({"type": "disabled", "budget_tokens": 10}, False, None), ({"type": "adaptive"}, None, None)],
)
def test_thinking(thinking, enable, budget):
    engine = to_engine(_request(thinking=thinking))
    assert (engine.enable_thinking, engine.thinking_budget) == (enable, budget)


def test_sampling_and_optional_max_tokens():
    assert to_engine(_request()).sampling.max_tokens is None
    s = to_engine(_request(max_tokens=64, stop_sequences=["\n\nHuman:"], temperature=1.0, top_k=5)).sampling
    assert (s.max_tokens, s.stop, s.temperature, s.top_k) == (64, ("\n\nHuman:",), 1.0, 5)


def test_ignored_fields():
    request = _request(metadata={"user_id": "u"}, output_config={"effort": "high"}, context_management={})
    assert request.ignored_fields() == ["context_management", "metadata", "output_config.effort"]


@pytest.mark.parametrize("system", ["", []])
def test_an_empty_system_is_an_empty_system_text_as_chats_is(system):
    """It keeps the template's default system text out (Qwen's "You are Qwen..."), as on Chat and Responses."""
    assert to_engine(_request(system=system)).messages[0] == Message("system", "")
    assert to_engine(_request()).messages[0].role == "user"


def test_a_messages_field_it_does_not_read_is_reported_as_chats_are():
    messages = [{"role": "user", "content": "Hi", "name": "ann", "cache": None}]
    assert _request(messages=messages).ignored_fields() == ["messages[].name"]


def test_count_tokens_request():
    request = parse(CountTokensRequest, {"messages": USER, "system": "S", "max_tokens": 5})
    engine = to_engine(request)
    assert [m.role for m in engine.messages] == ["system", "user"]
    assert engine.sampling.max_tokens is None
    assert request.ignored_fields() == ["max_tokens"]
    assert TokenCount(input_tokens=12).dump() == {"input_tokens": 12}
    assert sdk.MessageTokensCount.model_validate({"input_tokens": 12}).input_tokens == 12


def test_stream_events_validate_under_the_sdk():
    _, events = _stream(_request())
    for event in events:
        if event["type"] != "ping":
            SDK_EVENT.validate_python(event)


def test_stream_order():
    _, events = _stream(_request())
    kinds = [e["type"] + (":" + e["delta"]["type"] if e["type"] == "content_block_delta" else "") for e in events]
    assert kinds == [
        "message_start", "ping",
        "content_block_start", "content_block_delta:thinking_delta", "content_block_delta:signature_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta:text_delta", "content_block_delta:text_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta:input_json_delta", "content_block_delta:input_json_delta",
        "content_block_stop",
        "message_delta", "message_stop",
    ]
    start = events[0]["message"]
    assert (start["stop_reason"], start["stop_sequence"], start["content"]) == (None, None, [])
    assert start["model"] == "claude-x" and start["id"].startswith("msg_")
    assert events[4]["delta"] == {"type": "signature_delta", "signature": "mashbox-local"}
    assert events[10]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "Read", "input": {}}
    assert [e["index"] for e in events[2:14]] == [0] * 4 + [1] * 4 + [2] * 4
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 7, "output_tokens": 5, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 3}


def test_whole_message_validates_under_the_sdk():
    translator, _ = _stream(_request())
    body = translator.response().dump()
    assert "stop_sequence" in body and body["stop_sequence"] is None
    message = sdk.Message.model_validate(body)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].signature == "mashbox-local"
    assert message.content[1].text == "Hi!"
    assert (message.content[2].id, message.content[2].input) == ("toolu_abc", {"file_path": "a"})
    assert message.usage.input_tokens == 7 and message.usage.cache_read_input_tokens == 3
    assert message.model == "claude-x"


def test_model_defaults_to_the_served_id():
    translator, _ = _stream(parse(MessagesRequest, {"messages": USER}), [Finish("stop", USAGE, TIMINGS)])
    assert translator.response().model == "qwen"


@pytest.mark.parametrize(
    ("finish", "reason", "sequence"),
    [(Finish("stop", USAGE, TIMINGS), "end_turn", None),
     (Finish("stop", USAGE, TIMINGS, stop_sequence="END"), "stop_sequence", "END"),
     (Finish("length", USAGE, TIMINGS), "max_tokens", None),
     (Finish("tool_calls", USAGE, TIMINGS), "tool_use", None),
     (Finish("abort", USAGE, TIMINGS), "end_turn", None)],
)
def test_stop_reasons(finish, reason, sequence):
    translator, events = _stream(_request(), [TextDelta("x"), finish])
    assert events[-2]["delta"] == {"stop_reason": reason, "stop_sequence": sequence}
    body = translator.response().dump()
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)


def test_invalid_tool_arguments_give_an_empty_input():
    events = [ToolCallStart(0, "t", "Read"), ToolCallDelta(0, "not json"), Finish("tool_calls", USAGE, TIMINGS)]
    translator, _ = _stream(_request(), events)
    assert translator.response().dump()["content"][0]["input"] == {}


def test_error_event():
    translator, events = _stream(_request(), [TextDelta("x"), Finish("error", USAGE, TIMINGS, error="oom")])
    message_id = events[0]["message"]["id"]
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "oom"}, "request_id": message_id}
    assert translator.error("gone")[0].dump()["error"]["message"] == "gone"
    sdk.ErrorResponse.model_validate(events[-1])
