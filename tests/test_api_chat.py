"""Chat Completions: request -> EngineRequest, engine events -> chunks and ChatCompletion."""

from __future__ import annotations

import openai.types.chat as sdk
import pytest
from translation import TIMINGS, USER, translate

from mashbox.api.base import parse
from mashbox.api.openai_chat import ChatRequest, Translator, to_engine
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

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=3, reasoning_tokens=1)
ANSWER = [
    ReasoningDelta("think"),
    TextDelta("Hel"),
    TextDelta("lo"),
    ToolCallStart(0, "abc", "read"),
    ToolCallDelta(0, '{"path":'),
    ToolCallDelta(0, ' "a"}'),
    ToolCallEnd(0),
    ToolCallStart(1, "call_def", "bash"),
    ToolCallEnd(1),
    Finish("tool_calls", USAGE, TIMINGS),
]


def _request(**fields) -> ChatRequest:
    return parse(ChatRequest, {"messages": USER, **fields})


def _stream(request: ChatRequest, events=ANSWER) -> tuple[Translator, list[dict]]:
    translator = Translator(request, "qwen")
    return translator, translate(translator, events)


def test_messages_map_to_canonical_roles():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "developer", "content": "d"},
        {"role": "assistant", "content": None, "reasoning_content": "r",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "assistant", "content": "done", "reasoning": "r2"},
    ]
    engine = to_engine(parse(ChatRequest, {"messages": messages}))
    assert engine.messages == (
        Message("system", "s"),
        Message("user", "a\nb"),
        Message("system", "d"),
        Message("assistant", "", tool_calls=(ToolCall("c1", "f", "{}"),), reasoning="r"),
        Message("tool", "out", tool_call_id="c1"),
        Message("assistant", "done", reasoning="r2"),
    )


