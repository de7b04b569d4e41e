"""Speculation from the prompt: proposals taken from a request's own text, checked in one step, give
exactly the tokens greedy decoding gives one step at a time, on the real SmolLM2, with stops, limits,
tool calls and several requests at once; and they are taken (fewer steps where an answer copies)."""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mashbox import Engine, EngineRequest, Finish, Message, ReasoningDelta, SamplingParams, TextDelta
from mashbox.engine.sched.draft import MOST, REST, START, Drafts
from mashbox.engine.sched.scheduler import PROBE, Scheduler, Work
from mashbox.engine.sched.sequence import Sequence

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


def eager(engine: Engine) -> Engine:
    """``engine`` checking every proposal, whatever its steps' times say: a busy machine's say none pay,
    which would leave these tests with nothing proposed (the choice itself is tested below)."""
    scheduler = engine._core.scheduler
    scheduler._afford = lambda decoding: [scheduler._draft(s) for s in decoding]
    return engine


@pytest.fixture(scope="module")
def spec_engine():
    with Engine("smollm2-135m", ctx=2048, slots=4, quiet=True) as engine:  # on by default
        yield eager(engine)


@pytest.fixture(scope="module")
def plain_engine():
    with Engine("smollm2-135m", ctx=2048, slots=4, quiet=True, speculation=False) as engine:
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


def test_speculation_gives_exactly_the_greedy_answer(plain_engine, spec_engine):
    for messages, fields in PROMPTS:
        assert answer(spec_engine, messages, fields) == answer(plain_engine, messages, fields), (messages, fields)
    stats = spec_engine.stats()
    assert stats.draft_tokens > 100 and stats.accepted_tokens > 50  # the copies were proposed and taken
    assert plain_engine.stats().draft_tokens == 0


BLOCK = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon\n"


@pytest.mark.parametrize(("stop", "max_tokens"), [("kappa", 17), ("sigma", 27), ("theta iota", 15), ("\n", 31)])
def test_a_stop_inside_a_step_that_reaches_max_tokens_is_a_stop(plain_engine, spec_engine, stop, max_tokens):
    """A stop string met among a step's kept proposals, the last of which reaches max_tokens: the answer
    ends at the stop (finish stop), as one token a step gives (it once ended as length: the limit was
    judged on the proposals before the stop took them back)."""
    def run(engine):
        out = engine.complete(prompt=BLOCK * 3, max_tokens=max_tokens, stop=[stop])
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens

    plain = run(plain_engine)
    assert run(spec_engine) == run(spec_engine) == plain and plain[1] == "stop"


def test_a_grammar_begun_mid_step_near_the_limit_gets_the_tokens_left():
    """A step keeps proposals up to the limit, but the text takes back those after a call's start (its
    grammar chooses the rest): the request is not ended at the limit it no longer reached."""
    s = Scheduler(2, 512, 32)
    seq = _speculating(Sequence("a", [1, 2, 3, 4, 5] * 3, SamplingParams(), 4))
    s.add(seq)
    s.update(s.schedule(), [1])  # the prompt and its first token: "... 4 5 1" occurred before
    for rows, seconds in {1: 0.010, 17: 0.011}.items():
        s.pace.record(rows, 0, seconds)
    plan = s.schedule()
    assert plan.work[0].draft == 2  # proposals up to the limit: 2 3, then the row's own next token
    s.update(plan, [2, 3, 4], emit=lambda seq, new: seq.rewind(2))  # the text kept only the first
    assert not seq.status.is_finished and seq.output_ids == [1, 2]
    while not seq.status.is_finished:  # the grammar's steps, one token each, to the limit
        plan = s.schedule()
        s.update(plan, [9] * (1 + plan.work[0].draft))
    assert seq.output_ids[:2] == [1, 2] and len(seq.output_ids) == 4 and seq.finish_reason == "length"


