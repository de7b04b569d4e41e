"""Reasoning and tool-call markup as a streaming text state machine.

Text goes in as the model writes it; engine events come out: ``TextDelta``,
``ReasoningDelta`` for ``<think>...</think>``, and for each complete tool
call ``ToolCallStart`` / ``ToolCallDelta`` / ``ToolCallEnd``. A partial tag at
the end of the text is held back until it is complete or proven not to be a
tag, so markup never leaks into text. A call whose body is not a valid call
ends as plain text, never as a broken call. A call the answer already made (same name,
same arguments) ends the answer: ``repeated`` turns True, nothing more comes out, and the engine
stops the request (a small model otherwise writes the same call until its token budget runs out).
So does a line of text that is a call the answer already wrote (a call to a tool that does not
exist, or one whose JSON is broken, stays text; written again, it is the same loop), a call (or
such a line) that differs from ``SAME_SHAPE`` earlier ones only in its numbers (a model counting
up: edit 195 -> 196, write 196, edit 196 -> 197, ...), and a run of more than ``BLANK_LINES``
blank lines. Across turns: a conversation whose last ``LOOP_TURNS`` assistant turns each made the
same one call and got the same result back (an agent's model reading one file again and again)
has that call counted as made, so writing it once more ends the answer; and the runtime tells the
model so (``LOOP_NOTE``, after the results) and keeps it from opening a call with its tag, so that
the answer is words. With ``ends_invented``, an answer that opens with a call by its keys alone
(``{"name": ..., "arguments": ...}``, bare or fenced) to a tool the request lacks ends there, none of
it given (``invented``): the runtime has it written again as a call to one of the request's tools.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mashbox.engine.events import Event, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from mashbox.engine.request import Message
from mashbox.engine.text.stop import overlap


@dataclass(slots=True, frozen=True)
class CallFormat:
    """How a model family writes tool calls: after ``open``, one call as JSON or a JSON list of calls,
    up to ``close``; where ``close`` is empty, up to the end of that JSON. ``args`` (Mistral's later
    form): a call may also be its name (then maybe ``call_id`` and an id), ``args``, then its arguments'
    JSON. ``listed``: the family writes a list (a forced call is written so). Hermes style by default."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    args: str = ""
    call_id: str = ""
    listed: bool = False

    @property
    def tags(self) -> tuple[str, ...]:
        """The markers of a call, which the text must keep (a family's are special tokens)."""
        return tuple(t for t in (self.open, self.close, self.args, self.call_id) if t)

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        """The calls ``(name, arguments JSON)`` of a call's body, or None if it is not a call."""
        head, marker, rest = body.partition(self.args) if self.args else (body, "", "")
        if marker and (name := self._name(head)):
            arguments = _loads(rest)
            return [(name, json.dumps(arguments, ensure_ascii=False))] if isinstance(arguments, dict) else None
        return _calls(body)

    def end(self, body: str) -> int | None:
        """Where a call written without ``close`` ends in ``body`` (the text after ``open``): after its
        JSON (at once where that cannot begin); None while it may go on."""
        start = len(body) - len(body.lstrip())
        if self.args and body[start:start + 1] not in ("", "[", "{"):  # a name first: up to ``args``
            at = body.find(self.args, start)
            if at < 0:
                so_far = body[start:]
                return None if len(so_far) < LONGEST_NAME and not any(c.isspace() for c in so_far) else start
            if self._name(body[start:at]) is None:
                return start
            start = at + len(self.args)
            start += len(body[start:]) - len(body[start:].lstrip())
        if start == len(body):
            return None
        if body[start] not in "[{":
            return start
        try:
            return json.JSONDecoder().raw_decode(body, start)[1]
        except json.JSONDecodeError:
            return None

    def _name(self, head: str) -> str | None:
        """The tool's name in a call's head (``name``, or ``name`` ``call_id`` id), or None."""
        name, _, given = head.strip().partition(self.call_id) if self.call_id else (head.strip(), "", "")
        return name if NAME.fullmatch(name) and (not given or CALL_ID.fullmatch(given)) else None


def call(value: Any) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call's JSON value, or None if it is not a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


