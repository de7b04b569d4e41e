"""Reasoning and tool-call markup parsing: a text state machine, no model."""

import json

import pytest

from mashbox.engine.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from mashbox.engine.text.markup import HERMES, Markup, json_value


def parse(pieces, **options):
    m = Markup(**options)
    events = [e for p in pieces for e in m.push(p)] + m.flush()
    return coalesce(events)


def coalesce(events):
    """Adjacent text/reasoning deltas joined; calls as (name, arguments) tuples."""
    out = []
    for e in events:
        if isinstance(e, (TextDelta, ReasoningDelta)) and out and out[-1][0] == e.type:
            out[-1] = (e.type, out[-1][1] + e.text)
        elif isinstance(e, (TextDelta, ReasoningDelta)):
            out.append((e.type, e.text))
        elif isinstance(e, ToolCallStart):
            out.append(("call", e.index, e.name))
        elif isinstance(e, ToolCallDelta):
            out[-1] = out[-1] + (json.loads(e.arguments),)
        elif isinstance(e, ToolCallEnd):
            assert out[-1][1] == e.index
    return out


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OPEN_STRING = '<tool_call>\n{"name": "write", "arguments": {"content": "abc}}\n</tool_call>'  # broken: all text
TABLE = [
    ("plain text only", {}, [("text", "plain text only")]),
    ("Sure. " + CALL, {}, [("text", "Sure."), ("call", 0, "get_weather", {"city": "Paris"})]),
    (CALL + "\n" + CALL + "\n", {}, [("call", 0, "get_weather", {"city": "Paris"})]),
    (CALL + " and " + CALL + " more text", {}, [("call", 0, "get_weather", {"city": "Paris"}), ("text", " and")]),
    ("ends with blanks \n ", {}, [("text", "ends with blanks \n ")]),
    (CALL + CALL.replace("Paris", "Rome"), {},
     [("call", 0, "get_weather", {"city": "Paris"}), ("call", 1, "get_weather", {"city": "Rome"})]),
    ("<think>hmm, weather</think>It is " + CALL, {"think": True},
     [("reasoning", "hmm, weather"), ("text", "It is"), ("call", 0, "get_weather", {"city": "Paris"})]),
    ("still thinking</think>answer", {"think": True, "in_think": True},
     [("reasoning", "still thinking"), ("text", "answer")]),
    ("<think>not parsed</think>", {}, [("text", "<think>not parsed</think>")]),
    ("a <tool_call>not json</tool_call> b", {}, [("text", "a <tool_call>not json</tool_call> b")]),
    ('<tool_call>{"arguments": {}}</tool_call>', {}, [("text", '<tool_call>{"arguments": {}}</tool_call>')]),
    ('x <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}', {}, [("text", "x"), ("call", 0, "f", {"a": 1})]),
    ("x <tool_call>{\"name\": \"f\", \"argu", {}, [("text", "x <tool_call>{\"name\": \"f\", \"argu")]),
    ("less < than <tool and <tool_cal", {}, [("text", "less < than <tool and <tool_cal")]),
    ("tags " + CALL, {"calls": None}, [("text", "tags " + CALL)]),
    ('<tool_call>\n{"name": "save", "arguments": {"text": "a</tool_call>b \\"</tool_call>\\""}}\n</tool_call>', {},
     [("call", 0, "save", {"text": 'a</tool_call>b "</tool_call>"'})]),  # its closing tag inside its strings
    (OPEN_STRING + "\nI wrote it.", {"names": frozenset({"write"})}, [("text", OPEN_STRING + "\nI wrote it.")]),
    ('<tool_call>\n{"name": "write", "arguments": {"content": "a</tool_call>b"}}\n</tool_', {"names": frozenset({"write"})},
     [("call", 0, "write", {"content": "a</tool_call>b"})]),  # cut in its own closing tag: that call
    (OPEN_STRING + "\nSo:" + CALL + " Done.", {"names": frozenset({"get_weather", "write"})},  # a call left a string
     [("text", OPEN_STRING + "\nSo:"), ("call", 0, "get_weather", {"city": "Paris"}), ("text", " Done.")]),  # open
]


@pytest.mark.parametrize(("text", "options", "expected"), TABLE, ids=[str(i) for i in range(len(TABLE))])
def test_split_at_every_position_gives_the_same_events(text, options, expected):
    assert parse([text], **options) == expected
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]], **options) == expected
    assert parse(list(text), **options) == expected


