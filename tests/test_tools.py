"""Tool calls and thinking through the Engine on the tiny random model:
constrained decoding makes even random weights produce valid calls."""

import asyncio
import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import llguidance
import pytest
import torch
from scripted import MaskedScriptRunner, ScriptedRunner, scripted_events
from transformers import AutoTokenizer, LlamaForCausalLM

from mashbox import (
    ContextLengthError,
    Engine,
    EngineRequest,
    InvalidRequestError,
    Message,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
    Tool,
)
from mashbox.engine.events import ToolCallDelta, ToolCallEnd, ToolCallStart
from mashbox.engine.request import Named, ToolCall
from mashbox.engine.text import grammar
from mashbox.engine.text.grammar import Grammars, Matchers
from mashbox.engine.text.markup import LOOP_NOTE, Markup, looping_call
from mashbox.engine.text.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_weather(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome", "Oslo") and 1 <= args["days"] <= 7


def test_required_gives_a_valid_call(tiny_engine):
    answer = tiny_engine.chat(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.content in (None, "")
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert valid_weather(call.function.arguments) if call.function.name == "get_weather" else args["zone"] in (
            "UTC", "CET")


def test_named_tool_gives_that_call(tiny_engine):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = tiny_engine.chat(messages=ASK, tools=[TIME, WEATHER], tool_choice=choice, max_tokens=120)
    calls = answer.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] and valid_weather(calls[0].function.arguments)
    assert answer.choices[0].finish_reason == "tool_calls"


POINT = {"type": "object", "properties": {"x": {"type": "integer", "enum": [0, 1, 2]}, "y": {"type": "integer", "enum": [5, 6]}},
         "required": ["x", "y"], "additionalProperties": False}
MOVES = [  # parameters that refer within themselves, as pydantic and the SDKs write them
    {"type": "object", "$defs": {"Point": POINT}, "additionalProperties": False, "required": ["start", "end"],
     "properties": {"start": {"$ref": "#/$defs/Point"}, "end": {"$ref": "#/$defs/Point"}}},
    {"type": "object", "definitions": {"Point": POINT}, "additionalProperties": False, "required": ["start", "end"],
     "properties": {"start": {"$ref": "#/definitions/Point"}, "end": {"$ref": "#/definitions/Point"}}},
]


@pytest.mark.parametrize("parameters", MOVES, ids=["$defs", "definitions"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move"}}])
def test_a_call_follows_parameters_that_refer_within_themselves(tiny_engine, parameters, choice):
    """A reference is read from the root of the whole schema the call is checked against, of which the
    tool's parameters are a part: it named nothing there (a 400 when forced; in auto, no guard)."""
    import jsonschema

    tools = [{"type": "function", "function": {"name": "move", "parameters": parameters}}, WEATHER]
    answer = tiny_engine.chat(messages=ASK, tools=tools, tool_choice=choice, parallel_tool_calls=False, max_tokens=120)
    call = answer.choices[0].message.tool_calls[0]
    if call.function.name == "move":
        jsonschema.validate(json.loads(call.function.arguments), parameters)
    else:
        assert valid_weather(call.function.arguments)


MODE_NAMED = [{"type": "function", "function": {"name": mode, "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2]}}, "required": ["n"],
    "additionalProperties": False}}} for mode in ("auto", "none", "required")]


@pytest.mark.parametrize("name", ["auto", "none", "required"])
def test_a_tool_named_like_a_mode_is_forced_by_name_on_every_protocol(tiny_engine, name):
    """A tool may be called ``none``: chosen by name it is that call, not the mode of that name."""
    tools = [WEATHER, *MODE_NAMED]
    chat = tiny_engine.chat(messages=ASK, tools=tools, max_tokens=60,
                            tool_choice={"type": "function", "function": {"name": name}})
    assert [c.function.name for c in chat.choices[0].message.tool_calls] == [name]
    message = tiny_engine.message(messages=ASK, max_tokens=60, tool_choice={"type": "tool", "name": name}, tools=[
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in tools])
    assert [b.name for b in message.content if b.type == "tool_use"] == [name]
    response = tiny_engine.respond(input="Weather in Paris?", max_output_tokens=60, tool_choice={
        "type": "function", "name": name}, tools=[{"type": "function", **t["function"]} for t in tools])
    assert [i.name for i in response.output if i.type == "function_call"] == [name]


def test_named_tool_that_does_not_exist_is_refused(tiny_engine):
    with pytest.raises(InvalidRequestError) as err:
        tiny_engine.chat(messages=ASK, tools=[TIME], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.param == "tool_choice"


def test_none_renders_no_tools_and_parses_no_calls(tiny_engine):
    with_tools = tiny_engine.encode(EngineRequest(messages=(Message("user", "hi"),), tools=(Tool("f"),)))
    without = tiny_engine.encode(EngineRequest(messages=(Message("user", "hi"),), tools=(Tool("f"),), tool_choice="none"))
    assert len(without) < len(with_tools)
    answer = tiny_engine.chat(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"


def test_tool_prompt_reaches_a_template_without_tools(tiny_engine):
    text = tiny_engine.template.render((Message("user", "hi"),), (Tool("get_weather", "Weather", {"type": "object"}),))
    assert not tiny_engine.template.knows_tools
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text


def test_every_protocol_returns_the_forced_call(tiny_engine):
    message = tiny_engine.message(messages=ASK, max_tokens=120, tools=[{
        "name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}], tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use"
    block = message.content[-1]
    assert block.type == "tool_use" and block.id.startswith("toolu_") and valid_weather(json.dumps(block.input))
    response = tiny_engine.respond(input="Weather in Paris?", max_output_tokens=120, tools=[{
        "type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],
        tool_choice="required")
    item = response.output[-1]
    assert item.type == "function_call" and item.name == "get_weather" and valid_weather(item.arguments)


def test_streamed_calls_equal_whole_calls(tiny_engine):
    whole = tiny_engine.chat(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120)
    chunks = list(tiny_engine.chat(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    names = [d.function.name for d in deltas if d.function and d.function.name]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert names == [c.function.name for c in whole.choices[0].message.tool_calls]
    assert arguments == "".join(c.function.arguments for c in whole.choices[0].message.tool_calls)


THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_engine(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(path)
    with Engine(str(path), ctx=512, slots=4, quiet=True) as engine:
        yield engine


def test_thinking_budget_ends_the_thinking(thinking_engine):
    request = EngineRequest(messages=(Message("user", "Think about it."),), enable_thinking=True, thinking_budget=6,
                            sampling=SamplingParams(max_tokens=40))
    events = list(thinking_engine.stream(request))
    kinds = [type(e) for e in events if isinstance(e, (ReasoningDelta, TextDelta))]
    assert kinds and kinds[0] is ReasoningDelta, "a thinking template starts the answer in thinking"
    assert TextDelta in kinds and kinds.index(TextDelta) > kinds.index(ReasoningDelta)
    assert all(k is TextDelta for k in kinds[kinds.index(TextDelta):]), "thinking ended once"
    close = len(thinking_engine.tokenizer.encode("</think>\n\n", add_special_tokens=False))
    assert 6 <= events[-1].usage.reasoning_tokens <= 6 + close


def test_thinking_off_emits_no_reasoning(thinking_engine):
    answer = thinking_engine.chat(messages=[{"role": "user", "content": "hi"}], enable_thinking=False, max_tokens=12)
    assert answer.choices[0].message.reasoning_content is None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0


def test_required_lets_the_model_end_after_any_call_and_one_call_only_without_parallel(tiny_engine):
    """After a complete call the grammar allows the end of the answer (or, with parallel calls, a
    newline and another call); without parallel calls only the end."""
    tool = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    tok = tiny_engine.tokenizer
    eos = tok.eos_token_id
    for parallel, expected in ((True, {eos, *tok.encode("\n", add_special_tokens=False)}), (False, {eos})):
        constraint = tiny_engine.grammars.for_tools((tool,), "required", parallel)
        for token in tok.encode(call, add_special_tokens=False):
            constraint.accept(token)
        row = torch.zeros(len(tok))
        constraint.mask(row)
        assert set((row == 0).nonzero().flatten().tolist()) == expected



def test_calls_whose_tags_are_single_tokens_are_followed_to_their_end(smol_tokenizer):
    """Where the vocabulary holds ``<tool_call>`` and ``</tool_call>`` as tokens of their own (Qwen's),
    which llguidance takes for special tokens, a forced call and a guarded one accept them and end: the
    grammar once matched the tags as text only, so the model's own tag token broke the constraint and a
    forced call came out as an empty answer (qwen2.5-coder-0.5b, tool_choice required)."""
    hf = copy.deepcopy(smol_tokenizer)
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    tok = Tokenizer.of(hf)
    grammars = Grammars(tok, [tok.eos_token_id])
    tool = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})
    body = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    ids = tok.encode(f"<tool_call>\n{body}\n</tool_call>", add_special_tokens=False)
    assert ids[0] == tok.backend_tokenizer.token_to_id("<tool_call>") and len(ids) > 3

    def follow(constraint, tokens):
        for token in tokens:
            row = torch.zeros(len(tok))
            constraint.mask(row)
            assert row[token] == 0, f"{tok.decode([token])!r} refused"
            constraint.accept(token)
        assert not constraint.matcher.is_error(), constraint.matcher.get_error()
        return constraint

    assert follow(grammars.for_tools((tool,), "required", False), ids).matcher.is_accepting()
    guard = grammars.guard((tool,)).follow(("tag", tok.decode(ids[1:3])), ids[:3])  # the call begun: tag, 2 tokens
    assert follow(guard, ids[3:]).matcher.is_accepting()

def test_a_model_that_writes_the_same_call_again_is_stopped_after_the_first(smol_tokenizer):
    """A looping small model writes one call until max_tokens (Pi on mashbox: a 1,024-token answer
    of the same call). The engine ends the answer as the repeat closes: one call, tool_calls."""
    call = '<tool_call>\n{"name": "read", "arguments": {"path": "secret.txt"}}\n</tool_call>\n'
    script = smol_tokenizer.encode(call * 20, add_special_tokens=False)
    runner = ScriptedRunner(script)
    events = scripted_events(runner, smol_tokenizer, len(script), Markup(names=frozenset({"read"})))
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["read"]
    assert events[-1].reason == "tool_calls"
    assert runner.sampled <= 2 * len(smol_tokenizer.encode(call, add_special_tokens=False))


@pytest.mark.parametrize("parallel", [True, False])
def test_with_parallel_calls_off_the_answer_ends_with_its_first_call(tiny_engine, smol_tokenizer, parallel):
    """parallel_tool_calls false (Responses' default; Anthropic's disable_parallel_tool_use) in auto mode:
    one call, and the answer ends there (a grammar held it to one only when a call was forced)."""
    calls = ['<tool_call>\n{"name": "read", "arguments": {"path": "%s"}}\n</tool_call>\n' % p for p in "abcd"]
    script = smol_tokenizer.encode("Reading them.\n" + "".join(calls) + "Done.", add_special_tokens=False)
    tools = (Tool("read", "", {"type": "object", "properties": {"path": {"type": "string"}}}),)
    request = EngineRequest(messages=(Message("user", "Read a, b, c and d."),), tools=tools, parallel_tool_calls=parallel)
    runner = ScriptedRunner(script)
    events = scripted_events(runner, smol_tokenizer, len(script), tiny_engine._job(request).markup)
    made = [e.index for e in events if isinstance(e, ToolCallStart)]
    assert made == ([0, 1, 2, 3] if parallel else [0])
    assert events[-1].reason == ("length" if parallel else "tool_calls")  # the script's end, or the call's
    assert "".join(e.text for e in events if isinstance(e, TextDelta)).startswith("Reading them.")
    assert parallel or runner.sampled < len(script) // 2  # it stopped writing there


@pytest.mark.parametrize("opening, closing", [("<tool_call>\n", "\n</tool_call>"), ("", ""), ("```json\n", "\n```"),
                                              ("[", "]"), ("```json\n[ ", " ]\n```")])
def test_a_call_begun_in_auto_mode_can_only_name_a_declared_tool(tiny_engine, smol_tokenizer, opening, closing):
    """Auto mode: free text stays free; once a call begins (tags, bare JSON or a ```json block, either
    of them maybe a list of calls as Mistral writes them),
    every token up to its end is masked to the declared tools' names and schemas, so the invented
    tool name the script goes on to write is refused at its first token; after the call, free again."""
    tok = smol_tokenizer
    prefix = "Let me look.\n" if opening.startswith("<") else ""  # a bare call starts the answer
    begun = f'{prefix}{opening}{{"name": "'
    written = begun + 'get_weather", "arguments": {"city": "Oslo", "days": 2}}' + closing
    script = tok.encode(written, add_special_tokens=False) + tok.encode("\nDone.", add_special_tokens=False)
    runner = MaskedScriptRunner(script + [tok.eos_token_id], len(tok))
    tools = tuple(Tool(t["function"]["name"], "", t["function"]["parameters"]) for t in (WEATHER, TIME))
    markup = Markup(names=frozenset(t.name for t in tools))
    events = scripted_events(runner, tok, len(script) + 1, markup, tiny_engine.grammars.guard(tools))
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["get_weather"]
    texts = [tok.decode(script[: i + 1]) for i in range(len(script))]
    first_masked = next(i for i, allowed in enumerate(runner.allowed) if allowed is not None)
    marker = opening.strip() if opening.startswith("<") else '{"name"'  # where the markup sees a call begun
    assert marker in texts[first_masked - 1] and marker not in texts[first_masked - 2]
    name_tokens = runner.allowed[next(i for i, text in enumerate(texts) if text.endswith(begun)) + 1]
    invented = tok.encode("read", add_special_tokens=False)[0]
    assert invented not in name_tokens and tok.encode("get", add_special_tokens=False)[0] in name_tokens
    call_end = next(i for i, text in enumerate(texts) if text.rstrip().endswith(written.rstrip()))
    in_call = enumerate(runner.allowed[first_masked:call_end + 1], first_masked)
    assert all(a is not None and script[i] in a for i, a in in_call)
    assert all(a is None for a in runner.allowed[call_end + 1:]), "text after the call is free again"


def _guarded(engine, tok, written: str) -> tuple[list[int], MaskedScriptRunner, list]:
    """``written`` (then the end), as a model in auto mode writes it through the guard of WEATHER and TIME."""
    script = tok.encode(written, add_special_tokens=False) + [tok.eos_token_id]
    runner = MaskedScriptRunner(script, len(tok))
    tools = tuple(Tool(t["function"]["name"], "", t["function"]["parameters"]) for t in (WEATHER, TIME))
    markup = Markup(names=frozenset(t.name for t in tools))
    return script, runner, scripted_events(runner, tok, len(script), markup, engine.grammars.guard(tools))


def test_a_call_begun_with_llama_3s_parameters_key_is_guarded_as_written(tiny_engine, smol_tokenizer):
    """Llama 3's templates ask for {"name": ..., "parameters": ...}: the guard lets the model write that key
    (each token of the call allowed), and the call comes out with its arguments."""
    tok = smol_tokenizer
    written = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'
    script, runner, events = _guarded(tiny_engine, tok, written)
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [e.name for e in starts] == ["get_weather"]
    first_masked = next(i for i, allowed in enumerate(runner.allowed) if allowed is not None)
    assert all(a is not None and script[i] in a for i, a in enumerate(runner.allowed[first_masked:-1], first_masked))


def test_a_list_of_calls_is_guarded_to_its_end(tiny_engine, smol_tokenizer):
    """Auto mode: a list of two calls (Mistral's form) is masked call after call, each token of it
    allowed, and gives both calls; a third name in it could only be a declared tool."""
    tok = smol_tokenizer
    written = ('[{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}, '
               '{"name": "get_time", "arguments": {"zone": "CET"}}]')
    script, runner, events = _guarded(tiny_engine, tok, written)
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["get_weather", "get_time"]
    texts = [tok.decode(script[: i + 1]) for i in range(len(script) - 1)]
    second = next(i for i, text in enumerate(texts) if text.endswith('{"name": "'))
    second = next(i for i, text in enumerate(texts) if i > second and text.endswith('{"name": "'))
    assert tok.encode("read", add_special_tokens=False)[0] not in runner.allowed[second + 1]
    first_masked = next(i for i, allowed in enumerate(runner.allowed) if allowed is not None)
    assert all(a is not None and script[i] in a for i, a in enumerate(runner.allowed[first_masked:-1], first_masked))


def test_a_grammar_is_compiled_once_and_each_request_gets_its_own_matcher_at_its_start(smol_tokenizer, monkeypatch):
    """Auto mode's guard compiled a call's grammar on the engine's thread at every call (0.15-0.4 s for 100
    tools, every stream waiting); an agent sends the same tools at every turn, so a grammar met before is now a
    copy of the first's matcher, kept at its start: the second request's call and its forced call compile
    nothing, and follow their own tokens from the start, whatever the first's did. Other tools, or a schema
    llguidance cannot hold (the same 400 again), compile; past the kept characters the oldest go."""
    compiled = []
    real = llguidance.LLMatcher

    def counted(*args, **kwargs):
        compiled.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", counted)
    tok = Tokenizer.of(smol_tokenizer)
    grammars = Grammars(tok, [tok.eos_token_id])
    tools = tuple(Tool(t["function"]["name"], "", t["function"]["parameters"]) for t in (WEATHER, TIME))
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    ids = tok.encode(call, add_special_tokens=False)

    def guarded(tokens, begun=3):  # the call begun: its first tokens
        constraint = grammars.guard(tools).follow(("bare", tok.decode(ids[:begun])), ids[:begun])
        for token in tokens[begun:]:
            row = torch.zeros(len(tok))
            row[token] = 1  # the model's pick
            constraint.mask(row)
            assert row[token] == 1 and row.isinf().any(), f"{tok.decode([token])!r} refused, or no mask"
            constraint.accept(token)
        return constraint

    assert guarded(ids).matcher.is_accepting()
    assert len(compiled) == 1
    assert guarded(ids).matcher.is_accepting(), "the second request's matcher starts where the first's did"
    assert not guarded(ids[:-3]).matcher.is_accepting()
    assert len(compiled) == 1, "the same tools: nothing compiled again"
    text_of, written = grammar.tool_grammar, []
    monkeypatch.setattr(grammar, "tool_grammar", lambda *args: written.append(args) or text_of(*args))
    forced = [grammars.for_tools(tools, "required") for _ in range(3)]
    assert len(compiled) == 2 and len({id(f.matcher) for f in forced}) == 3
    assert len(written) == 1, "a forced call's grammar text written once too (20-30 ms for 100 tools)"
    assert grammars.guard(tools[:1]).follow(("bare", tok.decode(ids[:3])), ids[:3]) is not None
    assert len(compiled) == 3, "other tools, another grammar"
    bad = (Tool("f", "", {"type": "object", "properties": {"x": {"type": "string", "pattern": "a(b"}}}),)
    for _ in range(2):  # the call's grammar, then its parameters' alone for the message: each compiled once
        with pytest.raises(InvalidRequestError, match="regex") as refused:
            grammars.for_tools(bad, "required")
        assert refused.value.param == "tools" and "the tool 'f'" in refused.value.message
    assert len(compiled) == 5
    small = Matchers(grammars.matchers.tokenizer, chars=len(compiled[1]) + 10)
    for text in (compiled[1], compiled[1], compiled[2], compiled[1]):
        small.get(text)
    assert compiled[5:] == [compiled[1], compiled[2], compiled[1]], "one kept: the first compiled again after the other"


def test_a_call_that_cannot_name_a_declared_tool_stays_free_and_ends_as_text(tiny_engine, smol_tokenizer):
    """A call whose written start no declared tool fits (the name already wrong when the markup
    sees the call) is left free until it ends (then ends as text, as before)."""
    tok = smol_tokenizer
    tools = (Tool("get_weather", "", WEATHER["function"]["parameters"]),)
    guard = tiny_engine.grammars.guard(tools)
    wrong = tok.encode('{"name": "readFileNotes"', add_special_tokens=False)
    assert guard.follow(("bare", '{"name": "readFileNotes"'), wrong) is None
    assert guard.follow(("bare", '{"name": "get'), wrong) is None, "given up until the call ends"
    assert guard.follow(None, wrong) is None
    right = tok.encode('{"name": "get', add_special_tokens=False)
    assert guard.follow(("bare", '{"name": "get'), right) is not None


def test_which_requests_are_guarded(tiny_engine, tiny_model_dir):
    """Auto mode with tools is guarded; a forced call has its own grammar; no tools, none;
    ``constrain_calls=False`` leaves auto mode free."""
    ask = (Message("user", "Weather?"),)
    tools = (Tool("get_weather", "", WEATHER["function"]["parameters"]),)
    assert tiny_engine._job(EngineRequest(messages=ask, tools=tools)).guard is not None
    assert tiny_engine._job(EngineRequest(messages=ask, tools=tools, tool_choice="required")).guard is None
    assert tiny_engine._job(EngineRequest(messages=ask)).guard is None
    with Engine(str(tiny_model_dir), ctx=256, slots=1, quiet=True, constrain_calls=False) as free:
        assert free._job(EngineRequest(messages=ask, tools=tools)).guard is None


@pytest.mark.parametrize("capture", ["claude-code_POST_v1_messages.json", "codex-exec_POST_v1_responses.json",
                                     "pi-openai-completions_POST_v1_chat_completions.json"])
def test_the_agents_own_tools_are_guarded(tiny_engine, capture):
    """The captured agents' tool lists (Claude Code's use propertyNames, which llguidance does not
    implement: ignored) make a guard whose first name token can only start a declared tool."""
    body = json.loads((Path(__file__).parent / "fixtures/clients" / capture).read_text())["body"]
    specs = [t.get("function", t) for t in body["tools"]]
    tools = tuple(Tool(f["name"], "", f.get("input_schema") or f.get("parameters") or {}) for f in specs if "name" in f)
    tok = tiny_engine.tokenizer
    assert tiny_engine.grammars.for_tools(tools, "required") is not None, "tool_choice required compiles too"
    constraint = tiny_engine.grammars.guard(tools).follow(("tag", '{"name": "'), tok.encode('{"name": "'))
    row = torch.zeros(len(tok))
    constraint.mask(row)
    starts = {tok.decode([i]) for i in (row == 0).nonzero().flatten().tolist()}
    assert starts and all(any(t.name.startswith(s) for t in tools) for s in starts)


def _turns(*results: str, call=ToolCall("c", "read", '{"path": "secret.txt"}')) -> tuple[Message, ...]:
    """A user ask, then one assistant call per result, each answered with that result."""
    turns = [Message("user", "What is the secret word?")]
    for result in results:
        turns += [Message("assistant", "", tool_calls=(call,)), Message("tool", result, tool_call_id="c")]
    return tuple(turns)


def test_a_call_made_and_answered_alike_two_turns_running_is_a_loop():
    key = ("read", json.dumps({"path": "secret.txt"}))
    assert looping_call(_turns("walrus", "walrus")) == key
    assert looping_call(_turns("walrus", "walrus", "walrus")) == key
    assert looping_call(_turns("walrus")) is None, "one turn is not yet a loop"
    assert looping_call(_turns("old", "new")) is None, "a file that changed is read again rightly"
    answered = (*_turns("walrus", "walrus"), Message("assistant", "It is walrus."))
    assert looping_call((*answered, Message("user", "Read it again"))) is None, "a new ask after an answer"
    nudged = (*_turns("walrus", "walrus"), Message("assistant", ""),  # the loop's empty answer
              Message("user", "[Your previous response had no visible output. Please continue and produce a "
                              "user-visible response.]"))
    assert looping_call(nudged) == key, "Claude Code asks again: its model called again, and on and on"
    assert looping_call(nudged[:-2] + nudged[-1:]) == key  # it sends the words with the result, no empty answer
    other = ToolCall("c", "read", '{"path": "other.txt"}')
    assert looping_call((*_turns("walrus"), *_turns("walrus", call=other)[1:])) is None


def test_the_looping_call_ends_the_answer_in_auto_mode_only(tiny_engine, smol_tokenizer, monkeypatch):
    """The third identical read after two identical results ends the answer with no call (the agent gets
    an empty answer); with tool_choice required the grammar still rules."""
    tools = (Tool("read", "", {"type": "object", "properties": {"path": {"type": "string"}}}),)
    looping = EngineRequest(messages=_turns("walrus", "walrus"), tools=tools)
    markup = tiny_engine._job(looping).markup
    call = '<tool_call>\n{"name": "read", "arguments": {"path": "secret.txt"}}\n</tool_call>'
    assert markup.push(call) + markup.flush() == [] and markup.repeated
    fresh = tiny_engine._job(EngineRequest(messages=_turns("walrus"), tools=tools)).markup
    assert [type(e) for e in fresh.push(call) + fresh.flush()] == [ToolCallStart, ToolCallDelta, ToolCallEnd]
    required = EngineRequest(messages=looping.messages, tools=tools, tool_choice="required")
    assert not tiny_engine._job(required).markup.made and tiny_engine._out_of_loop(required) is required
    prefill = EngineRequest(messages=(*looping.messages, Message("assistant", "")), tools=tools, continue_final=True)
    assert tiny_engine._out_of_loop(prefill) is prefill, "the text of a prefill goes on: no turn after it"
    asked = EngineRequest(messages=(*looping.messages, Message("user", "Now read other.txt.")), tools=tools)
    assert tiny_engine._out_of_loop(asked) is asked, "a user's words after the results may ask for a call"
    assert tiny_engine._out_of_loop(looping) is not looping
    assert not tiny_engine._job(looping).markup.ends_invented, "told to answer in words: no call written for it"
    assert tiny_engine._job(EngineRequest(messages=_turns("walrus"), tools=tools)).markup.ends_invented
    monkeypatch.setattr(tiny_engine, "config", replace(tiny_engine.config, constrain_calls=False))
    assert tiny_engine._out_of_loop(looping) is looping, "--free-calls: calls as the model writes them, no note"


class Overruled:
    """The engine's runner, its sampled tokens overruled by a script's (``MaskedScriptRunner``: masked by each
    request's constraint as a model's would be)."""

    def __init__(self, runner, script: MaskedScriptRunner) -> None:
        self.runner, self.script = runner, script

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def run(self, plan) -> list[int]:
        return self.script.run(plan)


@pytest.mark.parametrize("opening, closing", [("```json\n", "\n```"), ("", "")])
def test_an_answer_that_opens_with_a_call_to_a_tool_the_request_lacks_is_written_again_as_a_call(
        tiny_model_dir, smol_tokenizer, opening, closing):
    """qwen2.5-coder-0.5b answered Codex with a fenced {"name": "read_file_secret", "arguments": {...}}: a call by
    its keys, to no tool of the request's, where the model leant to no declared tool (so the guard let it go), and
    the agent took it for the answer. Such an answer, before any of it is given, is written again as a call to one
    of the request's tools (as tool_choice required); the tokens of both are counted. JSON that is no call by its
    keys, or a call after words, stays text."""
    tok = smol_tokenizer
    with Engine(str(tiny_model_dir), ctx=512, slots=2, speculation=False, quiet=True) as engine:  # a token a step
        def answer(written: str, again: str = "", twin: bool = False, tools=(WEATHER, TIME), most: int = 60):
            first = tok.encode(written, add_special_tokens=False)
            script = MaskedScriptRunner([*first, *tok.encode(again, add_special_tokens=False), tok.eos_token_id],
                                        len(tok))
            core = engine._core
            core.runner = Overruled(runner := core.runner, script)
            try:
                fields = {"messages": ASK, "tools": list(tools), "max_tokens": most}
                return (asyncio.run(engine.achat(**fields)) if twin else engine.chat(**fields)), len(first), script
            finally:
                core.runner = runner
        invented = f'{opening}{{"name": "read_weather", "arguments": {{"city": "Oslo"}}}}{closing}'
        again = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":2}}\n</tool_call>'  # as held
        for twin in (False, True):  # the engine's event stream and its async twin
            completion, spent, script = answer(invented, again, twin)
            choice = completion.choices[0]
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
            assert calls == [("get_weather", {"city": "Oslo", "days": 2})]
            assert all(a is not None for a in script.allowed[spent:]), "held from its first token"
            assert completion.usage.completion_tokens == script.sampled > spent  # both answers
            assert engine.stats().finished == {"stop": 1 + twin}, "one request, one finish"
            if not twin:  # the engine's first request: its prompt read whole, the second answer's from the cache
                assert completion.usage.prompt_tokens_details.cached_tokens == completion.timings.cache_n == 0
        completion, spent, _ = answer(invented, again, most=len(tok.encode(invented, add_special_tokens=False)) + 5)
        assert completion.usage.completion_tokens == spent + 5 and completion.choices[0].finish_reason == "length"
        for text in (f'{opening}{{"name": "Alice", "age": 30}}{closing}', f"Here: {invented}"):
            choice = answer(text)[0].choices[0]
            assert choice.finish_reason == "stop" and choice.message.content == text and not choice.message.tool_calls
        lookahead = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "pattern": "(?=O)"}}}}}
        choice = answer(invented, tools=[lookahead])[0].choices[0]  # no grammar holds it: the answer as written
        assert choice.finish_reason == "stop" and choice.message.content == invented


def test_stop_strings_end_the_text_and_never_a_call_inside_its_tags(tiny_model_dir, smol_tokenizer):
    """A stop string met inside a call's arguments ("}", a word of them) ended the answer mid-call, and the cut
    call was dropped: stops are read in the text only. The text still ends before one; one held back as the call
    begins is given to the call, and none matches across a call."""
    tok = smol_tokenizer
    with Engine(str(tiny_model_dir), ctx=512, slots=2, speculation=False, quiet=True) as engine:
        def answer(written: str, stop: list[str]):
            script = MaskedScriptRunner([*tok.encode(written, add_special_tokens=False), tok.eos_token_id], len(tok))
            core = engine._core
            core.runner = Overruled(runner := core.runner, script)
            try:
                return engine.chat(messages=ASK, tools=[WEATHER, TIME], stop=stop, max_tokens=80).choices[0]
            finally:
                core.runner = runner
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
        for stop in (["}"], ["Paris"], ['"days"'], ["\n"], ["\n{"]):
            choice = answer(f"Let me look.{call}", stop)
            assert choice.finish_reason == "tool_calls", (stop, choice)
            assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
                ("get_weather", {"city": "Paris", "days": 2})], stop
            assert choice.message.content == "Let me look.", stop
        choice = answer(f"It is sunny in Paris. {call}", ["Paris"])
        assert choice.finish_reason == "stop" and choice.message.content == "It is sunny in "
        assert not choice.message.tool_calls
        choice = answer(f"Look{call}ed up.", ["Looked"])  # not across the call
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Looked up."


@pytest.mark.parametrize("stop", ["\n", "}", "Paris", '"days"'])
@pytest.mark.parametrize("chunks", [
    ["Sure.", "<tool_call", ">\n", '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
     "\n</tool_call>"],
    ["{", '"name": "get_weather", "arguments": {"city": "Paris",', ' "days": 2}}']],
    ids=["a token that ends the tag and begins the call", "a call without tags"])
def test_no_stop_string_cuts_a_call_however_its_text_comes(chunks, stop):
    """qwen2.5-coder writes a forced call's tag with a token `>\n`, and its calls in auto mode without tags:
    the stop "\n" cut the first before the markup saw the tag, and every stop met in the second cut it."""
    from mashbox.engine.core import Stream
    from mashbox.engine.request import SamplingParams
    from mashbox.engine.sched.sequence import Sequence
    from mashbox.engine.text.stop import StopMatcher

    class Chunks:  # a detokenizer that gives these texts, one a token
        def __init__(self) -> None:
            self.left = iter(chunks)

        def push(self, token: int) -> str:
            return next(self.left)

        def flush(self) -> str:
            return ""

    class Held(list):  # the stream's channel: what it holds
        hold = list.append

    seq = Sequence("s", [1], SamplingParams(stop=(stop,)), 64)
    events = Held()
    stream = Stream(seq, Chunks(), StopMatcher((stop,)), Markup(names=frozenset({"get_weather"})), channel=events)
    for token in range(len(chunks)):
        stream.push(token)
        assert not stream.ended, (stop, token)
    events += stream.markup.flush()
    calls = [e for e in events if type(e).__name__ == "ToolCallStart"]
    assert [c.name for c in calls] == ["get_weather"], events
    arguments = "".join(e.arguments for e in events if type(e).__name__ == "ToolCallDelta")
    assert json.loads(arguments) == {"city": "Paris", "days": 2}


CHATML_CALLS = ("{% for m in messages %}{% if m.role != 'system' or loop.first or late %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
                "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")


@pytest.mark.parametrize("late", [True, False])
def test_a_model_in_a_loop_is_told_so_and_answers_in_words(tmp_path, smol_tokenizer, late):
    """After two identical calls with identical results, the prompt says that a third would return the same,
    after the results (in a system turn where the template keeps a late one in place, else the user's), the
    prompt before them unchanged (cached); and the answer cannot open a call: a scripted model that opens one
    after every prompt, with words its second choice, writes words there, and a call elsewhere."""
    from tiny import scripted

    source = tmp_path / "source"
    hf = copy.deepcopy(smol_tokenizer)
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    hf.save_pretrained(source)
    template = CHATML_CALLS.replace(" or late", " or true" if late else "")
    model = scripted(tmp_path / "model", source, template, ["\n", "<tool_call>", "The"], think_tokens=False)
    llama = LlamaForCausalLM.from_pretrained(model)
    with torch.no_grad():  # after the new line, "The" is its second choice
        head, new_line = llama.lm_head.weight, int(llama.model.embed_tokens.weight[hf.encode("\n")[0]].argmax())
        head[hf.encode("The")[0], new_line] = 40.0
    llama.save_pretrained(model)
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    call = {"id": "c", "type": "function", "function": {"name": "read", "arguments": '{"path": "secret.txt"}'}}
    with Engine(str(model), ctx=1024, slots=1, quiet=True) as engine:
        def answer(results: list[str]) -> tuple[str, str, list]:
            messages = [{"role": "user", "content": "What is the secret word?"}]
            for result in results:
                messages += [{"role": "assistant", "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c", "content": result}]
            request = EngineRequest(messages=_turns(*results), tools=(Tool("read", "", {"type": "object"}),))
            plain = engine.tokenizer.decode(engine.tokenizer.encode(engine._rendered(request), add_special_tokens=False))
            told = engine.tokenizer.decode(engine.encode(request))
            completion = engine.chat(messages=messages, tools=tools, max_tokens=4)
            assert completion.usage.prompt_tokens == len(engine.encode(request)), "the count is of what is read"
            chosen = completion.choices[0]
            return plain, told, [chosen.message.content, chosen.finish_reason]
        plain, told, fresh = answer(["walrus"])
        assert told == plain and fresh == ["", "length"]  # a call begun (the guard holds it to JSON)
        plain, told, looping = answer(["walrus", "walrus"])
        results = plain[: plain.rindex("</tool_response>") + len("</tool_response>")]
        assert told.startswith(results) and told.endswith("<|im_start|>assistant\n"), told[-300:]
        note = f"<|im_start|>{'system' if late else 'user'}\n{LOOP_NOTE}<|im_end|>"
        assert note in told[len(results):], told[-300:]
        assert looping == ["The", "stop"]


@pytest.mark.parametrize(("schema", "said"), [({"type": "foo"}, "Invalid type: foo"),
                                              ({"type": "string", "pattern": "(?=a)"}, "")])
def test_a_schema_that_cannot_be_enforced_says_why_in_its_own_words(smol_tokenizer, schema, said):
    """Not where in mashbox's grammar text the error arose, nor that text (the schema, 'x-guidance' and all)."""
    tok = Tokenizer.of(smol_tokenizer)
    with pytest.raises(InvalidRequestError) as refused:
        Grammars(tok, [tok.eos_token_id]).for_schema(schema)
    message = refused.value.message
    assert message.startswith("the schema cannot be enforced: ") and said in message, message
    assert "x-guidance" not in message and "\n" not in message and "start:" not in message, message


def test_a_call_begun_without_tags_is_the_models_only_where_it_leans_to_a_declared_tool(tiny_engine, smol_tokenizer):
    """JSON of the model's own that begins {"name": ("Alice", "left-pad") was forced into a call to a declared
    tool: a bare or fenced start is held to the tools only while the model's own pick is allowed, or an allowed
    token but for its case (Claude Code's Read where the model leans to "read"); a tagged one always."""
    tok = smol_tokenizer
    tools = (Tool("get_weather", "", WEATHER["function"]["parameters"]),)
    begun = tok.encode('{"name": "', add_special_tokens=False)

    def masked(form: str, pick: str) -> tuple[torch.Tensor, object]:
        constraint = tiny_engine.grammars.guard(tools).follow((form, '{"name": "'), begun)
        row = torch.zeros(len(tok))
        row[tok.encode(pick, add_special_tokens=False)[0]] = 5.0  # the model's pick, by far
        constraint.mask(row)
        return row, constraint

    alice = tok.encode("Alice", add_special_tokens=False)[0]
    row, constraint = masked("bare", "Alice")
    assert torch.isfinite(row).all() and constraint.released, "its own JSON: left free"
    row, constraint = masked("bare", "get")
    assert not torch.isfinite(row[alice]) and not constraint.released and constraint.tentative
    row, constraint = masked("fenced", "Get")
    assert not torch.isfinite(row[alice]) and not constraint.tentative, "a tool but for its case: held from here on"
    row, constraint = masked("tag", "Alice")
    assert not torch.isfinite(row[alice]), "a tag is a call whatever the model leans to"


def test_a_models_own_json_that_begins_with_name_stays_text(tiny_engine, smol_tokenizer):
    tok = smol_tokenizer
    written = '{"name": "Alice", "age": 30}'
    script, runner, events = _guarded(tiny_engine, tok, written)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == written
    assert not any(isinstance(e, ToolCallStart) for e in events)


def test_a_local_shell_call_runs_something_for_some_time(tiny_engine, smol_tokenizer):
    """Codex's local_shell: a forced call wrote {"command": ["ls"], "timeout_ms": 0}, which kills the command at
    once; an empty argv runs nothing."""
    from mashbox.api.responses_tools import LOCAL_SHELL_PARAMETERS

    tool = Tool("local_shell", "", LOCAL_SHELL_PARAMETERS)
    for arguments, whole in [('{"command":["ls"],"timeout_ms":5', True), ('{"command":["ls"],"timeout_ms":0', False),
                             ('{"command":[]', False)]:
        constraint = tiny_engine.grammars.for_tools((tool,), "required")
        ids = smol_tokenizer.encode(f'<tool_call>\n{{"name":"local_shell","arguments":{arguments}',
                                    add_special_tokens=False)
        assert (constraint.matcher.try_consume_tokens(ids) == len(ids)) == whole, arguments


def test_a_required_list_of_no_names_is_a_400_not_a_500(tiny_engine):
    """``"required": [["a"]]``: the check whether it names a key the properties lack raised TypeError (a 500)."""
    tool = Tool("f", "", {"type": "object", "properties": {"a": {}}, "required": [["a"]]})
    with pytest.raises(InvalidRequestError, match="a tool's parameters schema cannot be enforced"):
        tiny_engine.grammars.for_tools((tool,), "required")


@pytest.mark.parametrize("name", ["", "  "])
def test_a_tool_of_no_name_is_refused(name):
    """Forced, its call was written with an empty name and came back as text (``any`` promises a call)."""
    with pytest.raises(ValueError, match="tools: a tool's name is empty"):
        EngineRequest(messages=(Message("user", "x"),), tools=(Tool(name, "", {"type": "object"}),), tool_choice="required")


def test_a_tool_whose_parameters_are_no_object_is_refused():
    with pytest.raises(ValueError, match="'f': its parameters must be an object schema"):
        EngineRequest(messages=(Message("user", "x"),), tools=(Tool("f", "", {"type": "string"}),))


def test_a_schema_that_cannot_be_enforced_names_its_tool(tiny_engine):
    good = Tool("ok", "", {"type": "object", "properties": {"a": {}}})
    bad = Tool("lost", "", {"type": "object", "properties": {"n": {"$ref": "#/$defs/Nope"}}})
    with pytest.raises(InvalidRequestError, match="the tool 'lost': ") as err:
        tiny_engine.grammars.for_tools((good, bad), "required")
    assert "'/$defs/Nope'" in err.value.message  # the tool's own pointer, not where mashbox keeps its schema


def test_a_lone_tool_that_cannot_be_enforced_is_named_with_its_own_words(tiny_engine):
    """The error named neither the tool nor its property, but the key mashbox wraps arguments in."""
    never = Tool("save", "", {"type": "object", "properties": {"n": {"enum": []}}, "required": ["n"]})
    with pytest.raises(InvalidRequestError, match="the tool 'save': ") as err:
        tiny_engine.grammars.for_tools((never,), Named("save"))
    assert "'n'" in err.value.message and "'arguments'" not in err.value.message, err.value.message


def test_references_in_a_schemas_data_are_data(tiny_engine):
    """A ``$ref`` inside ``const`` or ``enum`` is a value to write as it is: it was pointed at where mashbox
    keeps the tool's schema, and the call wrote that, against the tool's own schema."""
    import jsonschema

    parameters = {"type": "object", "$defs": {"N": {"type": "integer", "enum": [1, 2]}}, "required": ["n", "c", "e"],
                  "properties": {"n": {"$ref": "#/$defs/N"}, "c": {"const": {"$ref": "#/$defs/N"}},
                                 "e": {"enum": [{"$ref": "#/x"}]}}, "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "save", "parameters": parameters}}]
    answer = tiny_engine.chat(messages=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False,
                              max_tokens=120)
    arguments = json.loads(answer.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(arguments, parameters)
    assert arguments["c"] == {"$ref": "#/$defs/N"}


@pytest.mark.parametrize(("parameters", "arguments", "whole"), [
    ({"type": "object", "properties": {}}, "{}", True),  # a tool of no parameters, as most frameworks write it
    ({"type": "object", "properties": {}}, '{"type":"object"', False),  # a word of its schema: f(type=...) failed
    ({"type": "object", "properties": {"text": {"type": "string"}}}, '{"text":"a","required":', False),
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {}}}}}, '{"o":{"y":', False),
    ({"type": "object", "properties": {"text": {}}, "additionalProperties": True}, '{"text":1,"more":2}', True),
    ({"type": "object", "properties": {"d": {"type": "object"}}}, '{"d":{"any":1}}', True),  # any object stays any
    ({"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]}, '{"a":1,"b":2}', True),
    ({"type": "object", "$defs": {"base": {"type": "object", "properties": {"city": {}}, "required": ["city"]}},
      "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"unit": {}}, "required": ["unit"]}]},
     '{"city":1,"unit":2}', True),  # "extends" (OpenAPI, TypeScript): its base, closed alone, refused the unit
    ({"$ref": "#/definitions/A", "definitions": {"A": {"type": "object", "properties": {"q": {}}}}}, '{"q":1}', True),
    ({"$ref": "#/definitions/A", "definitions": {"A": {"type": "object", "properties": {"q": {}}}}}, '{"q":1,"type"',
     False),  # zod's named form, no type at its root: it was not held to its schema at all
    ({"properties": {"q": {}}, "required": ["q"]}, '{"x"', False),
    ({"type": ["object"], "properties": {"q": {}}}, '{"q":1,"x"', False),
    ({"type": "object", "properties": {"p": {}, "u": {}}, "anyOf": [{"required": ["p"]}, {"required": ["u"]}]},
     '{"p":1,"anyOf"', False),  # parts that only require keys list none: the object stays closed
    ({"type": "object", "properties": {"query": {}}, "required": ["query", "limit"]}, '{"query":1,"limit":2}',
     True),  # requires a key it does not list: closed, no call fit it (forced, another tool was called instead)
])
def test_a_calls_arguments_name_only_the_keys_its_schema_lists(tiny_engine, smol_tokenizer, parameters, arguments,
                                                                whole):
    """An object schema that lists its properties and says nothing of others takes no others (xgrammar's
    strict mode; llguidance allowed any key, and a 0.5B model filled calls with ``type`` and ``required``)."""
    constraint = tiny_engine.grammars.for_tools((Tool("f", "", parameters),), "required")
    ids = smol_tokenizer.encode(f'<tool_call>\n{{"name":"f","arguments":{arguments}', add_special_tokens=False)
    assert (constraint.matcher.try_consume_tokens(ids) == len(ids)) == whole, arguments


def test_a_function_declared_without_parameters_is_called_with_none(tiny_engine, smol_tokenizer):
    """OpenAI: omitted parameters are an empty list. They were any object: a forced call of ``now()`` came
    with made-up arguments (``{"argument": 1}``), on Chat, Responses and the tasks' client tools."""
    from mashbox.api import openai_chat, openai_responses, task_items
    from mashbox.api.base import parse

    ask = [{"role": "user", "content": "What time is it?"}]
    declared = [
        openai_chat.to_engine(parse(openai_chat.ChatRequest, {
            "messages": ask, "tools": [{"type": "function", "function": {"name": "now"}}]})).tools,
        openai_responses.to_engine(parse(openai_responses.ResponsesRequest, {
            "input": "hi", "tools": [{"type": "function", "name": "now"}]})).tools,
        task_items.client_tools(parse(task_items.CreateTask, {
            "user_message_content": "hi", "stream": False, "client_tools": [{"type": "function", "function": {"name": "now"}}]})),
    ]
    for tools in declared:
        constraint = tiny_engine.grammars.for_tools(tools, "required")
        for arguments, whole in (("{}", True), ('{"argument":1}', False)):
            ids = smol_tokenizer.encode(f'<tool_call>\n{{"name":"now","arguments":{arguments}}}', add_special_tokens=False)
            assert (constraint.matcher.try_consume_tokens(ids) == len(ids)) == whole, (tools, arguments)
            constraint.matcher.reset()


@pytest.mark.parametrize("arguments", ['{"n": ' + "1" * 5000 + "}", "[" * 100_000 + "]" * 100_000])
def test_past_call_arguments_python_cannot_hold_are_kept_as_text_not_a_500(tiny_engine, arguments):
    """A number of 5,000 digits (past Python's int limit) or 100,000 levels of nesting in an earlier call's
    arguments raised ValueError or RecursionError out of the template: a 500 on every route."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(ContextLengthError):  # rendered, as text: longer than this context (a 400, not a 500)
        tiny_engine.chat(messages=messages, tools=tools, max_tokens=2)


@pytest.mark.parametrize("text", ['{"n": ' + "1" * 5000 + "}", "[" * 100_000 + "]" * 100_000])
def test_an_answer_of_json_python_cannot_hold_is_no_call(text):
    from mashbox.engine.text.markup import _loads

    assert _loads(text) is None
