"""Why a prompt missed the prefix cache: where it left a longer cached prefix, in which part of the
conversation (the x-mashbox-cache header, the request's log line), and the counters on /metrics."""

import json
import logging
import os
from dataclasses import replace

import httpx
import pytest
from server import serve
from test_metrics import value

from mashbox.engine.request import EngineRequest, Message, Tool
from mashbox.engine.sched.prefix_cache import PrefixCache
from mashbox.engine.text.template import part_at
from mashbox.server.backend import InProcessBackend
from mashbox.server.settings import Settings

SYSTEM = "You are a careful assistant. " * 12 + "Today is Monday."
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Does thing number {i} " * 4,
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for i in range(3)]
TURNS = [{"role": "user", "content": "First question about the weather in a city? " * 3},
         {"role": "assistant", "content": "It is sunny there today."},
         {"role": "user", "content": "And the second question, about tomorrow? " * 3}]


def test_the_cache_says_where_a_prompt_left_a_longer_cached_prefix():
    cache = PrefixCache(num_slots=2, block=4)
    cached = list(range(100, 140))
    assert cache.admit(cached, [0, 1])[0].differs is None  # nothing cached yet
    cache.insert(0, cached)
    longer = cache.admit(cached + [7, 8, 9], [0, 1])[0]
    assert (longer.tokens, longer.differs) == (40, None)  # it goes on where the cache ends: no miss
    cache.insert(0, cached)
    changed = cache.admit(cached[:21] + [5] + cached[22:], [0, 1])[0]
    assert (changed.tokens, changed.differs) == (20, 21)  # whole blocks reused; token 21 differs
    assert cache.admit(cached[:21] + [5] + cached[22:], [1], salt="other")[0].differs is None  # another tenant's


def test_a_prompt_too_short_for_the_cache_missed_nothing():
    """A prompt of no whole block before its last token, sent again and again, read as a miss of
    another conversation it shares its opening with (differs-at, diverged counted): no cache could
    serve it."""
    cache = PrefixCache(num_slots=2, block=4)
    cache.insert(0, list(range(100, 140)))
    assert cache.admit([100, 101, 102, 7], [1])[0].differs is None
    assert cache.admit([100, 101, 102, 7, 8], [1])[0].differs == 3  # one block it could have had


def test_a_prompt_the_disk_served_is_no_miss_of_what_a_slot_held(tmp_path):
    """Its pages read from disk (after a restart), while a slot held another prompt: no differs-at
    (it said differs-at=0 in the template's opening, a change that never happened)."""
    import torch

    from mashbox.engine.sched.disk_cache import PageStore

    store = PageStore(tmp_path, 2**20, "ns", page=4)
    prompt = list(range(100, 113))
    for i, key in enumerate(store.keys(prompt, "")):
        store.save(key, prompt[4 * i: 4 * i + 4], torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2))
    store.close()
    cache = PrefixCache(num_slots=1, block=4, disk=PageStore(tmp_path, 2**20, "ns", page=4))
    cache.insert(0, [7] * 12)  # another prompt held
    match = cache.admit(prompt, [0])[0]
    assert (match.tokens, match.differs) == (12, None)


def test_a_character_is_placed_in_the_part_of_the_conversation_it_lies_in():
    messages = (Message("system", "Be brief."), Message("user", "Hello there"), Message("assistant", "Hi!"))
    rendered = '<s>system\nBe brief.\n# Tools\n{"name": "lookup"}\n<s>user\nHello there\n<s>assistant\nHi!\n'
    where = lambda text: part_at(rendered, rendered.index(text), messages, rendered.index("# Tools"))
    assert [where(t) for t in ("<s>system", "brief", "# Tools", '"lookup"', "<s>user", "there", "Hi!")] == [
        "the template's opening", "system text", "tools", "tools", "tools", "message 1 (user)", "message 2 (assistant)"]
    later = (*messages, Message("system", "Remember."), Message("user", "Go"))  # a reminder where it stands
    rendered += "<s>system\nRemember.\n<s>user\nGo\n"
    assert part_at(rendered, rendered.index("Remember."), later) == "message 3 (system)"