def test_partial_tag_is_never_emitted_as_text():
    m = Markup()
    assert m.push("Let me check <tool_") == [TextDelta("Let me check")]
    assert m.push("call>") == []
    events = m.push('{"name": "f", "arguments": {}}</tool_call>')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallDelta, ToolCallEnd]


def test_calls_have_distinct_ids():
    two = CALL + CALL.replace("Paris", "Rome")
    events = parse([two])
    assert len(events) == 2
    m = Markup()
    starts = [e for e in m.push(two) if isinstance(e, ToolCallStart)]
    assert len({s.id for s in starts}) == 2 and m.num_calls == 2


NAMES = frozenset({"get_weather"})
FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
BARE = [
    (FENCED, [("call", 0, "get_weather", {"city": "Paris"})]),
    ('  {"name": "get_weather", "arguments": {"city": "Paris"}}', [("call", 0, "get_weather", {"city": "Paris"})]),
    (FENCED + "\n" + FENCED.replace("Paris", "Rome"),
     [("call", 0, "get_weather", {"city": "Paris"}), ("call", 1, "get_weather", {"city": "Rome"})]),
    ('```json\n{"name": "other_tool", "arguments": {}}\n```', [("text", '```json\n{"name": "other_tool", "arguments": {}}\n```')]),
    ("```python\nprint(1)\n```", [("text", "```python\nprint(1)\n```")]),
    ('{"city": "Paris"} is JSON', [("text", '{"city": "Paris"} is JSON')]),
    ("The answer: " + FENCED, [("text", "The answer: " + FENCED)]),
    ('```json\n{"name": "get_weather", "argu', []),  # a call cut off (the limit, a stop): no text, no call
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
     [("call", 0, "get_weather", {"city": "Paris"}), ("call", 1, "get_weather", {"city": "Rome"})]),
    ('```json\n[ {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1"}]\n```',
     [("call", 0, "get_weather", {"city": "Paris"})]),
    ('[{"name": "get_weather", "arguments": {}}, {"name": "other_tool", "arguments": {}}]',
     [("text", '[{"name": "get_weather", "arguments": {}}, {"name": "other_tool", "arguments": {}}]')]),
    ("[1, 2, 3] are numbers", [("text", "[1, 2, 3] are numbers")]),
    ("[the docs](https://example.com) say so", [("text", "[the docs](https://example.com) say so")]),
    ("[]", [("text", "[]")]),
]


@pytest.mark.parametrize(("text", "expected"), BARE, ids=[str(i) for i in range(len(BARE))])
def test_bare_json_call_to_a_known_tool_at_every_split(text, expected):
    assert parse([text], names=NAMES) == expected
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]], names=NAMES) == expected


WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("form", ["{}", "```json\n{}", "<tool_call>\n{}"])
def test_a_call_to_a_declared_tool_cut_off_anywhere_is_neither_text_nor_a_call(form):
    """Cut by max_tokens or a stop string mid-call (in auto mode), its JSON came back as the answer's text;
    a forced call's was dropped. Now both: OpenAI's and Anthropic's answers hold no such text either."""
    start = form.index("{}")
    for cut in range(1, len(WEATHER_CALL)):  # from ``{`` (cut before its name, the first token or two was text)
        assert parse([form[:start] + WEATHER_CALL[:cut]], names=NAMES) == [], WEATHER_CALL[:cut]
    text = "The answer: " + WEATHER_CALL[:30]  # not at the answer's start: text, as before
    assert parse([text], names=NAMES) == [("text", text)]
    other = '{"name": "Bob", "age": 4'  # JSON the user asked for, cut: its text
    assert parse([other], names=NAMES) == [("text", other)]


def test_text_that_only_begins_with_a_bracket_is_not_held():
    """A list of calls is held from its ``[{``; a link or a list of other things goes out at once."""
    m = Markup(names=NAMES)
    assert m.push("[") == []
    assert m.push("the docs](x)") == [TextDelta("[the docs](x)")]
    assert Markup(names=NAMES).push('[ {"name"') == []


def test_text_that_begins_with_a_brace_but_no_key_is_not_held():
    """A bare call is held from ``{"``; ``{placeholder}`` or ``{ x`` goes out as it comes."""
    m = Markup(names=NAMES)
    assert m.push("{") == [] and m.push(" ") == []
    assert m.push("placeholder} is") == [TextDelta("{ placeholder} is")]
    assert Markup(names=NAMES).push('{ "') == []


