"""Each model family's own call format: Granite 3's ``<|tool_call|>[...]``, Phi-4-mini's
``<|tool_call|>[...]<|/tool_call|>`` and Mistral's ``[TOOL_CALLS]`` (a list, or name ``[ARGS]``
arguments), whose markers are special tokens of their vocabularies. The markers are kept through the
detokenizer for requests that parse calls, so a call after text is a call and not leaked JSON; the
chat template gets the family's tools turn, and calls its template drops come back in the family's
form; forced and guarded calls are written in it. Tokenizers here are SmolLM2's with the family's
markers added as special tokens, templates laid out as the families' are."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from scripted import MaskedScriptRunner, ScriptedRunner, scripted_events
from tiny import tiny_config
from transformers import LlamaForCausalLM

from mashbox import Engine
from mashbox.engine.events import TextDelta, ToolCallDelta, ToolCallStart
from mashbox.engine.request import Message, Tool, ToolCall
from mashbox.engine.text.detokenizer import Detokenizer
from mashbox.engine.text.grammar import Grammars
from mashbox.engine.text.markup import (
    HERMES,
    MISTRAL,
    TOOL_CALL_TOKEN,
    TOOL_CALL_TOKENS,
    Markup,
    call_format,
)
from mashbox.engine.text.template import ChatTemplate
from mashbox.engine.text.tokenizer import Tokenizer

# Granite 3.3's layout: a system turn (its default names the call format where tools are given), the tools
# as a turn of their own, then each message's text alone: an assistant turn's tool_calls are not rendered.
GRANITE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set system = 'You are Granite.' + (' When a tool is required, "
    "respond only with <|tool_call|> followed by a JSON list of tools used.' if tools else '') %}"
    "{%- set turns = messages %}{%- endif %}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system + '<|end_of_text|>\n' }}"
    "{%- if tools %}{{- '<|start_of_role|>available_tools<|end_of_role|>' + tools | tojson(indent=4) + "
    "'<|end_of_text|>\n' }}{%- endif %}"
    "{%- for m in turns %}{{- '<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] + "
    "'<|end_of_text|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)
GRANITE_MARKERS = ("<|tool_call|>", "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>")
# Phi-4-mini's: turns of role tokens, no tools or calls in the template; its calls' two markers in the vocabulary.
PHI = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
PHI_MARKERS = ("<|tool_call|>", "<|/tool_call|>", "<|end|>")
MISTRAL_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
                    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}</s>{% else %}"
                    "{{ m['content'] }}</s>{% endif %}{% endfor %}")
MISTRAL_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
QWEN = "{% for m in messages %}{{ m['content'] }}{% if m.tool_calls %}<tool_call></tool_call>{% endif %}{% endfor %}"

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False})
TIME = Tool("get_time", "", {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                             "required": ["zone"], "additionalProperties": False})
NAMES = frozenset({WEATHER.name, TIME.name})
OSLO = '{"city": "Oslo", "days": 1}'


def family(smol_tokenizer, template: str, markers: tuple[str, ...]):
    """SmolLM2's tokenizer with ``markers`` added as special tokens and ``template`` as its chat template."""
    hf = copy.deepcopy(smol_tokenizer)
    hf.add_special_tokens({"additional_special_tokens": list(markers)})
    hf.chat_template = template
    return hf


def format_of(hf):
    return call_format(hf.chat_template, lambda t: hf.backend_tokenizer.token_to_id(t) is not None)


@pytest.fixture(scope="module")
def granite(smol_tokenizer):
    return family(smol_tokenizer, GRANITE, GRANITE_MARKERS)


@pytest.fixture(scope="module")
def granite_engine(granite, tmp_path_factory):
    """A tiny random Llama whose tokenizer and template are Granite-shaped (its vocabulary has room for the
    markers)."""
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("granite-shaped")
    LlamaForCausalLM(tiny_config(len(granite))).eval().save_pretrained(path)
    granite.save_pretrained(path)
    with Engine(str(path), ctx=1024, slots=2, quiet=True) as engine:
        yield engine
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("template, markers, expected", [
    (GRANITE, GRANITE_MARKERS, TOOL_CALL_TOKEN),
    (PHI, PHI_MARKERS, TOOL_CALL_TOKENS),  # by its vocabulary: the template names no marker
    (MISTRAL_TEMPLATE, MISTRAL_MARKERS, MISTRAL),
    (MISTRAL_TEMPLATE, ("[TOOL_CALLS]",), MISTRAL),  # Mistral Nemo's: no [ARGS] token
    (QWEN, ("<|tool_call|>",), HERMES),  # the template's own tags win over a marker its vocabulary still has
    (PHI, (), HERMES),
])
def test_each_family_is_read_in_its_own_call_format(smol_tokenizer, template, markers, expected):
    assert format_of(family(smol_tokenizer, template, markers)) == expected