def test_the_tools_block_begins_where_the_prompt_without_tools_differs(tiny_engine):
    """Its heading and preamble are the tools' (a prompt that first differed at Qwen's '# Tools', before the first
    tool's name, was told as differing in the template's opening); a system text that quotes a tool's name, or
    shows a call of it, is still the system text."""
    engine = tiny_engine
    tools = (Tool("lookup", "Looks things up", {"type": "object"}),)
    for system in ('Prefer the "lookup" tool. Work in /home/ann.', 'Call it so: {"name": "lookup"}. Work in /home/ann.'):
        request = EngineRequest(messages=(Message("system", system), Message("user", "Hi")), tools=tools)
        rendered = engine._rendered(request)
        start = len(os.path.commonprefix([rendered, engine._rendered(replace(request, tools=()))]))
        assert rendered[start:].startswith("# Tools"), rendered
        assert part_at(rendered, start, request.messages, start) == "tools"
        assert part_at(rendered, rendered.index('"name": "lookup"', start), request.messages, start) == "tools"
        assert part_at(rendered, rendered.index("/home"), request.messages, start) == "system text"


def test_a_turn_is_found_after_the_turn_before_it_not_inside_it():
    """A short answer ("Yes") whose text the question before it holds: a change in the question was told as
    one in the answer."""
    messages = (Message("user", "Is drawer 14 open? Yes or no, then describe the cabinet."), Message("assistant", "Yes"),
                Message("user", "Good."))
    rendered = "".join(f"<s>{m.role}\n{m.content}\n" for m in messages)
    assert part_at(rendered, rendered.index("describe"), messages) == "message 0 (user)"
    assert part_at(rendered, rendered.index("Yes\n"), messages) == "message 1 (assistant)"


LONG = "A question about the weather in a city, with some words to fill a block or two of tokens. "
CALL = {"type": "function_call", "call_id": "call_1", "name": "tool_0", "arguments": '{"x": "a"}'}
RESULT = {"type": "function_call_output", "call_id": "call_1"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "tool_0", "input": {"x": "a"}}


@pytest.mark.parametrize(("path", "body", "changed", "part"), [
    ("/v1/messages",  # the system field is no message; message 2 was told as 3
     {"system": SYSTEM, "messages": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "Sunny."},
                                     {"role": "user", "content": LONG * 2}]},
     lambda b: b["messages"][2].update(content=LONG + "Changed."), "message 2 (user)"),
    ("/v1/messages",  # two tool results in one message are two turns for the template; message 4 was told as 6
     {"system": SYSTEM, "messages": [
         {"role": "user", "content": LONG}, {"role": "assistant", "content": [USE, {**USE, "id": "toolu_2"}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "Sunny, 20 C."}
                                      for i in ("toolu_1", "toolu_2")]},
         {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": LONG * 2}]},
     lambda b: b["messages"][4].update(content=LONG + "Changed."), "message 4 (user)"),
    ("/v1/responses",  # instructions are no item; input 2 was told as 3
     {"instructions": SYSTEM, "input": [{"role": "user", "content": LONG}, CALL, {**RESULT, "output": LONG},
                                        {"role": "user", "content": LONG}]},
     lambda b: b["input"][2].update(output=LONG[:40] + "Changed."), "message 2 (tool)"),
])
def test_a_miss_names_the_requests_own_item(url, path, body, changed, part):
    tools = {"/v1/messages": [{"name": "tool_0", "input_schema": {"type": "object"}}],
             "/v1/responses": [{"type": "function", "name": "tool_0", "parameters": {"type": "object"}}]}[path]
    limit = {"max_tokens": 2, "model": "any"} if path == "/v1/messages" else {"max_output_tokens": 16}
    body = {**body, "tools": tools, **limit}
    for _ in range(2):
        assert httpx.post(url + path, json=body, timeout=60).status_code == 200
    body = json.loads(json.dumps(body))
    changed(body)
    answer = httpx.post(url + path, json=body, timeout=60)
    assert answer.status_code == 200 and f'part="{part}"' in answer.headers["x-mashbox-cache"], answer.headers


