"""Speculation from the prompt: proposals taken from a request's own text, checked in one step, give
exactly the tokens greedy decoding gives one step at a time, on the real SmolLM2, with stops, limits,
tool calls and several requests at once; and they are taken (fewer steps where an answer copies)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mashbox import Engine
from mashbox.engine.sched.draft import MOST, REST, START, Drafts

SOURCE = (Path(__file__).parent.parent / "mashbox" / "engine" / "sched" / "draft.py").read_text()[:2400]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


PROMPTS = [  # (messages, extra request fields)
    (ask(f"Here is a file:\n```python\n{SOURCE}\n```\nWrite the whole file out again, unchanged."), {}),
    (ask(f"```python\n{SOURCE}\n```\nRename the class Drafts to Proposals and show the whole file."), {}),
    (ask(f"{SOURCE}\n\nRepeat the text above, then say what it does."), {"max_tokens": 17}),
    (ask(f"```python\n{SOURCE}\n```\nCopy the code."), {"stop": ["def "]}),
    (ask("Write a short poem about the sea, with a title."), {}),
    (ask("List the numbers from 1 to 40, one a line."), {}),
    (ask(f"{SOURCE}\nWhat is the weather in Paris? Use the tool."), {"tools": [WEATHER]}),
    (ask("Say hello."), {"max_tokens": 1}),
]


@pytest.fixture(scope="module")
def spec_engine():
    with Engine("smollm2-135m", ctx=2048, slots=4, quiet=True, speculation=True) as engine:
        yield engine


def answer(engine: Engine, messages: list[dict], fields: dict):
    out = engine.chat(messages=messages, **{"max_tokens": 160, **fields})
    choice = out.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason, out.usage.completion_tokens


def test_proposals_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    drafts = Drafts([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    assert drafts.propose(3) == (4, 5, 6)  # after the latest earlier "1 2 3" (not the first one)
    drafts.add(4)  # "2 3 4" now: what followed it
    assert drafts.propose(100) == (5, 6, 7, 8)[:START]
    assert Drafts([5, 6, 7]).propose(4) == ()  # nothing occurred before
    assert drafts.propose(0) == ()


def test_the_size_proposed_grows_with_hits_and_rests_after_misses():
    drafts = Drafts(list(range(50)) * 3)
    drafts.record(START, START)
    assert drafts.size == 2 * START
    for _ in range(4):
        drafts.record(drafts.size, drafts.size)
    assert drafts.size == MOST
    drafts.record(MOST, 3)
    assert drafts.size == 4  # what was taken, and one more
    drafts.record(4, 0)
    assert drafts.propose(10) != ()  # one miss: still proposing, fewer
    drafts.record(2, 0)
    assert drafts.propose(10) == ()  # two in a row: rest
    for token in range(REST):
        drafts.add(token)
    assert drafts.propose(10) != ()


def test_speculation_gives_exactly_the_greedy_answer(smol_engine, spec_engine):
    for messages, fields in PROMPTS:
        assert answer(spec_engine, messages, fields) == answer(smol_engine, messages, fields), (messages, fields)
    stats = spec_engine.stats()
    assert stats.draft_tokens > 100 and stats.accepted_tokens > 50  # the copies were proposed and taken


def test_an_answer_that_copies_takes_several_tokens_a_step(spec_engine):
    before = spec_engine.stats()
    _, _, _, tokens = answer(spec_engine, *PROMPTS[1])  # the file again, one name changed
    after = spec_engine.stats()
    accepted = after.accepted_tokens - before.accepted_tokens
    assert tokens == 160 and accepted > tokens // 3  # here ~99: 160 tokens in ~61 steps


def test_requests_speculating_together_each_get_their_own_answer(smol_engine, spec_engine):
    work = PROMPTS[:4]
    with ThreadPoolExecutor(len(work)) as pool:
        together = list(pool.map(lambda p: answer(spec_engine, *p), work))
    assert together == [answer(smol_engine, *p) for p in work]


def test_sampled_requests_do_not_speculate(spec_engine):
    before = spec_engine.stats().draft_tokens
    spec_engine.chat(messages=PROMPTS[0][0], max_tokens=40, temperature=0.7, seed=1)
    spec_engine.chat(messages=PROMPTS[0][0], max_tokens=40, frequency_penalty=0.5)
    assert spec_engine.stats().draft_tokens == before