HERMES = CallFormat()
TOOL_CALL_TOKEN = CallFormat("<|tool_call|>", "", listed=True)  # Granite 3: a list of calls after its token
TOOL_CALL_TOKENS = CallFormat("<|tool_call|>", "<|/tool_call|>", listed=True)  # Phi-4-mini: a list between two
MISTRAL = CallFormat("[TOOL_CALLS]", "", "[ARGS]", "[CALL_ID]", listed=True)  # a list, or (v11 on) name [ARGS] {...}
FAMILIES = (TOOL_CALL_TOKENS, TOOL_CALL_TOKEN, MISTRAL, HERMES)  # the first that fits (``call_format``)
NAME = re.compile(r"\w[\w.\-]*")  # a tool's name written bare (Mistral's later form), and its call's id
CALL_ID = re.compile(r"[A-Za-z0-9_\-]+")
LONGEST_NAME = 256
CALL_LIKE = '{"name"'  # a line that begins so and repeats an earlier one is a loop, even if it does not parse
# how a call written without tags begins (its blanks left out): bare or fenced, alone or in a list
CALL_STARTS = tuple(fence + bracket + CALL_LIKE for fence in ("", "```json") for bracket in ("", "["))
BLANK_LINES = 32  # more blank lines in a row than this is a loop too
SAME_SHAPE = 4  # calls an answer may make that differ only in their numbers; one more is a loop
LOOP_TURNS = 2  # turns in a row of one call with one result, after which that call is a loop
LOOP_NOTE = ("The result above is what that call returns; calling it again would return the same. Now answer the "
             "user's request with it, in words.")  # said to a model in a loop, after the results