def test_an_answer_that_copies_takes_several_tokens_a_step(spec_engine):
    before = spec_engine.stats()
    _, _, _, tokens = answer(spec_engine, *PROMPTS[1])  # the file again, one name changed
    after = spec_engine.stats()
    accepted = after.accepted_tokens - before.accepted_tokens
    assert tokens == 160 and accepted > tokens // 3  # here ~99: 160 tokens in ~61 steps


def test_requests_speculating_together_each_get_their_own_answer(plain_engine, spec_engine):
    work = PROMPTS[:4]
    with ThreadPoolExecutor(len(work)) as pool:
        together = list(pool.map(lambda p: answer(spec_engine, *p), work))
    assert together == [answer(plain_engine, *p) for p in work]


COPY = SOURCE + "\n\n" + SOURCE[: SOURCE.index("\n", 600) + 1]  # a text begun again: it goes on as before
SETTINGS = [dict(temperature=0.7, seed=1), dict(temperature=1.0, top_p=0.9, seed=2),
            dict(temperature=0.8, top_k=40, frequency_penalty=0.5, seed=3),
            dict(temperature=0.5, repetition_penalty=1.2, presence_penalty=0.3, seed=4),
            dict(frequency_penalty=0.5)]  # greedy with a penalty: each row counts the proposals before it


def test_sampling_with_a_seed_gives_the_same_answer_with_speculation(plain_engine, spec_engine):
    """A token is drawn with a number that depends on its seed and position only, so a proposal is kept
    exactly where drawing one token at a time would have drawn it: the same answer, penalties and all."""
    before = spec_engine.stats()
    for fields in SETTINGS:
        for messages, extra in PROMPTS[:3]:
            request = {"max_tokens": 60, **extra, **fields}
            assert answer(spec_engine, messages, request) == answer(plain_engine, messages, request)
        texts = [e.complete(prompt=COPY, max_tokens=40, **fields).choices[0].text for e in (spec_engine, plain_engine)]
        assert texts[0] == texts[1]
    after = spec_engine.stats()
    drafted, accepted = after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens
    assert accepted > 100 and drafted - accepted > 10  # proposals were kept and turned down


def copied_words(text: str, original: str) -> int:
    return next((i for i, (a, b) in enumerate(zip(text.split(" "), original.split(" "))) if a != b),
                len(original.split(" ")))


def test_sampled_answers_come_from_the_same_distribution_with_speculation(plain_engine, spec_engine):
    """Unseeded, 200 answers each way (at temperature 1.3) that go on copying a text or not: how many of its words each
    copies is distributed alike (a chi-square test of homogeneity at the 0.1% level), while the
    speculating engine kept most proposals and turned some down. Keeping every proposal would make
    nearly all answers copy to the end."""
    original = plain_engine.complete(prompt=COPY, max_tokens=16).choices[0].text
    whole = len(original.split(" "))
    buckets = lambda n: 0 if n == 0 else 1 if n == 1 else 2 if n < whole else 3
    before = spec_engine.stats()
    counts = []
    for engine in (spec_engine, plain_engine):
        with ThreadPoolExecutor(4) as pool:  # as many as the slots: no prompt waits long (none is proposed then)
            texts = pool.map(lambda _: engine.complete(prompt=COPY, max_tokens=16, temperature=1.3).choices[0].text,
                             range(200))
            counts.append([0] * 4)
            for text in texts:
                counts[-1][buckets(copied_words(text, original))] += 1
    after = spec_engine.stats()
    drafted, accepted = after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens
    assert accepted > 50 and drafted - accepted > 10, (drafted, accepted)
    totals = [a + b for a, b in zip(*counts)]
    chi2 = sum((row[k] - totals[k] / 2) ** 2 / (totals[k] / 2) for row in counts for k in range(4) if totals[k])
    assert chi2 < 16.27, counts  # the 99.9% point of chi-square with 3 degrees of freedom


def test_chat_usage_says_how_many_proposed_tokens_were_kept(spec_engine):
    out = spec_engine.chat(messages=PROMPTS[1][0], max_tokens=80)
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    assert details.accepted_prediction_tokens < out.usage.completion_tokens  # each step gives one of its own


