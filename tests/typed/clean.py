"""Typed use of ``Engine`` that a type checker must pass (tests/test_typing.py runs mypy on it)."""

from collections.abc import AsyncIterator, Iterator
from typing import Any, assert_type

from mashbox import Engine
from mashbox.api.anthropic_messages import AnthropicMessage, TokenCount
from mashbox.api.anthropic_messages import StreamEvent as MessageEvent
from mashbox.api.openai_chat import ChatCompletion, ChatCompletionChunk
from mashbox.api.openai_completions import Completion
from mashbox.api.openai_responses import Response
from mashbox.api.openai_responses import StreamEvent as ResponseEvent

HI = [{"role": "user", "content": "hi"}]


def whole_answers(engine: Engine) -> str:
    chat = engine.chat(messages=HI, max_tokens=8, temperature=0.0, stop=["\n"], tool_choice="auto")
    assert_type(chat, ChatCompletion)
    text: str | None = chat.choices[0].message.content
    completion = engine.complete(prompt="Once upon a time", max_tokens=8, seed=1)
    assert_type(completion, Completion)
    response = engine.respond(input="hi", instructions="Be brief.", max_output_tokens=16, reasoning={"effort": "none"})
    assert_type(response, Response)
    message = engine.message(messages=HI, max_tokens=8, system="Be brief.", stream=False)
    assert_type(message, AnthropicMessage)
    assert_type(engine.count_tokens(messages=HI), TokenCount)
    return f"{text} {completion.choices[0].text} {response.status} {message.stop_reason}"


def streams(engine: Engine) -> int:
    chunks = engine.chat(messages=HI, stream=True, stream_options={"include_usage": True})
    assert_type(chunks, Iterator[ChatCompletionChunk])
    pieces = [c.choices[0].delta.content for c in chunks if c.choices]
    assert_type(engine.complete(prompt="a", stream=True), Iterator[Completion])
    assert_type(engine.respond(input="hi", stream=True), Iterator[ResponseEvent])
    assert_type(engine.message(messages=HI, max_tokens=8, stream=True), Iterator[MessageEvent])
    return len(pieces)


def either(engine: Engine, stream: bool, body: dict[str, Any]) -> None:
    assert_type(engine.chat(messages=HI, stream=stream), ChatCompletion | Iterator[ChatCompletionChunk])
    assert_type(engine.chat(body), ChatCompletion | Iterator[ChatCompletionChunk])  # a request as a dict
    assert_type(engine.respond(body), Response | Iterator[ResponseEvent])


async def async_twins(engine: Engine) -> None:
    assert_type(await engine.achat(messages=HI), ChatCompletion)
    assert_type(await engine.achat(messages=HI, stream=True), AsyncIterator[ChatCompletionChunk])
    assert_type(await engine.acomplete(prompt="a"), Completion)
    assert_type(await engine.acomplete(prompt="a", stream=True), AsyncIterator[Completion])
    assert_type(await engine.arespond(input="hi"), Response)
    assert_type(await engine.arespond(input="hi", stream=True), AsyncIterator[ResponseEvent])
    assert_type(await engine.amessage(messages=HI, max_tokens=8), AnthropicMessage)
    assert_type(await engine.amessage(messages=HI, max_tokens=8, stream=True), AsyncIterator[MessageEvent])
    async for chunk in await engine.achat(messages=HI, stream=True):
        print(chunk.choices[0].delta.content if chunk.choices else "")


def in_a_with_block() -> str | None:
    with Engine(quiet=True) as engine:  # __enter__ gave the base class, which has no chat()
        assert_type(engine, Engine)
        return engine.chat(messages=HI, max_tokens=8).choices[0].message.content
