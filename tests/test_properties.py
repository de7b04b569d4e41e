"""Properties of the streaming text machines and the translators on arbitrary input (hypothesis):
however a text is cut into pieces, the same events come out; nothing is lost or invented; every
translator turns any event sequence into an answer its protocol's SDK accepts."""

from __future__ import annotations

import json

import anthropic.types as claude_types
import openai.types.chat as chat_types
from hypothesis import given, settings
from hypothesis import strategies as st
from test_markup import coalesce

from mashbox.api import anthropic_messages, openai_chat
from mashbox.api.base import parse
from mashbox.engine.events import (
    Finish,
    ReasoningDelta,
    Started,
    TextDelta,
    Timings,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from mashbox.engine.text.markup import Markup
from mashbox.engine.text.stop import StopMatcher

# Text rich in the machines' own markers, so that tags and stops are cut in every way.
ALPHABET = st.sampled_from(["a", " ", "\n", "<", ">", "/", "tool_call", "think", "{", "}", '"', "é", "STOP", "ST"])
TEXT = st.lists(ALPHABET, max_size=40).map("".join)


def pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def run_markup(parts: list[str], **options) -> list[tuple]:
    machine = Markup(**options)
    return coalesce([e for p in parts for e in machine.push(p)] + machine.flush())


@settings(max_examples=300, deadline=None)
@given(TEXT, st.lists(st.integers(0, 60), max_size=8), st.booleans(), st.booleans())
def test_markup_gives_the_same_events_however_the_text_is_cut(text, cuts, think, forced):
    options = {"think": think, "cut_calls_are_text": not forced}
    assert run_markup(pieces(text, cuts), **options) == run_markup([text], **options)


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_markup_without_tags_loses_and_invents_nothing(text):
    events = run_markup([text], calls=None)
    assert "".join(e[1] for e in events) == text


@settings(max_examples=300, deadline=None)
@given(TEXT, st.lists(st.integers(0, 60), max_size=8), st.lists(st.sampled_from(["STOP", "ST", "\n\n", "é>"]),
                                                                 max_size=3))
def test_stop_strings_cut_the_text_at_the_first_match_however_it_is_cut(text, cuts, stops):
    machine = StopMatcher(tuple(stops))
    out = "".join(machine.push(p) for p in pieces(text, cuts)) + machine.flush()
    found = [text.find(s) for s in stops if s in text]
    assert out == (text[: min(found)] if found else text)


EVENT = st.one_of(
    TEXT.map(TextDelta), TEXT.map(ReasoningDelta), st.just(Started(0)),
    st.tuples(st.sampled_from(["get_weather", "f"]), st.dictionaries(st.sampled_from(["a", "city"]), TEXT))
    .map(lambda c: [ToolCallStart(0, "call_1", c[0]), ToolCallDelta(0, json.dumps(c[1])), ToolCallEnd(0)]),
)
FINISH = st.builds(lambda reason: Finish(reason, Usage(5, 3), Timings(5, 1.0, 3, 2.0, 0, 0.0)),
                   st.sampled_from(["stop", "length", "tool_calls"]))


def flat(events) -> list:
    return [x for e in events for x in (e if isinstance(e, list) else [e])]


@settings(max_examples=150, deadline=None)
@given(st.lists(EVENT, max_size=8), FINISH)
def test_any_event_sequence_is_an_answer_the_sdks_accept(events, finish):
    sequence = [*flat(events), finish]
    chat = openai_chat.Translator(parse(openai_chat.ChatRequest, {"messages": [{"role": "user", "content": "x"}]}), "m")
    for e in sequence:
        for chunk in chat.feed(e):
            chat_types.ChatCompletionChunk.model_validate(chunk.dump())
    chat_types.ChatCompletion.model_validate(chat.response().dump())
    request = parse(anthropic_messages.MessagesRequest, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9})
    message = anthropic_messages.Translator(request, "m")
    for e in sequence:
        message.feed(e)
    claude_types.Message.model_validate(message.response().dump())