def test_completions_usage_says_how_many_proposed_tokens_were_kept(spec_engine):
    """The plain-prompt route had no completion details: its proposals counted in /metrics only."""
    out = spec_engine.complete(prompt=COPY, max_tokens=40)
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    assert details.accepted_prediction_tokens < out.usage.completion_tokens


def test_a_predicted_output_is_proposed_and_changes_nothing_but_speed(plain_engine, spec_engine):
    """OpenAI's ``prediction``: the text expected back (here the answer itself, as an edit tool would
    know most of it) is a source of proposals; the answer is the greedy one with or without it."""
    messages = ask("Write a short poem about the sea, with a title.")
    plain = plain_engine.chat(messages=messages, max_tokens=60)
    expected = plain.choices[0].message.content
    predicted = spec_engine.chat(messages=messages, max_tokens=60, prediction={"type": "content", "content": expected})
    wrong = spec_engine.chat(messages=messages, max_tokens=60, prediction={"type": "content", "content": "x y z " * 20})
    assert predicted.choices[0].message.content == wrong.choices[0].message.content == expected
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 30


@pytest.mark.parametrize("stop", ["sea", "\n", " the"])
def test_proposals_a_stop_took_back_are_not_counted_as_kept(plain_engine, spec_engine, stop):
    """A stop string met among a step's accepted proposals took the rest back from the answer, but they
    stayed counted: 11 kept proposals in an answer of 8 tokens, in usage and /metrics."""
    messages = ask("Write a short poem about the sea, with a title.")
    expected = plain_engine.chat(messages=messages, max_tokens=60).choices[0].message.content
    before = spec_engine.stats()
    out = spec_engine.chat(messages=messages, max_tokens=60, stop=[stop],
                           prediction={"type": "content", "content": expected})
    after = spec_engine.stats()
    details = out.usage.completion_tokens_details
    assert out.choices[0].finish_reason == "stop" and len(out.choices[0].message.content) < len(expected)
    assert details.accepted_prediction_tokens <= out.usage.completion_tokens - 1  # the first is the prompt's
    assert after.accepted_tokens - before.accepted_tokens == details.accepted_prediction_tokens
    assert after.draft_tokens - before.draft_tokens == (details.accepted_prediction_tokens
                                                       + details.rejected_prediction_tokens)


def test_proposals_past_the_end_of_the_answer_are_not_counted(spec_engine):
    """Proposed after the end of turn (the prompt's own text went on past it), the template's next tokens
    were counted as accepted: 3 kept proposals in an answer of 3 tokens, whose first is no proposal."""
    before = spec_engine.stats()
    out = spec_engine.chat(messages=ask("Hello world\nHello world\nHello world"), max_tokens=40)
    after = spec_engine.stats()
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens <= out.usage.completion_tokens - 1, (out.usage, out.choices[0])
    assert after.accepted_tokens - before.accepted_tokens == details.accepted_prediction_tokens
    assert after.draft_tokens - before.draft_tokens == (details.accepted_prediction_tokens
                                                       + details.rejected_prediction_tokens)


def test_a_prediction_is_read_only_as_far_as_the_answer_can_go(spec_engine):
    """A 9 MB prediction was tokenized and indexed whole on the path every request waits behind (other
    clients stalled 17 s); an answer of 8 tokens can use the first hundred-odd characters of it."""
    request = EngineRequest(messages=(Message("user", "Say hi."),), sampling=SamplingParams(max_tokens=8),
                            prediction="文字 " * 1_000_000)
    job = spec_engine._job(request)
    assert len(job.seq.drafts.tokens) - len(job.seq.prompt_ids) < 1000  # its first 16 x 8 characters