@pytest.fixture(scope="module")
def url(tiny_engine):
    yield from serve(InProcessBackend.of(tiny_engine), Settings())


def _ask(url, system=SYSTEM, tools=TOOLS, turns=TURNS):
    body = {"messages": [{"role": "system", "content": system}, *turns], "tools": tools, "max_tokens": 2,
            "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def _first_difference(engine, before, after):
    """The first token at which the prompts of two chat bodies differ, by the engine's own encoding."""
    from mashbox.api.openai_chat import ChatRequest, to_engine

    ids = [engine.encode(to_engine(ChatRequest(messages=[{"role": "system", "content": s}, *t], tools=tools)))
           for s, tools, t in (before, after)]
    return next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)


@pytest.mark.parametrize(("change", "part"), [
    ({"system": SYSTEM.replace("Monday", "Tuesday")}, "system text"),
    ({"tools": [TOOLS[0], {**TOOLS[1], "function": {**TOOLS[1]["function"], "description": "Changed."}}, TOOLS[2]]},
     "tools"),
    ({"turns": [*TURNS[:2], {"role": "user", "content": "A different second question? " * 3}]}, "message 3 (user)"),
])
def test_a_miss_is_told_in_the_header_the_log_and_the_metrics(url, tiny_engine, caplog, change, part):
    scrape = lambda name: value(httpx.get(url + "/metrics").content, name, model_name=tiny_engine.model_id)
    warm = _ask(url)
    assert warm.status_code == 200 and warm.headers["x-mashbox-cache"].startswith("cached=")
    again = _ask(url)  # the same prompt: its whole blocks from the cache, no miss
    cached = int(again.headers["x-mashbox-cache"].removeprefix("cached="))
    assert cached >= 256 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    diverged, missed = scrape("mashbox:prefix_cache_diverged_total"), scrape("mashbox:prefix_cache_misses_total")
    with caplog.at_level(logging.INFO, logger="mashbox.server"):
        changed = _ask(url, **change)
    args = [{"system": SYSTEM, "tools": TOOLS, "turns": TURNS}[k] for k in ("system", "tools", "turns")]
    new = [change.get(k, a) for k, a in zip(("system", "tools", "turns"), args, strict=True)]
    at = _first_difference(tiny_engine, args, new)
    tokens = changed.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    note = f'cached={tokens}; differs-at={at}; part="{part}"'
    assert changed.headers["x-mashbox-cache"] == note and tokens == at // 32 * 32
    assert any(note in r.getMessage() and "finished" in r.getMessage() for r in caplog.records)
    assert scrape("mashbox:prefix_cache_diverged_total") == diverged + 1
    assert scrape("mashbox:prefix_cache_misses_total") == missed + changed.json()["usage"]["prompt_tokens"] - tokens


def _stream(url, max_tokens=2, **extra):
    """A streamed chat request: (its headers, its content, whether it ended with [DONE])."""
    body = {"messages": [{"role": "system", "content": SYSTEM}, *TURNS], "tools": TOOLS, "max_tokens": max_tokens,
            "stream": True, **extra}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    return response.headers, text, lines[-1] == "data: [DONE]"


def test_a_stream_says_how_its_prompt_met_the_cache_in_its_headers(url):
    _stream(url)
    headers, _, done = _stream(url)  # the same prompt again: its whole chunks from the cache
    assert done and int(headers["x-mashbox-cache"].removeprefix("cached=")) >= 256
    changed, _, _ = _stream(url, messages=[{"role": "system", "content": SYSTEM.replace("Monday", "Friday")}, *TURNS])
    assert 'part="system text"' in changed["x-mashbox-cache"]