GRANITE_CALLS = ('Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
                 '{"name": "get_time", "arguments": {"zone": "UTC"}}]')
PHI_CALL = 'Checking.<|tool_call|>[{"name": "get_time", "arguments": {"zone": "CET"}}]<|/tool_call|> Done.'
MISTRAL_LIST = 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'
MISTRAL_NAMED = '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 1}'
NO_CALL = "[TOOL_CALLS]I cannot call a tool here."
MISTRAL_ID = 'Checking.[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris", "days": 2} Done.'  # Small 3.2


@pytest.mark.parametrize("template, markers, written, text, calls", [
    (GRANITE, GRANITE_MARKERS, GRANITE_CALLS, "Let me check.",
     [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]),
    (PHI, PHI_MARKERS, PHI_CALL, "Checking. Done.", [("get_time", {"zone": "CET"})]),
    (MISTRAL_TEMPLATE, MISTRAL_MARKERS, MISTRAL_LIST, "Sure.", [("get_time", {"zone": "UTC"})]),
    (MISTRAL_TEMPLATE, MISTRAL_MARKERS, MISTRAL_NAMED, "",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "days": 1})]),
    (MISTRAL_TEMPLATE, MISTRAL_MARKERS, MISTRAL_ID, "Checking. Done.", [("get_weather", {"city": "Paris", "days": 2})]),
    (MISTRAL_TEMPLATE, MISTRAL_MARKERS, NO_CALL, NO_CALL, []),
])
def test_a_familys_calls_after_text_are_calls(smol_tokenizer, template, markers, written, text, calls):
    """Written token by token as the model writes them (each marker its one special token), through the
    engine's detokenizer and markup: the text around the calls, and the calls, nothing of them as text
    (the markers were dropped as special tokens, so the JSON after them leaked into the answer)."""
    hf = family(smol_tokenizer, template, markers)
    script = hf.encode(written, add_special_tokens=False)
    assert all(hf.convert_tokens_to_ids(m) in script for m in markers if m in written)
    fmt = format_of(hf)
    events = scripted_events(ScriptedRunner(script + [hf.eos_token_id]), hf, len(script) + 1,
                             Markup(calls=fmt, names=NAMES))
    said = "".join(e.text for e in events if isinstance(e, TextDelta))
    made = [(e.name, json.loads(d.arguments)) for e, d in zip(
        [e for e in events if isinstance(e, ToolCallStart)], [e for e in events if isinstance(e, ToolCallDelta)])]
    assert (said, made) == (text, calls)


def test_the_markers_are_kept_only_where_calls_are_read(granite):
    """A request without tools answers with the special tokens left out, as before."""
    ids = granite.encode(GRANITE_CALLS, add_special_tokens=False)

    def text(kept):
        detok = Detokenizer(granite, [], kept)
        return "".join(detok.push(i) for i in ids) + detok.flush()

    assert text(TOOL_CALL_TOKEN.tags) == GRANITE_CALLS
    assert text(()) == GRANITE_CALLS.replace("<|tool_call|>", "")


def test_with_parallel_calls_off_a_list_of_calls_gives_its_first_only():
    for fmt, written in ((TOOL_CALL_TOKEN, GRANITE_CALLS), (HERMES, GRANITE_CALLS.split("<|tool_call|>")[1])):
        markup = Markup(calls=fmt, names=NAMES, one_call=True)
        events = markup.push(written) + markup.flush()
        assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["get_weather"], fmt


def test_granites_template_gets_its_tools_turn_and_the_calls_made_in_its_form(granite):
    """Granite's template shows tools in a turn of its own (it never names ``tool_calls``, so mashbox once
    took it for a template without tools and wrote its own Hermes prompt in the system text); the calls
    of earlier turns, which it does not render, come back as Granite writes them; its system turn stays
    whole (the tools are not moved into it)."""
    fmt = format_of(granite)
    template = ChatTemplate(Tokenizer.of(granite), calls=fmt)
    assert template.knows_tools and not template.shows_calls
    conversation = (Message("system", "Be brief."), Message("user", "Weather in Oslo?"),
                    Message("assistant", "", tool_calls=(ToolCall("c1", "get_weather", OSLO),)),
                    Message("tool", "12 C", tool_call_id="c1"))
    rendered = template.render(conversation, (WEATHER,))
    assert rendered.startswith("<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
                               "<|start_of_role|>available_tools<|end_of_role|>[")
    assert '"name": "get_weather"' in rendered and "# Tools" not in rendered and "<tool_call>" not in rendered
    assert ('<|start_of_role|>assistant<|end_of_role|><|tool_call|>[{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "days": 1}}]<|end_of_text|>\n<|start_of_role|>tool<|end_of_role|>12 C') in rendered