NUMBERS = re.compile(r"\d+")
CALL_BEGUN = re.compile(r'\s*(?:```json\s*)?\[?\s*\{\s*"name"\s*(?::\s*(?:"((?:[^"\\]|\\.)*)("?))?)?')  # its name so far
BARE_START = re.compile(r'\s*(```json\s*)?((\[\s*)?\{\s*"name")')  # held text that is a call (or a list of
# calls) begun without tags
BLANK_RUN = re.compile(rf"(?:[ \t\r]*\n){{{BLANK_LINES + 1}}}")
SURROGATE = re.compile("[\ud800-\udfff]")  # after json.loads, only an escape of half a UTF-16 pair, alone
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Markup:
    """Splits model text into text, reasoning and tool-call events."""

    def __init__(self, calls: CallFormat | None = HERMES, think: bool = False, in_think: bool = False,
                 names: frozenset[str] = frozenset(), cut_calls_are_text: bool = True,
                 made: frozenset[tuple[str, str]] = frozenset(), one_call: bool = False,
                 ends_invented: bool = False) -> None:
        self.calls = calls
        self.ends_invented = ends_invented  # a call to a tool the request lacks, the answer's first words, ends it
        self.one_call = one_call  # parallel calls off: the answer ends with its first call
        self.cut_calls_are_text = cut_calls_are_text  # False: a call cut off unparsed is dropped (either way, one
        # cut off mid-way to a declared tool is: it is no text, and it never runs)
        self.names = names
        self.think = think
        self.state = "think" if in_think else "text"
        self.opening = in_think  # the prompt opened thinking: a <think> the model writes before any thought is it
        self.thought = False  # thinking just closed: the new lines that follow it are no part of the answer
        self.held = ""
        self.body = ""
        self.quoted: int | None = None  # where in the call's body a closing tag taken as a string's text is
        self.list_at = self.list_made = 0  # of a list of calls being written: where its next call begins, and
        # how many of its calls came out already (each as it closes)
        self.blank = ""
        self.num_calls = 0
        self.made: set[tuple[str, str]] = set(made)  # (name, arguments) of the calls made: one more is a loop
        self.shapes: Counter[tuple[str, str]] = Counter()  # the calls made, their numbers left out
        self.repeated = False
        self.done = False  # its one call made (one_call): nothing after it is the answer's
        self.invented = ""  # the answer, ended at its call to a tool the request lacks (``ends_invented``), held back
        self.said = False  # some event came out
        self.line = ""
        self.bare = BareCall(names) if calls and names else None
        self.after = ""

    def push(self, text: str) -> list[Event]:
        events: list[Event] = []
        buf = self.held + text
        self.held = ""
        while buf and not self.repeated and not self.done:
            buf = self._step(buf, events)
        self.said = self.said or bool(events)
        return events

    @property
    def tags(self) -> tuple[str, ...]:
        """The markers it reads: a detokenizer keeps them where the vocabulary has them as special tokens."""
        thinking = (THINK_OPEN, THINK_CLOSE) if self.think or self.state == "think" else ()
        return (self.calls.tags if self.calls else ()) + thinking

    def open_call(self) -> tuple[str, str] | None:
        """The call the model is writing, if any: its form (``tag``, or ``bare`` or ``fenced`` with
        `` list`` where a list of calls begins) and its text so far (after the opening tag; from the
        ``{`` or ``[`` of calls written without tags)."""
        if self.state == "call":
            return "tag", self.body + self.held
        begun = BARE_START.match(self.bare.text) if self.bare else None
        if begun is None:
            return None
        form = ("fenced" if begun.group(1) else "bare") + (" list" if begun.group(3) else "")
        return form, self.bare.text[begun.start(2):]

    def flush(self) -> list[Event]:
        """End of the stream: what is held back, and an unclosed call if it parses."""
        events: list[Event] = []
        held, self.held = self.held, ""
        if self.repeated or self.done:
            return events
        body = self.body + held
        cut = overlap(body, self.calls.close) if self.state == "call" and self.calls.close else 0
        whole = body[: len(body) - cut]  # a whole call whose closing tag was begun is that call
        called = self.state == "call" and self.calls.parse(whole.strip())
        if self.state == "call" and self.quoted is not None and self.cut_calls_are_text and not called:
            return events + self.push(self._unquoted(held, events)) + self.flush()
        if self.state == "call":  # cut off
            self._end_call(whole if called else body, events, closed=False)
        elif held and not self._cut_open_tag(held):
            self._emit(held, events)
        if self.bare and not self.bare.text.strip():
            self.blank += self.bare.release()
        if self.bare and self.bare.text:
            self._bare(self.bare.decide(final=True), events)
            if self.after:
                after, self.after = self.after, ""
                return events + self.push(after) + self.flush()
        if self.blank and not self.num_calls:
            events.append(TextDelta(self.blank))
        self.blank = ""
        return events

    def _cut_open_tag(self, held: str) -> bool:
        """The start of a call's opening tag, cut off where only calls are written: dropped."""
        return not self.cut_calls_are_text and self.calls is not None and self.calls.open.startswith(held)

    def _step(self, buf: str, events: list[Event]) -> str:
        if self.state == "call" and not self.calls.close:
            return self._untagged_end(buf, events)
        tags = self._tags()
        hit = min(((buf.find(t), t) for t in tags if t in buf), default=None)
        if hit is None:
            keep = max((overlap(buf, t) for t in tags), default=0)
            self._emit(buf[: len(buf) - keep], events)
            if self.after:
                return self._resume(buf[len(buf) - keep :])
            self.held = buf[len(buf) - keep :]
            return ""
        at, tag = hit
        if self.state == "call" and _in_string(self.body + buf[:at]):  # inside one of the call's strings (a
            # file's text it writes), a closing tag is that string's text
            self.quoted = len(self.body) + at if self.quoted is None else self.quoted
            self._emit(buf[: at + len(tag)], events)
            return buf[at + len(tag) :]
        if self.state == "call" and self.quoted is not None and not self.calls.parse((self.body + buf[:at]).strip()):
            return self._unquoted(buf, events)
        self._emit(buf[:at], events)
        if self.after:
            return self._resume(buf[at:])
        self._enter(tag, events)
        return buf[at + len(tag) :]

    def _unquoted(self, buf: str, events: list[Event]) -> str:
        """A call that left a string open, then closed (or ended) as no call: it ended at the first closing tag
        taken as that string's text after all, as text; what follows goes through the machine again."""
        text, at = self.body + buf, self.quoted
        self.quoted = None
        self._end_call(text[:at], events, closed=True)
        return text[at + len(self.calls.close) :]

    def _untagged_end(self, buf: str, events: list[Event]) -> str:
        """A call with no closing tag takes ``buf`` up to the end of its JSON; what follows is text again."""
        self.body += buf
        self._listed(events)
        end = self.calls.end(self.body)
        if end is None:
            return ""
        body, rest = self.body[:end], self.body[end:]
        self._end_call(body, events, closed=True)
        return rest

    def _listed(self, events: list[Event]) -> None:
        """The calls of a list being written (Granite's, Phi-4-mini's, Mistral's), each as it closes: a loop
        inside the list ends the answer there, and a list cut off keeps its whole calls."""
        if not self.calls.listed or self.done or self.repeated:
            return
        text, decoder = self.body, json.JSONDecoder()
        if not self.list_at:
            start = len(text) - len(text.lstrip())
            if text[start : start + 1] != "[":
                return
            self.list_at = start + 1
        at = self.list_at
        while not (self.done or self.repeated):
            at = _past(text, at, ",")
            if text[at : at + 1] != "{":
                break
            try:
                value, end = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                break
            if (made := call(value)) is None:
                break
            events += self._call_events(*made)
            self.list_made, at = self.list_made + 1, end
            self.list_at = at

    def _resume(self, tail: str) -> str:
        """Text after a bare call goes back through the machine, before ``tail``."""
        rest, self.after = self.after + tail, ""
        return rest

    def _tags(self) -> list[str]:
        if self.state == "think":
            return [THINK_CLOSE, THINK_OPEN] if self.opening else [THINK_CLOSE]
        if self.state == "call":
            return [self.calls.close]
        tags = [self.calls.open] if self.calls else []
        return tags + ([THINK_OPEN] if self.think else [])

    def _emit(self, text: str, events: list[Event]) -> None:
        """Text of the current state. Trailing blanks of text wait for what follows:
        more text takes them along, a tool call drops them."""
        if self.state == "call":
            self.body += text
            self._listed(events)
        elif self.state == "think":
            self.opening = self.opening and not text.strip()
            events += [ReasoningDelta(text)] if text else []
        else:
            if self.thought:
                text = text.lstrip("\r\n")
                self.thought = not text
            if self.bare and self.bare.open:
                offered, self.blank = self.bare.offer(self.blank + text), ""
                if offered is None:
                    self._bare(self.bare.decide(final=False), events)
                    return
                text = offered
            self._text(text, events)

    def _text(self, text: str, events: list[Event]) -> None:
        full = self.blank + self._watched(self._unmarked(text))
        if run := BLANK_RUN.search(full):  # a model that only writes newlines now says nothing more
            full, self.repeated = full[: run.start()], True
        body = full.rstrip()
        self.blank = full[len(body):]
        events += [TextDelta(body)] if body else []
        if body and self.bare:
            self.bare.open = False

    def _unmarked(self, text: str) -> str:
        """``text`` without the markers of a call that only a call has (its close, Mistral's [ARGS] and
        [CALL_ID]): special tokens the model wrote astray, out of a call."""
        for marker in self.calls.tags[1:] if self.calls else ():
            text = text.replace(marker, "")
        return text

    def _bare(self, decision: tuple[str, list[tuple[str, str]] | None, str] | None, events: list[Event]) -> None:
        """Act on a bare-JSON decision: (text to release, calls, text after them)."""
        if decision is None:
            return
        released, calls, rest = decision
        if calls is None and self.bare.invented and self.ends_invented and not (self.said or events):
            self.invented, self.done = released, True  # nothing of it out: the runtime has it written again, as a call
            return
        if calls is None:
            released = self._watched(released)
            events += [TextDelta(released)] if released else []
            return
        for call in calls:
            events += self._call_events(*call)
        self.after = rest

    def _enter(self, tag: str, events: list[Event]) -> None:
        if tag == THINK_OPEN:
            self.state, self.opening = "think", False
        elif tag == THINK_CLOSE:
            self.state, self.thought = "text", True
        elif self.calls and tag == self.calls.open:
            if self.bare:  # what it held was text, not a call: it goes out before the tagged call
                self._text(self.bare.release(), events)
            self.state, self.body, self.list_at, self.list_made, self.quoted = "call", "", 0, 0, None
        else:
            self._end_call(self.body, events, closed=True)

    def _end_call(self, body: str, events: list[Event], closed: bool) -> None:
        self.state = "text"
        parsed = self.calls.parse(body.strip()) if self.calls else None
        blank, self.blank = self.blank, ""
        if parsed is None:
            if self.list_made or (not closed and self._begun(body)):  # some calls out, or none begun: no text
                return
            if closed or (self.cut_calls_are_text and not cut_call(body, self.names)):
                raw = self.calls.open + body + (self.calls.close if closed else "")
                events.append(TextDelta(blank + raw))
            return
        for name, arguments in parsed[self.list_made:]:
            events += self._call_events(name, arguments)

    def _begun(self, body: str) -> bool:
        """Whether ``body``, cut off after the opening marker, is no more than the start of a call."""
        begun = body.strip()
        written = ('[{"name"', '{"name"')
        return any(w.startswith(begun) for w in written) or bool(self.calls.args and NAME.fullmatch(begun))

    def _call_events(self, name: str, arguments: str) -> list[Event]:
        if self.done:  # its one call made: the rest of a list of calls is dropped with the text after it
            return []
        if self.repeated or self._made_before(_key(name, arguments)):
            self.repeated, self.held, self.after = True, "", ""
            return []
        index, self.num_calls = self.num_calls, self.num_calls + 1
        if self.one_call:
            self.done, self.held, self.after = True, "", ""
        if self.bare:
            self.bare.open = True
        return [ToolCallStart(index, uuid.uuid4().hex[:24], name), ToolCallDelta(index, arguments),
                ToolCallEnd(index)]

    def _made_before(self, key: tuple[str, str]) -> bool:
        """Whether the answer already made this call, or ``SAME_SHAPE`` calls that differ from it
        only in their numbers; it is noted as made."""
        name, arguments = key
        shape = (name, NUMBERS.sub("0", arguments))
        seen = key in self.made or self.shapes[shape] >= SAME_SHAPE
        self.made.add(key)
        self.shapes[shape] += 1
        return seen

    def _watched(self, text: str) -> str:
        """``text`` up to the end of a line that is a call the answer already wrote (to a tool that
        does not exist, or it would be a call: a loop), then ``repeated``; else all of it."""
        start = 0
        while (end := text.find("\n", start)) >= 0:
            line, self.line, start = (self.line + text[start:end]).strip(), "", end + 1
            made = call(_loads(line)) if line.startswith("{") else None
            key = _key(*made) if made else ("", line) if line.startswith(CALL_LIKE) else None  # broken: as written
            if key is not None and self._made_before(key):
                self.repeated, self.held = True, ""
                return text[:end]
        self.line += text[start:]
        return text


