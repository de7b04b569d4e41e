"""Every refused request names its field: one row per rule, as (route, body change, param)."""

from __future__ import annotations

import sys

import pytest
from translation import USER

from mashbox.api.anthropic_messages import CountTokensRequest, MessagesRequest
from mashbox.api.base import parse
from mashbox.api.openai_chat import ChatRequest
from mashbox.api.openai_completions import CompletionRequest
from mashbox.api.openai_responses import ResponsesRequest
from mashbox.errors import InvalidRequestError

BASE = {
    "chat": (ChatRequest, {"messages": USER}),
    "completions": (CompletionRequest, {"prompt": "hi"}),
    "messages": (MessagesRequest, {"messages": USER, "max_tokens": 8}),
    "count": (CountTokensRequest, {"messages": USER}),
    "responses": (ResponsesRequest, {"input": "hi"}),
}
SAMPLING = [
    ({"temperature": 4.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.0}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 2}, "n"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),  # each is looked for after every token, in the shared step
    ({"stop_sequences": ["s"] * 65}, "stop_sequences"),
    ({"seed": "x"}, "seed"),
    ({"seed": 2**64 + 5}, "seed"),  # drew as seed 5 did
    ({"seed": -2**63 - 1}, "seed"),
    ({"max_tokens": "5"}, "max_tokens"),  # strict types, as OpenAI's and Anthropic's: no guessing
    ({"max_tokens": 5.5}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"seed": True}, "seed"),
    ({"stream": 1}, "stream"),
    ({"stream": "true"}, "stream"),
]
ROWS = [
    *[(route, change, param) for route in ("chat", "completions", "messages", "responses")
      for change, param in SAMPLING],
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": None}, "messages"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.1.type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages.0.content.0.type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     "messages.0.content.0.type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content.0.type"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("chat", {"messages": [{"content": "x"}]}, "messages.0.role"),
    ("chat", {"messages": [{"role": "user", "text": "x"}]}, "messages.0.content"),
    ("chat", {"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages.0.content"),
    ("chat", {"tool_choice": "sometimes"}, "tool_choice"),
    ("chat", {"tools": [{"type": "function"}]}, "tools.0.function"),
    ("chat", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ("chat", {"tool_choice": {"type": "function"}}, "tool_choice.function"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"logprobs": 0}, "logprobs"),
    ("completions", {"logprobs": 5}, "logprobs"),
    ("messages", {"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
    ("messages", {"output_format": {"type": "json_schema", "schema": {}}}, "output_format"),  # the beta's name
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0.source"),  # a PDF's; a text document's is read
    ("messages", {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0"),  # a block of another role's was left out unsaid
    ("messages", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "messages.1"),
    ("messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]},
     "messages.0.content.0.content.0.type"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t"}]}]},
     "messages.0.content.0.name"),
    ("messages", {"thinking": {"type": "sometimes"}}, "thinking.type"),
    ("messages", {"tool_choice": {"type": "maybe"}}, "tool_choice.type"),
    ("count", {"messages": []}, "messages"),
    ("count", {"system": [{"type": "image", "source": {}}]}, "system.0.type"),
    ("responses", {"input": None}, "input"),
    ("responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {"top_logprobs": 1}, "top_logprobs"),
    ("responses", {"include": ["message.output_text.logprobs"]}, "include"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ("responses", {"max_output_tokens": 0}, "max_output_tokens"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "c",
                              "output": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.output.0.type"),
    ("responses", {"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ("responses", {"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
    ("responses", {"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input.0.role"),
    ("responses", {"tools": [{"type": "function"}]}, "tools.0.name"),
    # a Chat tool sent to Responses: its "function" key is no step to the name it lacks (was tools.0.function.name)
    ("responses", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.name"),
    ("chat", {"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    ("responses", {"reasoning": {"effort": 3}}, "reasoning.effort"),
    ("responses", {"reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    ("messages", {"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ("messages", {"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ("count", {"tools": [{"name": "f", "type": "custom"}]}, "tools.0.input_schema"),
]
TO_ENGINE = [  # refused when the request becomes the engine's
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("messages", {"tool_choice": {"type": "any"}}, "tool_choice"),
    ("responses", {"tool_choice": "required"}, "tool_choice"),
]


def _id(row) -> str:
    route, change, param = row
    return f"{route}-{param}-{next(iter(change.values()))!r:.20}"


@pytest.mark.parametrize("row", ROWS, ids=[_id(r) for r in ROWS])
def test_refused_request_names_the_field(row):
    route, change, param = row
    model_cls, body = BASE[route]
    with pytest.raises(InvalidRequestError) as err:
        parse(model_cls, {**body, **change})
    assert err.value.param == param, err.value.message
    assert err.value.message and "Value error" not in err.value.message


@pytest.mark.parametrize("row", TO_ENGINE, ids=[_id(r) for r in TO_ENGINE])
def test_a_call_asked_for_with_no_tools_is_refused(row):
    route, change, param = row
    model_cls, body = BASE[route]
    module = sys.modules[model_cls.__module__]
    with pytest.raises(InvalidRequestError) as err:
        module.to_engine(parse(model_cls, {**body, **change}))
    assert err.value.param == param and "no tools" in err.value.message


@pytest.mark.parametrize(
    ("route", "change"),
    [("chat", {"logprobs": False}), ("chat", {"response_format": {"type": "text"}}),
     ("chat", {"n": 1, "stop": ["a"], "max_tokens": 1}), ("completions", {"logprobs": None}),
     ("responses", {"text": {"format": {"type": "text"}}, "include": ["reasoning.encrypted_content"]}),
     ("responses", {"previous_response_id": None}), ("messages", {"output_config": {"effort": "low"}}),
     ("messages", {"temperature": 0, "top_p": 1, "min_p": 0, "top_k": 0}),
     ("chat", {"temperature": 1, "top_p": 1, "frequency_penalty": 0}),  # a whole number is a number
     ("responses", {"temperature": 1, "top_p": 1, "max_output_tokens": 7})],
)
def test_accepted_edge_values(route, change):
    model_cls, body = BASE[route]
    parse(model_cls, {**body, **change})



@pytest.mark.parametrize("route", ["chat", "completions", "messages", "responses"])
def test_stream_null_is_an_answer_not_streamed(route):
    """``"stream": null`` (OpenAI's schema has it nullable; proxies send explicit nulls) is false."""
    model_cls, body = BASE[route]
    assert parse(model_cls, {**body, "stream": None}).stream is False
    assert parse(model_cls, {**body, "stream": True}).stream is True

def test_unsupported_part_message_says_why():
    with pytest.raises(InvalidRequestError, match="text-only model"):
        parse(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})


def test_unknown_type_message_lists_the_known_ones():
    with pytest.raises(InvalidRequestError, match="unknown type 'web_search_call'; expected one of") as err:
        parse(ResponsesRequest, {"input": [{"type": "web_search_call", "id": "x"}]})
    assert "'function_call_output'" in err.value.message and "'output'" not in err.value.message  # no inner tag


def test_what_this_server_does_not_keep_is_refused_saying_what_to_send_instead():
    with pytest.raises(InvalidRequestError) as err:
        parse(ResponsesRequest, {"input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_1"}]})
    assert (err.value.param, err.value.code) == ("input.1.type", "unsupported_value")
    assert err.value.message.startswith("this server keeps no items, so an item_reference ('msg_1') cannot refer")
    assert "send the items themselves in input" in err.value.message and "store: false" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        parse(ResponsesRequest, {"input": "hi", "previous_response_id": "resp_1"})
    assert (err.value.param, err.value.code) == ("previous_response_id", "unsupported_parameter")
    assert "previous_response_id cannot refer to one" in err.value.message
    for field, value in (("conversation", "conv_1"), ("conversation", {"id": "conv_1"}), ("prompt", {"id": "pmpt_1"})):
        with pytest.raises(InvalidRequestError) as err:  # were ignored: the answer lacked what they refer to
            parse(ResponsesRequest, {"input": "What did I say?", field: value})
        assert (err.value.param, err.value.code) == (field, "unsupported_parameter")
        assert f"keeps no {field}s, so {field} cannot refer to one" in err.value.message
    parse(ResponsesRequest, {"input": "hi", "conversation": None, "prompt": None})
    assert parse(ResponsesRequest, {"input": "hi", "prompt": "x"}).ignored_fields() == ["prompt"]  # no stored one's


def test_structured_output_on_messages_is_refused_without_naming_a_value_it_refuses_too():
    """Messages refused {"type": "text"} saying that only {'type': 'text'} was accepted (the OpenAI routes' words)."""
    model_cls, body = BASE["messages"]
    with pytest.raises(InvalidRequestError) as err:
        parse(model_cls, {**body, "output_config": {"format": {"type": "text"}}})
    assert err.value.param == "output_config.format" and "leave it out" in err.value.message
    assert "'type': 'text'} is accepted" not in err.value.message