@pytest.mark.parametrize("text", ["{placeholder} is the value.\n", '{"answer": 42, oops\nLet me check.\n', "{\n"])
def test_held_text_before_a_tagged_call_is_kept(text):
    """Text held as a possible bare call, that a tagged call then follows, was text (it was dropped)."""
    expected = [("text", text.rstrip()), ("call", 0, "get_weather", {"city": "Paris"})]
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:], CALL], names=NAMES) == expected


def test_text_after_a_bare_call_at_the_end_is_kept():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}} done'
    assert parse([text], names=NAMES) == [("call", 0, "get_weather", {"city": "Paris"}), ("text", " done")]


def test_tagged_calls_with_tool_names_known_drop_the_blank_between_them():
    text = CALL + "\n" + CALL.replace("Paris", "Rome") + "\n"
    expected = [("call", 0, "get_weather", {"city": "Paris"}), ("call", 1, "get_weather", {"city": "Rome"})]
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]], names=NAMES) == expected


@pytest.mark.parametrize(("text", "kept", "auto"), [('x <tool_call>{"name": "f", "argu', "x", None),
                                                   ("x\n<tool", "x\n", None), ("x\n<tool_call>", "x", "x"),
                                                   ('x\n<tool_call>\n[{"na', "x", "x")])
def test_where_only_calls_are_written_a_cut_off_call_is_dropped(text, kept, auto):
    """Elsewhere it stays text, but for an opening tag with no more than a call's first characters after it
    (Granite's answer cut at 1-3 tokens was its ``<|tool_call|>`` marker as text)."""
    assert parse([text], cut_calls_are_text=False) == [("text", kept)]
    assert parse([text]) == [("text", auto or text)]


ARGS = '{"city": "Paris", "days": 2}'
WRITTEN = {"tagged": f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>',
           "fenced": f'```json\n{{"name": "get_weather", "arguments": {ARGS}}}\n```',
           "reordered": '<tool_call>{"arguments": {"days": 2, "city": "Paris"}, "name": "get_weather"}</tool_call>'}


@pytest.mark.parametrize("first", ["tagged", "fenced"])
@pytest.mark.parametrize("again", list(WRITTEN))
def test_an_answer_that_repeats_a_call_is_cut_after_the_first(first, again):
    """What a small model does when it loops: the same call again and again (Pi on mashbox got
    one 1,024-token answer of it). The repeat and all after it are dropped, and ``repeated`` tells
    the engine to stop the request."""
    text = WRITTEN[first] + "\n" + WRITTEN[again] + "\nI will read it again.\n" + WRITTEN[first]
    for cut in range(len(text) + 1):
        m = Markup(names=NAMES)
        events = m.push(text[:cut]) + m.push(text[cut:]) + m.flush()
        assert coalesce(events) == [("call", 0, "get_weather", {"city": "Paris", "days": 2})]
        assert m.repeated and m.num_calls == 1
    other = parse([WRITTEN[first] + "\n" + WRITTEN[again].replace("Paris", "Rome")], names=NAMES)
    assert [e[3]["city"] for e in other] == ["Paris", "Rome"]  # the same tool, other arguments: a new call


def test_a_line_that_repeats_a_call_to_an_unknown_tool_is_cut_at_the_second():
    """Pi on mashbox, turn 2: after a good call the model wrote the word it read as a tool name,
    the same line 4,096 tokens long. Such a call stays text, but its repeat ends the answer."""
    loop = '{"name": "walrus362", "arguments": {"path": "secret.txt"}}'
    read = '{"name": "read", "arguments": {"path": "secret.txt"}}'
    text = read + ("\n" + loop) * 6 + "\n"
    expected = [("call", 0, "read", {"path": "secret.txt"}), ("text", ("\n" + loop) * 2)]
    for cut in range(len(text) + 1):
        m = Markup(names=frozenset({"read"}))
        assert coalesce(m.push(text[:cut]) + m.push(text[cut:]) + m.flush()) == expected and m.repeated
    prose = "I read it.\n" + loop + "\nThen " + loop.replace("walrus", "other") + "\ndone\n"
    assert parse([prose], names=frozenset({"read"})) == [("text", prose)]  # no repeat: all kept