def test_a_template_without_tools_is_told_the_familys_call_format(smol_tokenizer):
    """Phi-4-mini's template shows no tools: mashbox's tool prompt asks for its own markers, and earlier
    calls come back in them, so that what the model is shown is what the markup reads."""
    hf = family(smol_tokenizer, PHI, PHI_MARKERS)
    template = ChatTemplate(Tokenizer.of(hf), calls=format_of(hf))
    assert not template.knows_tools
    conversation = (Message("user", "Time?"), Message("assistant", "", tool_calls=(ToolCall("c", "get_time",
                                                                                              '{"zone": "UTC"}'),)),
                    Message("tool", "12:00", tool_call_id="c"), Message("user", "And in CET?"))
    rendered = template.render(conversation, (TIME,))
    assert '<|tool_call|>[{"name": "function_name", "arguments": {"argument": "value"}}]<|/tool_call|>' in rendered
    assert '<|assistant|><|tool_call|>[{"name": "get_time", "arguments": {"zone": "UTC"}}]<|/tool_call|><|end|>' \
        in rendered
    assert "<tool_call>" not in rendered


def test_a_forced_call_is_written_in_the_familys_form(granite_engine):
    """tool_choice required on the Granite-shaped model: the grammar writes ``<|tool_call|>[...]`` (the
    marker as its token) and the answer is that call, valid under its schema."""
    tok = granite_engine.tokenizer
    constraint = granite_engine.grammars.for_tools((WEATHER,), "required")
    ids = tok.encode('<|tool_call|>[{"name":"get_weather","arguments":{"city":"Rome","days":3}}]',
                     add_special_tokens=False)
    assert ids[0] == tok.backend_tokenizer.token_to_id("<|tool_call|>")
    for token in ids:
        row = torch.zeros(len(tok))
        constraint.mask(row)
        assert row[token] == 0, tok.decode([token])
        constraint.accept(token)
    assert constraint.matcher.is_accepting()
    answer = granite_engine.chat(messages=[{"role": "user", "content": "Weather?"}], tools=[
        {"type": "function", "function": {"name": WEATHER.name, "parameters": WEATHER.parameters}}],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80)  # a random model lists calls on and on
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content in (None, "")
    call = choice.message.tool_calls[0].function
    arguments = json.loads(call.arguments)
    assert call.name == "get_weather" and arguments["city"] in ("Paris", "Rome", "Oslo") and 1 <= arguments["days"] <= 7


@pytest.mark.parametrize("template, markers, begun, rest", [
    (GRANITE, GRANITE_MARKERS, 'Sure.<|tool_call|>[{"name": "', 'get_time", "arguments": {"zone": "CET"}}]'),
    (MISTRAL_TEMPLATE, MISTRAL_MARKERS, "Sure.[TOOL_CALLS]", 'get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}'),
])
def test_a_call_begun_in_the_familys_form_can_only_name_a_declared_tool(smol_tokenizer, template, markers, begun,
                                                                        rest):
    """Auto mode: once the model writes the family's marker, its call is masked to the declared tools (the
    name first); the text before it, and the marker itself, are free."""
    hf = family(smol_tokenizer, template, markers)
    tok = Tokenizer.of(hf)
    fmt = format_of(hf)
    script = hf.encode(begun + rest, add_special_tokens=False)
    runner = MaskedScriptRunner(script + [hf.eos_token_id], len(hf))
    guard = Grammars(tok, [hf.eos_token_id], fmt).guard((WEATHER, TIME))
    events = scripted_events(runner, hf, len(script) + 1, Markup(calls=fmt, names=NAMES), guard)
    assert [(e.name, json.loads(d.arguments)) for e, d in zip(
        [e for e in events if isinstance(e, ToolCallStart)], [e for e in events if isinstance(e, ToolCallDelta)])] \
        == [("get_time", {"zone": "CET"})]
    marker = script.index(hf.convert_tokens_to_ids(fmt.open))
    assert all(a is None for a in runner.allowed[: marker + 1]), "the text and the marker itself are free"
    assert all(a is not None and script[i] in a for i, a in enumerate(runner.allowed[marker + 1: len(script)],
                                                                      marker + 1))
    allowed = runner.allowed[len(hf.encode(begun, add_special_tokens=False))]
    assert hf.encode("get", add_special_tokens=False)[0] in allowed
    assert hf.encode("read", add_special_tokens=False)[0] not in allowed