def test_a_prompt_that_first_differs_at_the_tools_heading_is_told_as_differing_in_the_tools(tiny_model_dir):
    """With only a prompt without tools cached, the same with tools parts from it at their heading ('# Tools',
    before the first tool's name): that was told as the template's opening."""
    from mashbox import Engine

    with Engine(str(tiny_model_dir), ctx=1024, slots=1, speculation=False, quiet=True) as engine:
        server = serve(InProcessBackend.of(engine), Settings())
        url = next(server)
        try:
            assert _ask(url, tools=None).status_code == 200
            changed = _ask(url)
        finally:
            next(server, None)
    assert changed.status_code == 200 and changed.headers["x-mashbox-cache"].endswith('part="tools"'), changed.headers


def test_a_stream_waiting_for_a_slot_starts_without_the_header_and_loses_nothing(tiny_model_dir, monkeypatch):
    from mashbox import Engine
    from mashbox.server import generation

    monkeypatch.setattr(generation, "SLOT_WAIT_S", 0.01)
    long = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400, "temperature": 1.0,
            "seed": 3, "stream": True}
    with Engine(str(tiny_model_dir), ctx=512, slots=1, speculation=False, quiet=True) as engine:
        server = serve(InProcessBackend.of(engine), Settings())
        url = next(server)
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=long, timeout=60) as busy:
                lines = busy.iter_lines()
                next(lines)  # the one slot is taken
                queued, text, done = _stream(url, max_tokens=8, temperature=0)
                rest = [line for line in lines if line]
            body = {"messages": [{"role": "system", "content": SYSTEM}, *TURNS], "tools": TOOLS, "max_tokens": 8,
                    "temperature": 0}
            alone = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        finally:
            next(server, None)
    assert "x-mashbox-cache" not in queued  # its headers went out while the other held the slot
    assert done and text and text == alone["content"] and rest[-1] == "data: [DONE]"


def test_an_anthropic_stream_waiting_for_a_slot_opens_with_its_prompt_s_real_cache_split(tiny_model_dir, monkeypatch):
    """message_start's usage (which clients read the prompt's billing from) is the cache split the run met,
    however long it waited for its slot (it said 0 cached, and message_delta another split, after 1 s)."""
    from mashbox import Engine
    from mashbox.server import generation

    monkeypatch.setattr(generation, "SLOT_WAIT_S", 0.01)
    long = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400, "temperature": 1.0,
            "seed": 3, "stream": True}
    body = {"system": SYSTEM, "messages": TURNS, "max_tokens": 4, "stream": True}
    with Engine(str(tiny_model_dir), ctx=512, slots=1, speculation=False, quiet=True) as engine:
        server = serve(InProcessBackend.of(engine), Settings(keepalive_s=0.05))
        url = next(server)
        try:
            httpx.post(url + "/v1/messages", json={**body, "stream": False}, timeout=60).raise_for_status()
            with httpx.stream("POST", url + "/v1/chat/completions", json=long, timeout=60) as busy:
                lines = busy.iter_lines()
                next(lines)  # the one slot is taken
                with httpx.stream("POST", url + "/v1/messages", json=body, timeout=60) as queued:
                    text = "".join(queued.iter_text())
                rest = [line for line in lines if line]
        finally:
            next(server, None)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    start, delta = events[0]["message"]["usage"], next(e for e in events if e["type"] == "message_delta")["usage"]
    assert text.startswith(": keep-alive") and events[0]["type"] == "message_start"  # comments while it waited
    assert start["cache_read_input_tokens"] >= 64 and rest[-1] == "data: [DONE]"
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (
        delta["input_tokens"], delta["cache_read_input_tokens"])