def test_calls_that_count_up_end_the_answer_after_four_of_a_shape():
    """Pi on mashbox (Responses, 2026-12-02): after reading the file the model counted the word's
    number up, edit -> write -> bash each time, 120 calls in one answer (Pi ran them all). Calls
    that differ only in their numbers: four of a kind are kept, the fifth ends the answer."""
    names = frozenset({"edit", "write", "bash", "read"})

    def cycle(n):
        return [{"name": "edit", "arguments": {"path": "s.txt", "edits": [{"oldText": f"w{n}", "newText": f"w{n + 1}"}]}},
                {"name": "write", "arguments": {"path": "s.txt", "content": f"w{n + 1}"}},
                {"name": "bash", "arguments": {"command": f"echo 'w{n + 1}' > s.txt"}}]

    calls = [c for n in range(195, 205) for c in cycle(n)]
    text = "".join(f"<tool_call>{json.dumps(c)}</tool_call>\n" for c in calls)
    m = Markup(names=names)
    events = coalesce(m.push(text) + m.flush())
    assert [(e[2], e[3]) for e in events] == [(c["name"], c["arguments"]) for c in calls[:12]] and m.repeated
    reads = "".join(f'<tool_call>{{"name": "read", "arguments": {{"path": "part{i}.txt"}}}}</tool_call>\n'
                    for i in range(1, 5))
    m = Markup(names=names)
    assert len([e for e in coalesce(m.push(reads) + m.flush()) if e[0] == "call"]) == 4 and not m.repeated


def test_a_repeated_call_line_followed_only_by_blanks_still_ends_the_answer():
    """Pi on mashbox (Anthropic Messages): a call, then that call again as a line of text, then
    newlines until max_tokens. The line's own newline completes it: the answer ends there."""
    bash = '{"name": "bash", "arguments": {"command": "cat secret.txt"}}'
    text = bash + "\nI will check.\n" + bash + "\n" + "\n" * 50
    for cut in range(len(text) + 1):
        m = Markup(names=frozenset({"bash"}))
        events = m.push(text[:cut]) + m.push(text[cut:])
        assert m.repeated, cut
        assert coalesce(events + m.flush()) == [("call", 0, "bash", {"command": "cat secret.txt"}),
                                                ("text", "\nI will check.\n" + bash)]


def test_broken_call_lines_that_repeat_and_runs_of_blank_lines_end_the_answer():
    """Pi on mashbox (Messages), turn 2: a call, then two lines of calls with broken JSON written
    twice, then newlines to max_tokens (4,096 tokens, 262 s)."""
    edit = '{"name": "edit", "arguments": {"path": "secret.txt", "edits": [{"oldText": "a", "newText": "a"}]}]}'
    write = '{"name": "write", "arguments": {"path": "secret.txt", "content": "a"}}}'
    text = f"{edit}\n{write}\n{edit}\n{write}\nmore"
    assert parse([text], names=frozenset({"edit"})) == [("text", f"{edit}\n{write}\n{edit}")]
    for blank in ("\n" * 33, " \n" * 33):
        m = Markup()
        events = m.push("The word is x." + blank + "y")
        assert coalesce(events + m.flush()) == [("text", "The word is x.")] and m.repeated
    assert parse(["x" + "\n" * 32 + "y"]) == [("text", "x" + "\n" * 32 + "y")]


@pytest.mark.parametrize("forced", [True, False])
@pytest.mark.parametrize("tail", ["", "</tool", "</tool_call"])
def test_a_whole_call_cut_off_in_its_closing_tag_is_that_call(forced, tail):
    """max_tokens or the context may end an answer inside the closing tag of a call written whole: it was
    dropped (forced) or came back as text, and one more token of budget gave the call."""
    markup = Markup(calls=HERMES, names=frozenset({"get_weather"}), cut_calls_are_text=not forced)
    events = markup.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' + tail)
    events += markup.flush()
    assert [type(e).__name__ for e in events] == ["ToolCallStart", "ToolCallDelta", "ToolCallEnd"]
    assert events[1].arguments == '{"city": "Paris"}'


def test_arguments_escaping_a_lone_surrogate_read_as_text():
    """JSON may escape half a UTF-16 pair; no text holds one, and the tokenizer and UTF-8 writers refuse it (an
    Anthropic answer's tool_use input with one failed to serialize)."""
    from mashbox.api.base import json_object

    assert json_value('{"q": ["\\ud800 x"], "\\udfff": "\\ud83d\\ude00"}') == {"q": ["\ufffd x"], "\ufffd": "😀"}
    assert json_object('{"q": "\\udc00"}') == {"q": "\ufffd"}
    assert json_value('{"q": "plain"}') == {"q": "plain"}