def calls_of(events) -> list[str]:
    return [e.name for e in events if isinstance(e, ToolCallStart)]


@pytest.mark.parametrize("fmt", [TOOL_CALL_TOKEN, TOOL_CALL_TOKENS, MISTRAL])
def test_a_list_of_calls_gives_each_call_as_it_closes(fmt):
    """A list cut off by max_tokens lost its whole calls with it (Granite, tool_choice required: no call at 20,
    80 or 120 tokens), and a model writing one call again and again inside a list did so to the end of its
    budget, the loop never seen. Written a character at a time or whole, the same."""
    first, second = ('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}',
                     '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    cut = f"{fmt.open}[{first}, {second[:20]}"
    for pieces in ([cut], list(cut)):
        markup = Markup(calls=fmt, names=NAMES, cut_calls_are_text=False)
        events = [e for piece in pieces for e in markup.push(piece)] + markup.flush()
        assert calls_of(events) == ["get_weather"] and not any(isinstance(e, TextDelta) for e in events)
    markup = Markup(calls=fmt, names=NAMES)
    events = markup.push(f"{fmt.open}[{second}, {first}, {second}, {second}, {second}")
    assert markup.repeated and calls_of(events) == ["get_time", "get_weather"]
    markup = Markup(calls=fmt, names=NAMES)
    whole = markup.push(f"{fmt.open}[{first}, {second}]{fmt.close} Done.") + markup.flush()
    assert calls_of(whole) == ["get_weather", "get_time"] and [e.text for e in whole if isinstance(e, TextDelta)] \
        == [" Done."]


def test_a_familys_markers_out_of_a_call_are_no_text():
    """The detokenizer keeps a family's markers for the markup; those only a call has (Phi-4-mini's close,
    Mistral's [ARGS] and [CALL_ID]) written astray came out as the answer's text."""
    markup = Markup(calls=TOOL_CALL_TOKENS, names=NAMES)
    events = markup.push('[{"name": "get_time", "arguments": {"zone": "UTC"}}]<|/tool_call|> Done.') + markup.flush()
    assert calls_of(events) == ["get_time"] and "".join(e.text for e in events if isinstance(e, TextDelta)) == " Done."
    markup = Markup(calls=MISTRAL, names=NAMES)
    events = markup.push("Sure[ARGS], here[CALL_ID] it is.") + markup.flush()
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Sure, here it is."


def test_a_tool_whose_name_begins_with_a_digit_is_called_in_mistrals_named_form():
    """``3d_render`` is a valid tool name for OpenAI and Anthropic; the guard steered the model into it, and the
    markup's name pattern then refused it: the markers came out as text."""
    markup = Markup(calls=MISTRAL, names=frozenset({"3d_render"}))
    events = markup.push('[TOOL_CALLS]3d_render[ARGS]{"scene": "cube"}') + markup.flush()
    assert calls_of(events) == ["3d_render"] and not any(isinstance(e, TextDelta) for e in events)


@pytest.mark.parametrize("markers, written, refused", [
    (MISTRAL_MARKERS, '[TOOL_CALLS]get_time[ARGS]{"zone":"UTC"}', '[TOOL_CALLS][{"name"'),  # Small 3.x
    (("[TOOL_CALLS]",), '[TOOL_CALLS][{"name":"get_time","arguments":{"zone":"UTC"}}]', "[TOOL_CALLS]get_time"),  # Nemo
])
def test_a_forced_mistral_call_is_written_in_the_form_its_vocabulary_has(smol_tokenizer, markers, written, refused):
    """Small 3.x writes (and its template renders) name [ARGS] arguments; the grammar forced the older list."""
    hf = family(smol_tokenizer, MISTRAL_TEMPLATE, markers)
    grammars = Grammars(Tokenizer.of(hf), [hf.eos_token_id], format_of(hf))
    constraint = grammars.for_tools((TIME,), "required", False)
    for token in hf.encode(written, add_special_tokens=False):
        row = torch.zeros(len(hf))
        constraint.mask(row)
        assert row[token] == 0, hf.decode([token])
        constraint.accept(token)
    assert constraint.matcher.is_accepting()
    other = grammars.for_tools((TIME,), "required", False)
    marker, first = hf.encode(refused, add_special_tokens=False)[:2]
    other.accept(marker)
    row = torch.zeros(len(hf))
    other.mask(row)
    assert row[first] != 0, f"{hf.decode([first])!r} after the marker is the other form"
