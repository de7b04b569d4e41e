"""Completions: a plain prompt in, text_completion objects out."""

from __future__ import annotations

import openai.types as sdk
import pytest
from translation import translate

from mashbox.api.base import parse
from mashbox.api.openai_completions import CompletionRequest, Translator, to_engine
from mashbox.engine.events import Finish, ReasoningDelta, TextDelta, Timings, Usage

TIMINGS = Timings(prompt_n=4, prompt_ms=2.0, predicted_n=2, predicted_ms=1.0, cache_n=0, queue_ms=0.0)
USAGE = Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=3)


def _run(request: CompletionRequest, events) -> tuple[Translator, list[dict]]:
    translator = Translator(request, "smol")
    return translator, translate(translator, events)


@pytest.mark.parametrize("prompt", ["The planets are", ["The planets are"]])
def test_prompt_is_a_string_or_a_list_of_one(prompt):
    engine = to_engine(parse(CompletionRequest, {"prompt": prompt, "max_tokens": 8, "stop": "\n"}))
    assert (engine.prompt, engine.messages) == ("The planets are", None)
    assert (engine.sampling.max_tokens, engine.sampling.stop) == (8, ("\n",))


def test_max_completion_tokens_wins():
    engine = to_engine(parse(CompletionRequest, {"prompt": "a", "max_tokens": 8, "max_completion_tokens": 3}))
    assert engine.sampling.max_tokens == 3


def test_stream_and_response():
    request = parse(CompletionRequest, {"prompt": "a", "seed": 7})
    events = [ReasoningDelta("ignored"), TextDelta("b"), TextDelta("c"), Finish("length", USAGE, TIMINGS)]
    translator, objects = _run(request, events)
    assert [o["choices"][0]["text"] for o in objects] == ["b", "c", ""]
    assert [o["choices"][0]["finish_reason"] for o in objects] == [None, None, "length"]
    assert all(o["object"] == "text_completion" and "usage" not in o for o in objects)
    assert len({o["id"] for o in objects}) == 1 and objects[0]["id"].startswith("cmpl-")
    sdk.Completion.model_validate(objects[-1])
    body = translator.response().dump()
    completion = sdk.Completion.model_validate(body)
    assert completion.choices[0].text == "bc" and completion.choices[0].finish_reason == "length"
    assert completion.usage.total_tokens == 6
    assert completion.usage.prompt_tokens_details.cached_tokens == USAGE.cached_tokens  # as every usage block
    assert completion.system_fingerprint == "seed-7"


@pytest.mark.parametrize("reason", ["stop", "tool_calls", "abort"])
def test_other_finish_reasons_are_stop(reason):
    translator, _ = _run(parse(CompletionRequest, {"prompt": "a"}), [Finish(reason, USAGE, TIMINGS)])
    body = translator.response().dump()
    assert body["choices"][0]["finish_reason"] == "stop" and "system_fingerprint" not in body


def test_error_object():
    translator, objects = _run(parse(CompletionRequest, {"prompt": "a"}), [Finish("error", USAGE, TIMINGS)])
    assert objects[-1]["error"]["type"] == "server_error"
    assert translator.error("x")[0].dump()["error"]["message"] == "x"