class BareCall:
    """A call written without tags, as some models (Qwen2.5-Coder) answer a tool
    request: a JSON object or a ```json block that is only a call to a known tool,
    or a JSON list of such calls (Mistral writes one after its [TOOL_CALLS] token,
    which the text no longer holds). Such text is held from the start of an
    answer (or right after a call) until it is known to be a call or not; anything
    else is released as text."""

    FENCE = "```json"
    LIMIT = 16384

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.text = ""
        self.open = True
        self.invented = False

    def offer(self, text: str) -> str | None:
        """None when ``text`` is held as a possible call; else all held text, to emit as text."""
        candidate = (self.text + text).lstrip()
        listed = candidate.startswith("[") and candidate[1:].lstrip()[:1] in ("", "{")  # a list of calls begun
        keyed = candidate.startswith("{") and candidate[1:].lstrip()[:1] in ("", '"')  # an object's first key begun
        if not candidate or listed or keyed or candidate.startswith(self.FENCE) or self.FENCE.startswith(candidate):
            self.text += text
            return None
        held, self.text, self.open = self.text, "", False
        return held + text

    def decide(self, final: bool) -> tuple[str, list[tuple[str, str]] | None, str] | None:
        """None while undecided, else (held text, the calls or None, text after them)."""
        body, rest = self._split(self.text.lstrip())
        if body is None and not final and len(self.text) < self.LIMIT:
            return None
        held, self.text = self.text, ""
        if body is None and final and cut_call(held, self.names):  # cut off by a stop or the limit: no text
            self.open = False
            return "", None, ""
        calls = _calls(body) if body is not None else None
        if not calls or any(name not in self.names for name, _ in calls):
            self.open, self.invented = False, bool(calls) and _shaped(body)  # calls, to tools the request lacks
            return held, None, ""
        return held, calls, rest

    def release(self) -> str:
        """Give up what is held (a tagged call starts)."""
        held, self.text = self.text, ""
        return held

    def _split(self, text: str) -> tuple[str | None, str]:
        if text.startswith(self.FENCE):
            end = text.find("```", len(self.FENCE))
            return (None, "") if end < 0 else (text[len(self.FENCE) : end].strip(), text[end + 3 :])
        try:
            _, end = json.JSONDecoder().raw_decode(text)
        except json.JSONDecodeError:
            return None, ""
        return text[:end], text[end:]