def test_the_sdks_dumped_assistant_messages_keep_their_refusal_and_deprecated_function_calls():
    """An assistant ``refusal`` is the turn's text; a ``function_call`` a tool call that the ``function``
    message of its name answers (both were dropped: the model saw a result of no call); others reported."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": '{"city": "Paris"}'},
         "refusal": None, "annotations": [], "audio": None},
        {"role": "function", "name": "weather", "content": "Sunny"},
        {"role": "assistant", "content": None, "refusal": "I cannot help with that.", "audio": {"id": "audio_1"}},
    ]
    request = parse(ChatRequest, {"messages": messages})
    assert to_engine(request).messages[1:] == (
        Message("assistant", "", tool_calls=(ToolCall("call_1", "weather", '{"city": "Paris"}'),)),
        Message("tool", "Sunny", tool_call_id="call_1"),
        Message("assistant", "I cannot help with that."),
    )
    assert request.ignored_fields() == ["messages[].audio"]
    both = {"role": "assistant", "content": "Partly.", "refusal": "Not the rest."}
    assert to_engine(parse(ChatRequest, {"messages": [both]})).messages[0].content == "Partly.\nNot the rest."
    for role in ("user", "system", "tool", "function"):  # dropped (or, on a user's, rendered as a call)
        for field, value in (("refusal", "No."), ("function_call", {"name": "f", "arguments": "{}"})):
            with pytest.raises(InvalidRequestError, match="is an assistant message's") as err:
                parse(ChatRequest, {"messages": [{"role": role, "content": "x", "name": "f", field: value}]})
            assert err.value.param == f"messages.0.{field}"


def test_tool_call_arguments_given_as_an_object_become_json():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    engine = to_engine(parse(ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [call]}]}))
    assert engine.messages[0].tool_calls[0].arguments == '{"a": 1}'


def test_tools_and_tool_choice():
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}},
             {"type": "web_search"}]
    request = _request(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    engine = to_engine(request)
    assert [(t.name, t.description, t.parameters) for t in engine.tools] == [("f", "d", {"type": "object"})]
    assert engine.tool_choice == Named("f")
    assert request.ignored_fields() == ["tools[web_search]"]
    assert to_engine(_request(tools=tools, tool_choice="required")).tool_choice == "required"
    assert to_engine(_request()).tool_choice == "auto"


@pytest.mark.parametrize(
    ("fields", "thinking"),
    [({}, None), ({"enable_thinking": False}, False),
     ({"chat_template_kwargs": {"enable_thinking": True}}, True),
     ({"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True}, False)],
)
def test_enable_thinking(fields, thinking):
    assert to_engine(_request(**fields)).enable_thinking is thinking


@pytest.mark.parametrize("value", ["false", 0, [1], {"a": 1}])
def test_enable_thinking_in_template_kwargs_is_typed(value):
    """It was taken as it came: the string "false" turned thinking on (the engine reads "not False")."""
    with pytest.raises(InvalidRequestError) as err:
        _request(chat_template_kwargs={"enable_thinking": value})
    assert err.value.param == "chat_template_kwargs.enable_thinking"
    assert _request(chat_template_kwargs={"enable_thinking": None, "x": 1}).ignored_fields() == ["chat_template_kwargs.x"]


def test_sampling_fields():
    request = _request(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=3, repetition_penalty=1.1,
                       frequency_penalty=0.5, presence_penalty=-0.5, max_tokens=10,
                       max_completion_tokens=20, stop="END", n=1)
    s = to_engine(request).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 20, 0.05, 3)
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.1, 0.5, -0.5)
    assert (s.max_tokens, s.stop) == (20, ("END",))


def test_sampling_defaults_and_stop_sequences():
    s = to_engine(_request(stop_sequences=["a", "b"], max_tokens=9)).sampling
    assert (s.temperature, s.max_tokens, s.stop) == (0.0, 9, ("a", "b"))
    assert to_engine(_request(stop=["x"], stop_sequences=["y"])).sampling.stop == ("x",)


def test_stream_chunks_validate_under_the_sdk():
    _, chunks = _stream(_request(stream=True))
    for chunk in chunks:
        sdk.ChatCompletionChunk.model_validate(chunk)
    ids = {chunk["id"] for chunk in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")


def test_stream_order():
    _, chunks = _stream(_request(stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"reasoning_content": "think", "reasoning": "think"}
    assert [d.get("content") for d in deltas[2:4]] == ["Hel", "lo"]
    first_call = deltas[4]["tool_calls"][0]
    assert first_call == {"index": 0, "id": "call_abc", "type": "function",
                          "function": {"name": "read", "arguments": ""}}
    assert deltas[5]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"path":'}}
    assert deltas[7]["tool_calls"][0]["id"] == "call_def"
    assert deltas[7]["tool_calls"][0]["index"] == 1
    last = chunks[-1]
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)  # OpenAI's null, on every choice
    assert last["timings"]["cache_n"] == 3 and "usage" not in last
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stream_usage_chunk_when_asked():
    _, chunks = _stream(_request(stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 3},
        "completion_tokens_details": {"reasoning_tokens": 1, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }
    assert usage["timings"] == chunks[-2]["timings"]
    sdk.ChatCompletionChunk.model_validate(usage)


def test_timings_are_llama_server_fields():
    _, chunks = _stream(_request())
    assert chunks[-1]["timings"] == {
        "prompt_n": 7, "prompt_ms": 14.0, "prompt_per_second": 500.0, "predicted_n": 5,
        "predicted_ms": 20.0, "predicted_per_second": 200.0, "cache_n": 3, "queue_ms": 0.5,
    }


def test_whole_response_validates_under_the_sdk():
    translator, _ = _stream(_request())
    body = translator.response().dump()
    completion = sdk.ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert completion.id.startswith("chatcmpl-") and completion.model == "qwen"
    assert message.content == "Hello"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_abc", "read", '{"path": "a"}'), ("call_def", "bash", "{}")]
    assert body["choices"][0]["message"]["reasoning_content"] == "think"
    assert body["choices"][0]["logprobs"] is None and completion.choices[0].logprobs is None
    assert completion.usage.prompt_tokens_details.cached_tokens == 3
    assert body["timings"]["predicted_n"] == 5


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("stop", "stop"), ("length", "length"), ("tool_calls", "tool_calls"), ("abort", "stop")],
)
def test_finish_reasons(reason, expected):
    translator, chunks = _stream(_request(), [TextDelta("x"), Finish(reason, USAGE, TIMINGS)])
    assert chunks[-1]["choices"][0]["finish_reason"] == expected
    assert translator.response().dump()["choices"][0]["finish_reason"] == expected


def test_content_is_empty_text_without_tool_calls():
    translator, _ = _stream(_request(), [Finish("stop", USAGE, TIMINGS)])
    assert translator.response().dump()["choices"][0]["message"]["content"] == ""


def test_error_chunk_ends_a_failed_stream():
    translator, _ = _stream(_request(), [TextDelta("x")])
    [chunk] = translator.error("device lost")
    assert chunk.dump()["error"] == {"message": "device lost", "type": "server_error", "request_id": chunk.id}
    _, chunks = _stream(_request(), [Finish("error", USAGE, TIMINGS, error="boom")])
    assert chunks[-1]["error"]["message"] == "boom"
