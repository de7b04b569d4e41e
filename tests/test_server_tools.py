"""Agent round trips over HTTP on the embedded model, with the official SDKs (strict):
a forced get_weather call, the result sent back, a text answer; streamed calls assembled by
the SDKs' stream helpers equal the non-streamed ones."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
ASK = "What is the weather in Paris? Use the tool."
RESULT = "Sunny, 21 degrees Celsius."


def city_of(arguments: str | dict) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert set(args) == {"city"} and isinstance(args["city"], str)
    return args["city"]


def test_chat_round_trip(oai):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": PARAMETERS}}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": ASK}]
    first = oai.chat.completions.create(model="smollm2-135m", messages=messages, tools=tools, tool_choice=forced, max_tokens=60)
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    city_of(call.function.arguments)
    with oai.chat.completions.stream(model="smollm2-135m", messages=messages, tools=tools, tool_choice=forced,
                                     max_tokens=60) as stream:
        streamed = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls] == [
        (call.function.name, call.function.arguments)]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = oai.chat.completions.create(model="smollm2-135m", messages=messages, tools=tools, max_tokens=40)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_messages_round_trip(claude):
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMETERS}]
    forced = {"type": "tool", "name": "get_weather"}
    messages = [{"role": "user", "content": ASK}]
    first = claude.messages.create(model="m", max_tokens=60, messages=messages, tools=tools, tool_choice=forced)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    city_of(use.input)
    with claude.messages.stream(model="m", max_tokens=60, messages=messages, tools=tools,
                                tool_choice=forced) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    answer = claude.messages.create(model="m", max_tokens=40, messages=messages, tools=tools)
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text


def test_responses_round_trip(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
              "parameters": PARAMETERS, "strict": False}]
    forced = {"type": "function", "name": "get_weather"}
    first = oai.responses.create(model="smollm2-135m", input=ASK, tools=tools, tool_choice=forced, max_output_tokens=60)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    city_of(call.arguments)
    with oai.responses.stream(model="smollm2-135m", input=ASK, tools=tools, tool_choice=forced,
                              max_output_tokens=60) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == [
        (call.name, call.arguments)]
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    answer = oai.responses.create(model="smollm2-135m", input=history, tools=tools, max_output_tokens=40)
    assert answer.output_text


CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": PARAMETERS}}]


def test_required_without_parallel_calls_gives_one_call_and_ends(oai, claude):
    """tool_choice required with parallel calls off: exactly one call, finished as a tool call, on
    all three protocols (the embedded model, left free, writes the same call again)."""
    messages = [{"role": "user", "content": ASK}]
    chat = oai.chat.completions.create(model="smollm2-135m", messages=messages, tools=CHAT_TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=150)
    (call,) = chat.choices[0].message.tool_calls
    assert chat.choices[0].finish_reason == "tool_calls" and not chat.choices[0].message.content
    city_of(call.function.arguments)

    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": False}]
    response = oai.responses.create(model="smollm2-135m", input=ASK, tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=150)
    (item,) = response.output
    assert item.type == "function_call" and response.status == "completed" and response.parallel_tool_calls is False

    message = claude.messages.create(model="m", max_tokens=150, messages=messages, tool_choice={
        "type": "any", "disable_parallel_tool_use": True},
        tools=[{"name": "get_weather", "input_schema": PARAMETERS}])
    (use,) = message.content
    assert use.type == "tool_use" and message.stop_reason == "tool_use"


def test_a_forced_call_cut_by_max_tokens_leaves_no_markup_in_the_text(oai):
    for max_tokens in (20, 30, 45, 50):  # cut inside a call's JSON, inside its opening tag, ... (by 55 the
        # embedded model has written the same call twice, and a repeat ends the answer: tool_calls)
        chat = oai.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": ASK}],
                                           tools=CHAT_TOOLS, tool_choice="required", parallel_tool_calls=True,
                                           max_tokens=max_tokens)
        choice = chat.choices[0]
        assert choice.finish_reason == "length"
        assert not choice.message.content, (max_tokens, choice.message.content)


ENDLESS = {"type": "object", "properties": {"t": {"$ref": "#/$defs/n"}}, "required": ["t"],  # no finite instance
           "$defs": {"n": {"type": "object", "properties": {"l": {"$ref": "#/$defs/n"}, "r": {"$ref": "#/$defs/n"}},
                           "required": ["l", "r"]}}}


def test_a_grammar_that_cannot_go_on_fails_the_request_naming_the_tools(oai, claude):
    """llguidance compiles this schema, then meets its item limit a few tokens in and allows only the end:
    the forced call ended as a plain answer with no call (200, finish_reason stop), on every protocol."""
    messages = [{"role": "user", "content": "Call f."}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": ENDLESS}}]
    with pytest.raises(openai.BadRequestError, match="cannot be enforced") as err:
        oai.chat.completions.create(model="smollm2-135m", messages=messages, tools=tools, tool_choice="required",
                                    max_tokens=64)
    assert err.value.body["param"] == "tools"
    with pytest.raises(anthropic.BadRequestError, match="cannot be enforced"):
        claude.messages.create(model="m", max_tokens=64, messages=messages, tool_choice={"type": "any"},
                               tools=[{"name": "f", "input_schema": ENDLESS}])
    assert "<state>" not in str(err.value) and "Too many items" in str(err.value)  # why, not the parser's dump
    with pytest.raises(openai.APIError, match="cannot be enforced"):  # the stream's error chunk
        list(oai.chat.completions.create(model="smollm2-135m", messages=messages, tools=tools, tool_choice="required",
                                         max_tokens=64, stream=True))


def test_two_tools_of_one_name_are_refused_on_every_protocol(oai, claude):
    """Each was answered with a call held to whichever schema came first: the client could not tell which
    of its two tools was meant (Anthropic's API, and the tasks API here, refuse such a list)."""
    zip_code = {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}
    messages = [{"role": "user", "content": ASK}]
    with pytest.raises(openai.BadRequestError, match="two tools are named 'get_weather'") as err:
        oai.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=8, tools=[
            {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
            {"type": "function", "function": {"name": "get_weather", "parameters": zip_code}}])
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="two tools are named 'get_weather'"):
        oai.responses.create(model="smollm2-135m", input=ASK, max_output_tokens=16, tools=[
            {"type": "function", "name": "get_weather", "parameters": PARAMETERS},
            {"type": "function", "name": "get_weather", "parameters": zip_code}])
    with pytest.raises(anthropic.BadRequestError, match="two tools are named 'get_weather'"):
        claude.messages.create(model="m", max_tokens=8, messages=messages, tools=[
            {"name": "get_weather", "input_schema": PARAMETERS}, {"name": "get_weather", "input_schema": zip_code}])


def test_a_forced_call_whose_arguments_hold_its_closing_tag_is_that_call(oai):
    """A file's text an agent writes may hold `</tool_call>`: the call ended there and came back as text."""
    text = {"type": "object", "properties": {"text": {"const": "a</tool_call>b"}}, "required": ["text"]}
    tools = [{"type": "function", "function": {"name": "save", "parameters": text}}]
    answer = oai.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Save it."}],
                                         tools=tools, tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=60)
    assert answer.choices[0].finish_reason == "tool_calls", answer
    assert json.loads(answer.choices[0].message.tool_calls[0].function.arguments) == {"text": "a</tool_call>b"}
