"""Renders a conversation with the model's own chat template.

System and developer messages, wherever they appear, join the one system
prompt at the start. Tools reach the model through the template when it knows
tools (it renders them, as a probe tool shows); otherwise through mashbox's tool
prompt (the tools as JSON schemas and the model's call format, Hermes' by default)
around the system prompt. Assistant tool calls and tool results render back in the
form the template knows; calls it does not render (Granite 3's template drops them)
as the model writes them, and results as ``<tool_response>`` text when it knows no tools.

Tools first: where a template puts the tools inside the system turn right after
the system text (Qwen's and Hermes-style templates), the tools' schemas are moved
before the system text, so that an agent's long and stable tool definitions are a
prompt prefix shared across projects and days while its system text (working
folder, date, git status) changes; the template's call rules that follow the
schemas (after ``</tools>``) stay after the system text, next to the conversation,
where small models need them to call at all. ``verbatim`` renders the template as
written.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from hashlib import sha256
from itertools import takewhile
from os.path import commonprefix
from collections.abc import Iterable
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mashbox.engine.request import Message, Tool, ToolCall
from mashbox.engine.text.markup import HERMES, CallFormat, json_value
from mashbox.engine.text.tokenizer import Tokenizer
from mashbox.errors import InvalidRequestError


# Gemma's turns, for a GGUF of that architecture that holds no template (the pretrained Gemma 3 270M): it
# knows no system role, so the system text opens the first turn; every role but the assistant's is "user".
GEMMA_TURNS = r"""{{- bos_token -}}
{%- if messages and messages[0].role == 'system' -%}
{%- set system = messages[0].content + '\n\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}
{%- for m in turns or [{'role': 'user', 'content': ''}] -%}
{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else 'user') + '\n' + (system if loop.first else '')
    + ((m.content or '') | trim) + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"""
FALLBACKS = {"gemma2": GEMMA_TURNS, "gemma3": GEMMA_TURNS}
TURN_ENDS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")  # tokens a template closes a turn with
ALSO_ENDS = {"<|eot_id|>": "<|eom_id|>"}  # Llama 3 ends a turn that awaits a tool's result with <|eom_id|>

# Probes rendered through a template tell what it takes: where their names show, it renders tools, calls, the
# text of a turn; where it raises, it refuses them. The probe call's id is nine characters, as Mistral's must be.
PROBE = Tool("mashbox_probe_tool", "", {"type": "object", "properties": {}})
PROBE_CALL = ToolCall("abcdefghi", "mashbox_probe_call", "{}")
LONG_CALL = ToolCall("call_" + "0123456789abcdef" * 2, PROBE.name, "{}")  # an id as mashbox and OpenAI make them
PROBE_TEXT = "mashbox_probe_text"
HI = {"role": "user", "content": "Hi"}
ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
SYSTEM_MARK = "\x00mashbox-system-text\x00"  # stands for the system text while the tools block is found
CONTINUE_MARK = "\x00mashbox-answer-goes-on\x00"  # ends a continued message's text: the answer starts there
TOOLS_END = "</tools>"  # where a Hermes-style tools block's schemas end and its call rules begin


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer, verbatim: bool = False, calls: CallFormat = HERMES) -> None:
        if not tokenizer.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; use a plain prompt (complete)")
        self.source: str = tokenizer.chat_template
        self.specials = tokenizer.special_tokens_map
        try:
            self.compiled = environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as err:
            raise InvalidRequestError("messages", f"the model's chat template does not read: {err}") from err
        self.verbatim, self.calls = verbatim, calls
        shown = self._shows(_probe([HI, {"role": "assistant", "content": "Sure."}, HI]))  # tools by any turn
        self.knows_tools = "tool_calls" in self.source if shown is None else shown  # None: the probe refused
        self.shows_calls = self.knows_tools and self._shows(_probe(_asked(PROBE_CALL)), PROBE_CALL.name) is not False
        self.takes_system = bool(self._shows(_probe([{"role": "system", "content": PROBE_TEXT}, HI]), PROBE_TEXT))
        self.takes_tool_role = bool(self._shows(_probe(_asked(PROBE_CALL, self.shows_calls, PROBE_TEXT)), PROBE_TEXT))
        self.users_in_row = bool(self._shows(_probe([HI, {"role": "user", "content": PROBE_TEXT}]), PROBE_TEXT))
        self.user_after_results = bool(self._shows(_probe([*_asked(PROBE_CALL, self.shows_calls), {
            "role": "user", "content": PROBE_TEXT}]), PROBE_TEXT))
        self.many_calls = not self.shows_calls or self._shows(_probe(_asked(PROBE_CALL, also=True))) is not None
        self.short_ids = self.shows_calls and self._shows(_probe(_asked(LONG_CALL))) is None
        self.knows_thinking = "<think>" in self.source or "enable_thinking" in self.source
        late = [HI, {"role": "assistant", "content": "Sure."}, {"role": "system", "content": PROBE_TEXT}, HI]
        rendered = self._rendering(_probe(late))
        self.system_in_place = rendered is not None and -1 < rendered.find("Sure.") < rendered.find(PROBE_TEXT)

    def _shows(self, kwargs: dict[str, Any], text: str = PROBE.name) -> bool | None:
        """Whether the template renders ``text`` from ``kwargs``; None where it refuses them."""
        rendered = self._rendering(kwargs)
        return None if rendered is None else text in rendered

    def _rendering(self, kwargs: dict[str, Any]) -> str | None:
        """The template's text for ``kwargs``; None where it refuses them."""
        try:
            return self.compiled.render(**self.specials, **kwargs)
        except Exception:  # a template runs Python: whatever it raises, it refuses these turns
            return None

    def render(self, messages: tuple[Message, ...], tools: tuple[Tool, ...] = (), enable_thinking: bool | None = None,
               continue_final: bool = False) -> str:
        """The prompt: ``messages`` and ``tools`` through the template, ending where the answer begins (a
        new assistant turn; with ``continue_final``, right after the last message's text)."""
        if not continue_final:
            return self._rendered(messages, tools, enable_thinking, True)
        final = messages[-1]
        if final.role != "assistant" or not final.content.strip():
            raise InvalidRequestError("messages", "the last message cannot be continued: it is not an assistant "
                                      "message with text")
        text = final.content.rstrip()
        spaces = final.content[len(text):]  # kept where the template keeps them (transformers' rule: not trimmed)
        marked = (*messages[:-1], replace(final, content=text + CONTINUE_MARK + spaces))
        rendered = self._rendered(marked, tools, enable_thinking, False)
        if (at := rendered.find(CONTINUE_MARK)) >= 0:  # its text may be in what the template writes after it
            return rendered[:at] + spaces * rendered.startswith(spaces, at + len(CONTINUE_MARK))
        return _continued(self._rendered(messages, tools, enable_thinking, False), final)

    def _rendered(self, messages: tuple[Message, ...], tools: tuple[Tool, ...], enable_thinking: bool | None,
                  new_turn: bool) -> str:
        kwargs: dict[str, Any] = {**self.specials, "tools": None, "documents": None, "add_generation_prompt": new_turn}
        if tools and self.knows_tools:
            kwargs["tools"] = [_tool(t) for t in tools]
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        conversation = self.conversation(messages, () if self.knows_tools else tools)
        if not conversation:
            raise InvalidRequestError("messages", "holds no message with content")
        if kwargs["tools"] and not self.verbatim and conversation[0]["role"] == "system":
            return self._tools_first(conversation, kwargs)
        return self._render(conversation, kwargs)

    def _render(self, conversation: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        try:
            return self.compiled.render(messages=conversation, **kwargs)
        except Exception as err:  # a template runs Python: a ZeroDivisionError was a 500
            why = str(err) if isinstance(err, jinja2.TemplateError | ValueError) else f"{type(err).__name__}: {err}"
            raise InvalidRequestError("messages", f"the model's chat template refuses this conversation: {why}") from err

    def _tools_first(self, conversation: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        """The conversation rendered with the schemas of the template's tools block before the system
        text and its call rules after it, where the template puts that block right after the system
        text, in the system turn; else as the template has it."""
        system = conversation[0]["content"]
        marked = [{"role": "system", "content": SYSTEM_MARK}, *conversation[1:]]
        try:  # a template may refuse the conversation without its tools (Hermes 3's tool_use one)
            head, mark, after = self._render(marked, kwargs).partition(SYSTEM_MARK)
            _, plain_mark, plain_after = self._render(marked, {**kwargs, "tools": None}).partition(SYSTEM_MARK)
        except InvalidRequestError:
            return self._render(conversation, kwargs)
        block = after[: len(after) - len(plain_after)]
        closed = commonprefix([after, plain_after]).strip()  # the system turn ends before the block (Granite's)
        found = mark and plain_mark and after.endswith(plain_after) and block.strip()
        if not found or SYSTEM_MARK in after or closed:
            return self._render(conversation, kwargs)
        gap = block[: len(block) - len(block.lstrip())] or "\n\n"
        schemas, end, rules = block.lstrip().rpartition(TOOLS_END)
        if not end:
            return head + block.lstrip() + gap + system + plain_after
        return head + schemas + end + gap + system + rules + plain_after

    def conversation(self, messages: tuple[Message, ...], tools: tuple[Tool, ...] = ()) -> list[dict[str, Any]]:
        late = self._late_systems(messages)
        parts = [m.content for m in messages if m.role == "system" and m.content and id(m) not in late]
        if tools:  # the schemas first and the call rules last, unless verbatim: see the module's note
            schemas, end, rules = tool_prompt(tools, self.calls).rpartition(TOOLS_END)
            parts = [*parts, schemas + end + rules] if self.verbatim else [schemas + end, *parts, rules.strip()]
        system = "\n\n".join(parts)
        kept = _in_call_order(messages) if self.many_calls else _one_call_each(messages)
        turns = [self._turn(m) for m in kept if m.role != "system" or id(m) in late]
        if not (self.takes_tool_role and self.users_in_row):  # one turn of the user's at a time (results too)
            turns = _joined(turns)
        if not self.user_after_results:  # Mistral's: the user's words after results go with the last result
            turns = _joined(turns, after="tool")
        if system and not self.takes_system:  # the system text opens the first turn, as Gemma 3's template has it
            opens = bool(turns) and turns[0]["role"] == "user"
            first = turns[0] if opens else {"role": "user", "content": ""}
            turns = [{**first, "content": f"{system}\n\n{first['content']}".rstrip()}, *turns[opens:]]
        said = turns and any(m.role == "system" and id(m) not in late for m in messages)  # empty: no default
        return ([{"role": "system", "content": system}] if (system or said) and self.takes_system else []) + turns

    def _late_systems(self, messages: tuple[Message, ...]) -> set[int]:
        """The system messages (their ids) after the first answer, where the template renders a system turn
        there: they stay where they are (the prompt before a reminder an agent adds late is then the one it
        sent before, and cached; Claude Code's every ~20 messages). The others make the system text."""
        if not self.system_in_place:
            return set()
        first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
        return {id(m) for m in messages[first:] if m.role == "system" and m.content}

    def _turn(self, m: Message) -> dict[str, Any]:
        if m.role == "tool":
            wrapped = self.knows_tools and self.takes_tool_role
            turn = {"role": "tool" if self.takes_tool_role else "user",
                    "content": m.content if wrapped else f"<tool_response>\n{m.content}\n</tool_response>"}
            return turn | ({"tool_call_id": self._id(m.tool_call_id)} if m.tool_call_id else {})
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant" and m.reasoning:
            turn["reasoning_content"] = turn["thinking"] = m.reasoning  # gpt-oss templates read "thinking"
        if m.tool_calls:
            if self.shows_calls:
                turn["tool_calls"] = [_call(c, self._id(c.id)) for c in m.tool_calls]
            else:
                turn["content"] = "\n".join([m.content, calls_text(m.tool_calls, self.calls)]).strip()
        return turn

    def _id(self, ident: str) -> str:
        """A call's id as the template takes it: Mistral's take nine letters and digits only (and refuse
        the conversation otherwise), so any other id is made nine of them, the same each time."""
        if not self.short_ids or (len(ident) == 9 and ident.isascii() and ident.isalnum()):
            return ident
        number = int.from_bytes(sha256(ident.encode()).digest()[:8], "big")
        return "".join(ALNUM[number // 62**i % 62] for i in range(9))


def _continued(rendered: str, final: Message) -> str:
    """``rendered`` cut right after the text of ``final``, the last message (the template's own end of
    that turn dropped), so that the answer goes on from it: where the rendering lost the mark."""
    text = final.content.strip()
    at = rendered.rfind(text)
    if at < 0:
        raise InvalidRequestError("messages", "the last message cannot be continued: it is not an assistant "
                                  "message whose text the chat template shows")
    kept = final.content.lstrip()  # with its trailing spaces, where the template kept them (transformers' rule)
    return rendered[: at + (len(kept) if rendered.startswith(kept, at) else len(text))]


def turn_ends(tokenizer: Tokenizer) -> set[int]:
    """The ids of the tokens its chat template ends a turn with (an answer ends there too, where the
    model's end id is another token: Gemma's ``<end_of_turn>`` beside ``<eos>``)."""
    template = (tokenizer.chat_template or "") + (tokenizer.tool_template or "")
    ends = [token for token in TURN_ENDS if token in template]
    ids = {tokenizer.token_id(token) for token in ends + [ALSO_ENDS.get(t, t) for t in ends]}
    return {i for i in ids if i is not None}


def part_at(rendered: str, at: int, messages: tuple[Message, ...], tools: int | None = None) -> str:
    """The part of a rendered conversation that character ``at`` lies in: ``system text``,
    ``tools`` or ``message N (role)`` (N: the request's item, else the place in ``messages``, from 0),
    each part starting where its own text first appears in ``rendered`` after the part before it (so a
    token of a turn's header counts with the part before it), the tools at ``tools`` (their block's first
    character, its heading and preamble too); before them all, ``the template's opening``."""
    starts, pos = [], 0
    for i, m in enumerate(messages):
        probe = m.content[:64] or (m.tool_calls[0].name if m.tool_calls else "")
        if probe and (found := rendered.find(probe, pos)) >= 0:
            n = i if m.item is None else m.item
            opening = m.role == "system" and all(name == "system text" for _, name in starts)  # not one in place
            starts.append((found, "system text" if opening else f"message {n} ({m.role})"))
            pos = found + (len(m.content) if rendered.startswith(m.content, found) else len(probe))
    if tools is not None:
        starts.append((tools, "tools"))
    return max(((o, name) for o, name in starts if o <= at), default=(0, "the template's opening"))[1]


def _arguments(call: ToolCall) -> Any:
    try:
        return json_value(call.arguments or "{}")
    except (ValueError, RecursionError):  # not JSON, or JSON Python cannot hold (5,000 digits, 100,000 deep)
        return call.arguments


def _call(call: ToolCall, ident: str | None = None) -> dict[str, Any]:
    function = {"name": call.name, "arguments": _arguments(call)}
    return {"id": call.id if ident is None else ident, "type": "function", "function": function}


def _in_call_order(messages: tuple[Message, ...]) -> list[Message]:
    """``messages`` with the results after a turn of several calls in the calls' order (by id; those of no
    call's id after them): a template that shows no ids pairs the nth result with the nth call."""
    out = list(messages)
    for i, m in enumerate(messages):
        if m.role != "assistant" or len(m.tool_calls) < 2:
            continue
        end = next((j for j in range(i + 1, len(messages)) if messages[j].role != "tool"), len(messages))
        order = {c.id: k for k, c in enumerate(m.tool_calls)}
        out[i + 1 : end] = sorted(messages[i + 1 : end], key=lambda r: order.get(r.tool_call_id, len(order)))
    return out


def _one_call_each(messages: tuple[Message, ...]) -> list[Message]:
    """``messages`` with each assistant turn of several calls made turns of one call, each followed by its
    result (by id, else in order), for templates that take one call a turn (Llama 3's)."""
    out: list[Message] = []
    placed: set[int] = set()  # the results already put after their call (by position in ``messages``)
    for i, m in enumerate(messages):
        if i in placed:
            continue
        if m.role != "assistant" or len(m.tool_calls) < 2:
            out.append(m)
            continue
        results = list(takewhile(lambda r: r[1].role == "tool", enumerate(messages[i + 1:], i + 1)))
        by_id = {r.tool_call_id: (j, r) for j, r in results if r.tool_call_id}
        for k, c in enumerate(m.tool_calls):
            out.append(replace(m, tool_calls=(c,)) if k == 0 else Message("assistant", tool_calls=(c,)))
            result = by_id.get(c.id) or (results[k] if not by_id and k < len(results) else None)
            if result and result[0] not in placed:
                placed.add(result[0])
                out.append(result[1])
        for j, r in results:
            if j not in placed:
                placed.add(j)
                out.append(r)
    return out


def _joined(turns: list[dict[str, Any]], after: str = "user") -> list[dict[str, Any]]:
    """``turns`` with each of the user's that follows one of ``after``'s made one with it (their texts a line
    apart)."""
    out: list[dict[str, Any]] = []
    for turn in turns:
        if out and turn["role"] == "user" and out[-1]["role"] == after:
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{turn['content']}"}
        else:
            out.append(turn)
    return out


def calls_text(calls: tuple[ToolCall, ...], fmt: CallFormat) -> str:
    """``calls`` as the model writes them in ``fmt``: each between its tags (Hermes), or one list."""
    payloads = [{"name": c.name, "arguments": _arguments(c)} for c in calls]
    if fmt.listed:
        return fmt.open + json.dumps(payloads, ensure_ascii=False) + fmt.close
    return "\n".join(f"{fmt.open}\n{json.dumps(p, ensure_ascii=False)}\n{fmt.close}" for p in payloads)


def _asked(call: ToolCall, shown: bool = True, result: str = "", also: bool = False) -> list[dict[str, Any]]:
    """A user's "Hi", an assistant's turn making ``call`` (and ``also`` another one) as ``tool_calls`` where
    they are ``shown``, else in its text, then the call's ``result``."""
    calls = [call, replace(call, id=call.id[::-1])] if also else [call]
    turn = {"role": "assistant", "content": "", "tool_calls": [_call(c) for c in calls]} if shown else {
        "role": "assistant", "content": "Sure."}
    return [HI, turn, *({"role": "tool", "content": result, "tool_call_id": c.id} for c in calls)]


def _probe(messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A template's arguments for a probe: ``messages`` (a user's "Hi") and ``PROBE`` for its tools (some
    templates refuse a conversation without tools)."""
    return {"messages": messages or [HI], "tools": [_tool(PROBE)], "documents": None, "add_generation_prompt": True}


def _tool(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def tool_prompt(tools: tuple[Tool, ...], fmt: CallFormat = HERMES) -> str:
    """mashbox's tool prompt for models whose template knows no tools, calls written in ``fmt``."""
    schemas = "\n".join(json.dumps(_tool(t), ensure_ascii=False) for t in tools)
    example = calls_text((ToolCall("", "function_name", '{"argument": "value"}'),), fmt)
    if fmt.listed:
        how = (f"To call them, answer with {fmt.open} then a JSON list of calls, each an object holding a function's "
               f"name and arguments{f', then {fmt.close}' if fmt.close else ''}:\n")
    else:
        how = (f"To call one, answer with a JSON object holding its name and arguments between "
               f"{fmt.open}{fmt.close} tags, one call per pair of tags:\n")
    return (
        "# Tools\n\nYou can call these functions to help with the request. "
        "Their JSON schemas are inside <tools></tools>:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        f"{how}{example}\n"
        "The result comes back in a <tool_response></tool_response> message."
    )


def environment() -> ImmutableSandboxedEnvironment:
    """Where chat templates run, as transformers sets it up (templates are written for it): a sandbox,
    trimmed blocks, loop controls, and its ``tojson``, ``raise_exception`` and ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def unreadable(sources: Iterable[str]) -> str | None:
    """Why the first of these templates that does not compile fails to; None when all do."""
    env = environment()
    for source in sources:
        try:
            env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            return str(err)
    return None


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's text for training
    (transformers' AssistantTracker; TRL fine-tunes' templates have it): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """jinja2's ``tojson`` without its HTML escaping, with json.dumps' options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