def call_format(template: str, has_token: Callable[[str], bool]) -> CallFormat:
    """A model's call format: of ``FAMILIES`` whose opening its chat template writes (all of them where it
    writes none), the first whose markers are in the template or tokens of the vocabulary; else Hermes'."""
    written = [f for f in FAMILIES if f.open in template]
    return next((f for f in written or FAMILIES if all(t in template or has_token(t) for t in (f.open, f.close) if t)), HERMES)


def cut_call(text: str, names: frozenset[str]) -> bool:
    """Whether ``text`` is a call to one of ``names`` cut off before its end: JSON left open (no bracket
    closed once too often: that is a broken call, kept as text), its name one of them, or the start of one,
    or not yet written."""
    begun = CALL_BEGUN.match(text)
    if begun is None:
        written = "".join(text.split())  # cut before its name: ``{"`` (the first tokens of the call)
        return bool(written) and any(start.startswith(written) for start in CALL_STARTS)
    if not _left_open(text):
        return False
    name, quoted = begun.group(1), begun.group(2)
    if name is None:
        return begun.end() == len(text)  # cut right after "name"
    return name in names if quoted else any(n.startswith(name) for n in names)


def _past(text: str, at: int, separator: str) -> int:
    """Where ``text`` goes on after ``at`` past blanks and one ``separator`` (and the blanks after it)."""
    at += len(text[at:]) - len(text[at:].lstrip())
    if text.startswith(separator, at):
        at += len(separator)
        at += len(text[at:]) - len(text[at:].lstrip())
    return at