def test_over_http_the_sdk_sends_a_prediction_and_reads_what_was_kept(oai):
    """The real OpenAI SDK against the server (speculation on by default): ``prediction`` is taken,
    the usage says how many proposed tokens were kept, and /metrics counts them."""
    messages = ask(f"```python\n{SOURCE[:1200]}\n```\nCopy the code.")
    plain = oai.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=60)
    again = oai.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=60,
                                        prediction={"type": "content", "content": SOURCE[:1200]})
    assert again.choices[0].message.content == plain.choices[0].message.content
    details = again.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens is not None
    metrics = httpx.get(str(oai.base_url).removesuffix("/v1/") + "/metrics").text
    kept = re.search(r"^mashbox:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert kept and float(kept.group(1)) > 0


def _speculating(seq: Sequence) -> Sequence:
    """``seq`` with its prompt indexed for proposals, as the engine gives a greedy request."""
    seq.drafts = Drafts(seq.prompt_ids)
    return seq


def _proposing(step_seconds: dict[int, float]) -> Work:
    """The decode item of a request whose text repeats, after steps of these sizes took these times."""
    s = Scheduler(2, 512, 32)
    s.add(_speculating(Sequence("a", [1, 2, 3, 4, 5] * 3, SamplingParams(), 50)))
    s.update(s.schedule(), [1])  # the prompt, then its first token: "... 4 5 1", which occurred before
    for rows, seconds in step_seconds.items():
        s.pace.record(rows, 0, seconds)
    return s.schedule().work[0]


def test_a_step_checks_the_proposals_that_pay_for_their_rows():
    assert _proposing({1: 0.010, 17: 0.011}).token_ids == (1, 2, 3, 4, 5)  # rows nearly free: all START
    assert _proposing({1: 0.010, 17: 0.170}).token_ids == (1,)  # each row as dear as a step: none
    assert _proposing({1: 0.010}).draft == 0  # step costs not known yet: none


def test_proposals_that_seemed_too_dear_are_checked_now_and_then():
    """One slow step measured at a busy moment must not turn speculation off for good."""
    s = Scheduler(2, 512, 32)
    s.add(_speculating(Sequence("a", [1, 2, 3, 4, 5] * 20, SamplingParams(), 200)))
    s.update(s.schedule(), [1])
    s.pace.record(1, 0, 0.010)
    s.pace.record(5, 0, 0.500)  # a step of 5 rows once took 50 steps' time
    drafts = []
    for _ in range(2 * PROBE):
        plan = s.schedule()
        drafts.append(plan.work[0].draft)
        s.update(plan, [plan.work[0].token_ids[-1]] * (1 + plan.work[0].draft))  # not timed
    assert drafts.count(0) >= 2 * PROBE - 2 and 1 in drafts


def test_a_thinking_budget_ends_thinking_where_it_would_without_speculation(tiny_model_dir, tmp_path):
    """Forced tokens (the budget spent) take over mid-step: the proposals kept after them are taken back.
    Every proposal is checked here, whatever the steps' times say (a busy machine's say none pay), and
    budgets 1-12 put the budget's end inside a step (with the take-back undone, budget 5 differs)."""
    from test_tools import THINK_TEMPLATE
    from transformers import AutoTokenizer

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(path)
    runs: dict[tuple[bool, int], list] = {}
    for on in (False, True):
        with Engine(str(path), ctx=512, slots=2, quiet=True, speculation=on) as engine:
            eager(engine)
            for budget in range(1, 13):
                request = EngineRequest(messages=(Message("user", "Think about it."),), enable_thinking=True,
                                        thinking_budget=budget, sampling=SamplingParams(max_tokens=60))
                events = [e for e in engine.stream(request) if isinstance(e, (ReasoningDelta, TextDelta, Finish))]
                usage = events[-1].usage
                runs[on, budget] = [[(type(e).__name__, e.text) for e in events[:-1]],
                                    (usage.completion_tokens, usage.reasoning_tokens)]
            drafted = engine.stats().draft_tokens
    assert all(runs[True, budget] == runs[False, budget] for budget in range(1, 13))
    assert drafted > 0  # proposals were made (the tiny model repeats itself), and taken back where forced