def _in_string(text: str) -> bool:
    """Whether ``text``, a call's JSON so far, ends inside one of its strings."""
    return _ends(text)[0]


def _left_open(text: str) -> bool:
    """Whether JSON ``text`` ends inside a string or an unclosed object or list (and never closes more)."""
    quoted, depth = _ends(text)
    return depth is not None and (quoted or depth > 0)


def _ends(text: str) -> tuple[bool, int | None]:
    """How JSON ``text`` ends: inside a string or not, and how many objects and lists it leaves open (None
    where it closes more than it opened)."""
    depth, lowest, quoted, escaped = 0, 0, False, False
    for char in text:
        if quoted:
            escaped, quoted = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            lowest = min(lowest, depth)
    return quoted, None if lowest < 0 else depth


def _calls(body: str) -> list[tuple[str, str]] | None:
    """The calls in a bare call's JSON: one call, or a list of calls; None if it is neither."""
    value = _loads(body)
    calls = [call(item) for item in (value if isinstance(value, list) else [value])]
    return calls if calls and all(calls) else None


def _shaped(body: str) -> bool:
    """Whether JSON ``body`` is calls by its keys alone: each object a name and its arguments (or parameters), no
    other key (``{"name": "Alice", "age": 30}`` is none)."""
    value = _loads(body)
    items = value if isinstance(value, list) else [value]
    return bool(items) and all(isinstance(item, dict) and set(item) in ({"name", "arguments"}, {"name", "parameters"})
                               for item in items)


def looping_call(messages: tuple[Message, ...]) -> tuple[str, str] | None:
    """The call (its ``_key``) that each of the conversation's last ``LOOP_TURNS`` assistant turns
    made alone, each time getting the same result back; None if they did not. A user's words sent with
    a result, before any answer (Claude Code's "[Your previous response had no visible output...]" after
    the empty answer that ends a loop), and an empty answer break no run."""
    turns: list[tuple[tuple[str, str], str]] = []
    answered = True  # no result since the last answer: a user's words are a new ask
    for i, m in enumerate(messages):
        if m.role == "assistant" and len(m.tool_calls) == 1:
            result = messages[i + 1].content if i + 1 < len(messages) and messages[i + 1].role == "tool" else None
            turns.append((_key(m.tool_calls[0].name, m.tool_calls[0].arguments), result))
        elif m.role == "assistant" and (m.tool_calls or m.content.strip()):
            turns.append(((m.role, m.content), None))
            answered = True
        elif m.role == "user" and answered:
            turns.append(((m.role, m.content), None))
        answered = answered and m.role != "tool"
    last = turns[-LOOP_TURNS:]
    if len(last) < LOOP_TURNS or last[0][1] is None or any(turn != last[0] for turn in last):
        return None
    return last[0][0]


def _key(name: str, arguments: str) -> tuple[str, str]:
    """What makes two calls the same: the name and the arguments, whatever their keys' order."""
    return name, json.dumps(_loads(arguments), sort_keys=True)


def json_value(text: str) -> Any:
    """The value of JSON ``text`` (a call's arguments), where an escaped lone surrogate (``"\\ud800"``: JSON
    allows it, no text has it; the tokenizer and the UTF-8 encoders refuse it) reads as U+FFFD. Raises
    JSONDecodeError."""
    value = json.loads(text)
    return _whole(value) if SURROGATE.search(json.dumps(value, ensure_ascii=False)) else value


def _whole(value: Any) -> Any:
    if isinstance(value, str):
        return SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_whole(k): _whole(v) for k, v in value.items()}
    return [_whole(v) for v in value] if isinstance(value, list) else value


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or JSON Python cannot hold (5,000 digits, 100,000 deep)
        return None
