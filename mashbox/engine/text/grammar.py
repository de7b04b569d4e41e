"""Constrained decoding of tool calls with llguidance.

For ``tool_choice`` ``required`` (some call must come out) or a named tool
(that call must come out), a request's tokens are masked at every step so the
answer is exactly ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(or the model family's own form, as Granite's ``<|tool_call|>[{...}]``)
with arguments valid under the tool's JSON schema. In ``auto`` mode the text
stays free, but once the model has begun a call in a form the markup reads (the
tags, a bare ``{"name"``, a ```` ```json ```` block) the rest of that call is
masked the same way (``CallGuard``): it names a declared tool, with arguments
valid under that tool's schema. Works on CPU and GPU.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import llguidance
import numpy as np
import torch

from mashbox.engine.request import Named, Tool, ToolChoice, object_typed
from mashbox.engine.text.markup import HERMES, CallFormat
from mashbox.engine.text.tokenizer import Tokenizer
from mashbox.errors import InvalidRequestError

STRICT_JSON = {"whitespace_flexible": False}
TOOL_JSON = {**STRICT_JSON, "lenient": True}  # keywords llguidance lacks (propertyNames) ignored in tool schemas
FLEXIBLE_JSON = {**TOOL_JSON, "whitespace_flexible": True}  # a call the model began, as it lays it out
KEYS = ("arguments", "parameters")  # where a call the model began holds its arguments (Llama 3's: parameters)
NAMED = re.compile(r'"name"\s*:\s*"(?:[^"\\]|\\.)*"')  # a call's name, written whole
KEPT_CHARS = 1_000_000  # the grammars ``Matchers`` keeps compiled, in characters of their text (each ~50 bytes
# compiled: 100 tools of 20 parameters write 232k characters, 11.5 MB; Claude Code's 24 tools 40k)


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema of a call's arguments: the tool's parameters (``closed``) where they describe an object,
    with or without ``"type": "object"`` at their root (zod's ``{"$ref": ...}``, a root ``anyOf``, bare
    ``properties``); else any object (``{}``: no parameters said)."""
    params = tool.parameters
    if not (object_typed(params) or (params.get("type") is None and OBJECT_WORDS & params.keys())):
        return {"type": "object"}
    return {**closed(params), "type": "object"}


OBJECT_WORDS = frozenset({"properties", "required", "$ref", "allOf", "anyOf", "oneOf", "additionalProperties",
                          "patternProperties"})  # a root without a type that still describes an object
DATA = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are JSON data, not schemas
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
BRANCHES = frozenset({"allOf", "anyOf", "oneOf"})
ADDS_KEYS = frozenset({"properties", "additionalProperties", "patternProperties", "unevaluatedProperties", "$ref",
                       "if", "dependentSchemas", "dependencies"}) | BRANCHES  # a schema that may list more keys
OPENED = ADDS_KEYS - BRANCHES - {"properties"}  # beside its properties: an object whose keys are not all listed


def closed(root: dict[str, Any]) -> dict[str, Any]:
    """``root`` where an object schema that lists its ``properties`` and says nothing of others takes no
    others (``additionalProperties: false``, as xgrammar's strict mode does): left open, a small model
    fills a call with words of the schema itself (``{"type": "object", "properties": ...}``), and a tool
    called as ``f(**arguments)`` fails. Not where a schema's keys are listed in parts: the parts of an
    ``allOf`` (inline or referred to) and its whole, an object beside ``anyOf``/``oneOf`` parts that list
    keys, and those parts."""
    return _closed(root, "#", _parts(root), merged=False)


def _closed(node: Any, path: str, parts: set[str], merged: bool) -> Any:
    if isinstance(node, list):
        return [_closed(v, f"{path}/{i}", parts, merged) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        at = f"{path}/{key}"
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _closed(schema, f"{at}/{_escaped(name)}", parts, f"{at}/{_escaped(name)}" in parts)
                        for name, schema in value.items()}
        elif key in BRANCHES:
            out[key] = _closed(value, at, parts, key == "allOf" or "properties" in node)
        else:
            out[key] = value if key in DATA else _closed(value, at, parts, False)
    adds = bool(OPENED & node.keys()) or any(_adds_keys(b) for k in BRANCHES for b in node.get(k) or ())
    if isinstance(node.get("properties"), dict) and not merged and not adds and not _requires_more(node):
        out["additionalProperties"] = False
    return out


def _requires_more(node: dict[str, Any]) -> bool:
    """Whether ``node`` requires a key its ``properties`` do not list: closed, no object would fit it."""
    required = node.get("required")
    listed = node["properties"]
    return isinstance(required, list) and any(isinstance(key, str) and key not in listed for key in required)


def _adds_keys(part: Any) -> bool:
    return isinstance(part, dict) and bool(ADDS_KEYS & part.keys())


def _parts(node: Any, beside: bool = False) -> set[str]:
    """The local references that are parts of an ``allOf``, or of an ``anyOf``/``oneOf`` beside listed
    properties (``beside``): what they point to lists only some of an object's keys."""
    found: set[str] = set()
    if isinstance(node, list):
        for value in node:
            found |= _parts(value, beside)
    elif isinstance(node, dict):
        if beside and isinstance(ref := node.get("$ref"), str) and ref.startswith("#"):
            found.add(ref)
        for key, value in node.items():
            if key not in DATA:
                found |= _parts(value, key == "allOf" or (key in BRANCHES and "properties" in node))
    return found


def _escaped(name: str) -> str:
    """``name`` as a JSON pointer writes it."""
    return name.replace("~", "~0").replace("/", "~1")


def call_schema(tool: Tool, key: str = "arguments", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    parameters = parameters or arguments_schema(tool)
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }


def calls_body(tools: Iterable[Tool], guidance: dict[str, Any], keys: tuple[str, ...] = ("arguments",)) -> str:
    """The grammar rule ``body``: one call to any of ``tools`` as JSON, its arguments under one of ``keys``,
    read with ``guidance``. A tool whose parameters refer within themselves (``#/$defs/...``, as pydantic
    writes them) is kept whole under the body's ``$defs``, its references pointed there."""
    defs: dict[str, Any] = {}
    kept = [(t, _kept(t, f"tool{i}", defs)) for i, t in enumerate(tools)]
    schemas = [call_schema(t, key, parameters) for t, parameters in kept for key in keys]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return f"body: %json {json.dumps({**schema, **({'$defs': defs} if defs else {}), 'x-guidance': guidance})}\n"


def _kept(tool: Tool, name: str, defs: dict[str, Any]) -> dict[str, Any] | None:
    """A reference to ``tool``'s parameters kept as ``defs[name]``, where they refer within themselves (a
    reference is read from the root of the whole schema, which theirs no longer is); None where they do not."""
    parameters = arguments_schema(tool)
    if not _refers(parameters):
        return None
    defs[name] = _pointed(parameters, f"#/$defs/{name}")
    return {"$ref": f"#/$defs/{name}"}


def _refers(node: Any, names: bool = False) -> bool:
    """Whether a schema holds a local reference (``#...``); not in its data (``const``, ``enum``, ...).
    ``names``: ``node`` maps names to schemas (``properties``), its keys are no keywords."""
    if isinstance(node, list):
        return any(_refers(v) for v in node)
    if not isinstance(node, dict):
        return False
    if not names and isinstance(ref := node.get("$ref"), str) and ref.startswith("#"):
        return True
    return any(_refers(v, k in NAMED_SCHEMAS and not names) for k, v in node.items() if names or k not in DATA)


def _pointed(node: Any, root: str, names: bool = False) -> Any:
    """``node`` with each local reference (``#...``) made relative to ``root``; its data (``const``,
    ``enum``, ...) as it is."""
    if isinstance(node, list):
        return [_pointed(v, root) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in DATA and not names else _pointed(v, root, k in NAMED_SCHEMAS and not names)
           for k, v in node.items()}
    if not names and isinstance(ref := node.get("$ref"), str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def tool_grammar(tools: Iterable[Tool], many: bool, tags: tuple[str, str], listed: bool = False) -> str:
    """A Lark grammar (llguidance dialect) for one call, or one or more calls, after the open tag and
    before the close one (``tags``, as ``tag`` writes them; no close: ""): each call between the tags
    (Hermes), or where the family writes a list (``listed``), all of them in one list."""
    close = f" {tags[1]}" if tags[1] else ""
    if listed:
        calls = 'body (", " body)*' if many else "body"
        return f'start: {tags[0]} "[" {calls} "]"{close}\n{calls_body(tools, TOOL_JSON)}'
    start = 'start: call ("\\n" call)*' if many else "start: call"
    call = f'call: {tags[0]} "\\n" body "\\n"{close}\n'
    return f"{start}\n{call}{calls_body(tools, TOOL_JSON)}"


def named_grammar(tools: Iterable[Tool], many: bool, tags: tuple[str, str, str, str]) -> str:
    """A Lark grammar for one call, or one or more, each its open tag then its name, ``args`` and arguments
    (Mistral's form from Small 3.1 on, as its chat template renders past calls)."""
    call = f"{tags[0]} named"
    return f"start: {call}{f' ({call})*' if many else ''}\n{named_calls(tools, tags[2], tags[3], TOOL_JSON)}"


def named_calls(tools: Iterable[Tool], args: str, call_id: str = "", guidance: dict[str, Any] = FLEXIBLE_JSON) -> str:
    """The grammar rule ``named``: a call written as its name, maybe ``call_id`` and an id, ``args`` (tags),
    then its arguments (Mistral's later form). Each tool's parameters are their own schema's root, so their
    references hold as written."""
    given = f" ({call_id} ID)?" if call_id else ""
    calls = []
    for tool in tools:
        guided = json.dumps({**arguments_schema(tool), "x-guidance": guidance})
        calls.append(f"{json.dumps(tool.name)}{given} {args} %json {guided}")
    return "named: " + " | ".join(calls) + "\n" + ('ID: /[A-Za-z0-9]{1,32}/\n' if call_id else "")


def tag(text: str, token: int | None) -> str:
    """``text`` as a grammar matches it: as text, or as the one token the tokenizer has for it (Qwen's
    ``<tool_call>``), which llguidance matches by its id alone since it holds it for a special token."""
    return json.dumps(text) if token is None else f"({json.dumps(text)} | <[{token}]>)"


class Grammars:
    """Builds constraints for one tokenizer (its llguidance view made once, on first use)."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Iterable[int], calls: CallFormat = HERMES) -> None:
        self._source = tokenizer
        self.calls = calls
        self._eos = sorted(eos_ids)
        self._matchers: Matchers | None = None

    @property
    def matchers(self) -> Matchers:
        if self._matchers is None:
            tokenizer = llguidance.LLTokenizer(self._source.backend_tokenizer.to_str(), eos_token=self._eos)
            self._matchers = Matchers(tokenizer)
        return self._matchers

    def for_tools(self, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = True) -> Constraint | None:
        """The constraint of a forced call: ``required`` (one call, or one or more when
        ``parallel``; the model may end after any complete call) or a named tool (one call)."""
        if choice in ("auto", "none") or not tools:
            return None
        if isinstance(choice, Named):  # a declared tool (EngineRequest checks it is one)
            tools = tuple(t for t in tools if t.name == choice.name)
        many, tags = choice == "required" and parallel, self.tags()
        try:
            return self._calls(tools, many, tags)
        except InvalidRequestError as err:  # which tool: the first that cannot be enforced alone
            for tool in tools:
                try:
                    self._calls((tool,), many, tags)
                except InvalidRequestError as alone:
                    raise InvalidRequestError("tools", f"the tool {tool.name!r}: {self._why(tool, alone)}") from None
            raise err from None

    def _why(self, tool: Tool, error: InvalidRequestError) -> str:
        """Why ``tool``'s call cannot be enforced: in the words of its parameters alone where they fail too
        (a call's error may only say that its ``arguments`` cannot be written, a key of mashbox's wrapping)."""
        try:
            schema = {**arguments_schema(tool), "x-guidance": TOOL_JSON}
            Constraint(self.matchers, f"start: %json {json.dumps(schema)}\n")
        except InvalidRequestError as alone:
            return alone.message
        return error.message

    def _calls(self, tools: tuple[Tool, ...], many: bool, tags: tuple[str, str, str, str]) -> Constraint:
        """The grammar is written only where none is kept for these tools (its text takes 20-30 ms for 100)."""
        named = self._source.token_id(self.calls.args or None) is not None  # the model's own form
        listed = self.calls.listed
        key = ("forced", named, many, tags, listed, _made_of(tools))
        if named:
            return Constraint(self.matchers, key, grammar=lambda: named_grammar(tools, many, tags))
        return Constraint(self.matchers, key, grammar=lambda: tool_grammar(tools, many, tags[:2], listed))

    def guard(self, tools: tuple[Tool, ...]) -> CallGuard:
        """Auto mode's guard of the calls the model begins (see ``CallGuard``)."""
        return CallGuard(self.matchers, tools, self.calls, self.tags())

    def tags(self) -> tuple[str, str, str, str]:
        """The open, close, arguments and call id tags of the model's calls in a grammar (see ``tag``; ""
        where its format has none)."""
        fmt = self.calls
        return tuple(tag(t, self._source.token_id(t)) if t else "" for t in (fmt.open, fmt.close, fmt.args, fmt.call_id))

    def for_schema(self, schema: dict[str, Any] | None) -> Constraint | None:
        """The constraint of an answer that is one JSON value valid under ``schema``."""
        if schema is None:
            return None
        grammar = f"start: %json {json.dumps({**schema, 'x-guidance': STRICT_JSON})}\n"
        return Constraint(self.matchers, grammar, "response_schema")


class CallGuard:
    """Auto mode: the rest of a call the model has begun is constrained to the declared tools.

    After each token the markup says whether a call is open and how it began; the guard then
    keeps one constraint for that call, made from the bytes the model wrote since the call's first
    character, and drops it once the markup has the call (or gives up on a call whose start no
    declared tool fits: that one stays free, and ends as text)."""

    def __init__(self, matchers: Matchers, tools: tuple[Tool, ...], calls: CallFormat = HERMES,
                 tags: tuple[str, str, str, str] = ('"<tool_call>"', '"</tool_call>"', "", "")) -> None:
        blank = "BLANK: /[ \\t\\r\\n]+/\n"
        listed = 'list: "[" BLANK? body (BLANK? "," BLANK? body)* BLANK? "]"\n' + blank  # Mistral's calls
        fence = "END: /[ \\t\\r\\n]*```/\n"
        tagged = "(body | list)" if calls.listed else "body"
        tagged = f"({tagged} | named)" if calls.args else tagged
        close = f" BLANK? {tags[1]}" if tags[1] else ""
        self.starts = {  # each form's rest of a call, up to the ``body`` rule
            "tag": f"start: BLANK? {tagged}{close}\n" + (listed if calls.listed else blank)
                   + (named_calls(tools, tags[2], tags[3]) if calls.args else ""),
            "fenced": f"start: body END\n{fence}",
            "bare": "start: body\n",
            "fenced list": f"start: list END\n{fence}{listed}",
            "bare list": f"start: list\n{listed}",
        }
        self.tools = tools
        self.matchers = matchers
        self.active: Constraint | None = None
        self.given_up = False

    def follow(self, call: tuple[str, str] | None, output_ids: list[int]) -> Constraint | None:
        """The constraint for the next token: ``call`` is the markup's open call (its form and its
        text so far) or None, ``output_ids`` every token of the answer so far. A call begun without
        tags is held to the tools only where the model leans to one of them (``Constraint.tentative``)
        until its name is written: else it is the model's own JSON ({"name": "Alice", ...}), left free."""
        active = self.active
        if call is None or self.given_up or (active and (active.matcher.is_stopped() or active.released)):
            self.active, self.given_up = None, call is not None
            return None
        if active is None:
            self.active = active = self._begin(*call, self.matchers.tokenizer.decode_bytes(output_ids))
            self.given_up = active is None
            if active is not None and call[0] != "tag":
                active.tentative = True
        if active is not None and active.tentative and NAMED.search(call[1]):
            active.tentative = False  # a declared tool's name: the call's
        return active

    def _begin(self, form: str, text: str, written: bytes) -> Constraint | None:
        at = written.rfind(text.encode())
        if at < 0:
            return None
        try:
            constraint = Constraint(self.matchers, (form, _made_of(self.tools)), strict=False,
                                    grammar=lambda: self.starts[form] + calls_body(self.tools, FLEXIBLE_JSON, KEYS))
        except InvalidRequestError:  # a schema llguidance cannot enforce: the call stays free
            return None
        ids = self.matchers.tokenizer.tokenize_bytes(written[at:])
        return constraint if constraint.matcher.try_consume_tokens(ids) == len(ids) else None


def _said(error: str) -> str:
    """llguidance's error on one line, without where in mashbox's own grammar text it arose, nor that text
    (a regex's error keeps the regex and why: ``regex parse error: a(b error: unclosed group``)."""
    said = []
    for line in error.partition("<state>")[0].strip().splitlines():  # not the parser's state dump after it
        if re.match(r"\s*\d+ \|", line):  # the grammar text follows
            break
        if line.strip(" ^"):
            said.append(line.strip())
    text = re.sub(r"^at \d+\(\d+\): ", "", " ".join(said)) if said else error
    return re.sub(r"/\$defs/tool\d+", "", text)  # where mashbox keeps a tool's schema: the tool's own root


def _made_of(tools: Iterable[Tool]) -> str:
    """What of ``tools`` a calls grammar is made of (their names and parameters), as a key of ``Matchers``."""
    return json.dumps([(t.name, t.parameters) for t in tools])


class Matchers:
    """llguidance matchers for one tokenizer, each grammar compiled once: a grammar met before is a copy of its
    first matcher, kept at its start (``deep_copy``: 1-4 ms for the calls of 100 tools of 20 parameters each,
    where compiling them takes ~150 ms). An agent sends the same tools at every turn, so auto mode's guard,
    which compiles a call's grammar on the engine's thread as the call begins (every stream waits), does so
    once for a set of tools, not at each call; a forced call's grammar is compiled once at a request's intake
    the same way. The grammars used last are kept, up to ``chars`` of their text in all; any thread may ask."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, chars: int = KEPT_CHARS) -> None:
        self.tokenizer = tokenizer
        self._kept: OrderedDict[Hashable, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self._chars, self._room = 0, chars
        self._lock = threading.Lock()

    def get(self, key: Hashable, grammar: Callable[[], str] | None = None) -> llguidance.LLMatcher:
        """A new matcher of the grammar ``grammar`` writes, kept as ``key`` (the grammar itself where no
        ``grammar`` is given); in error where llguidance cannot compile it, as its first was."""
        with self._lock:
            if (kept := self._kept.get(key)) is not None:
                self._kept.move_to_end(key)
                return kept[0].deep_copy()
        text = grammar() if grammar else key
        first = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        with self._lock:
            if key not in self._kept:  # another thread's, meanwhile
                self._kept[key] = first, len(text)
                self._chars += len(text)
            while self._chars > self._room and len(self._kept) > 1:
                self._chars -= self._kept.popitem(last=False)[1][1]
            return first.deep_copy()


class Constraint:
    """One request's grammar state: masks its logits, follows its tokens."""

    def __init__(self, matchers: Matchers, key: Hashable, field: str = "tools", strict: bool = True,
                 grammar: Callable[[], str] | None = None) -> None:
        tokenizer = matchers.tokenizer
        self.matcher = matchers.get(key, grammar)  # ``key`` is the grammar, or ``grammar`` writes it
        self.field, self.strict = field, strict  # strict: a grammar that cannot go on fails the request, else lets go
        self.failed: str | None = None  # why the grammar could not go on, where it stopped mid-answer
        if self.matcher.is_error():
            raise InvalidRequestError(field, self._unenforced())
        self.vocab_size = tokenizer.vocab_size
        self.tokenizer = tokenizer
        self.tentative = False  # held only where the model's own pick is allowed, or an allowed token but for
        # its case (Claude Code's Read where the model leans to "read..."); else it lets go
        self.released = False

    def mask(self, logits: torch.Tensor) -> None:
        """Set disallowed tokens of one logits row to -inf, in place (or let go: ``tentative``)."""
        if self.released:
            return
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: self.vocab_size].astype(bool)).to(logits.device)
        if self.tentative and not allowed[top := int(logits[: self.vocab_size].argmax())]:
            if not self._alike(top, allowed):
                self.released = True  # JSON of the model's own: it writes on free
                return
            self.tentative = False  # a tool it meant, but for its case: held from here on
        logits[: self.vocab_size].masked_fill_(~allowed, float("-inf"))
        logits[self.vocab_size :] = float("-inf")

    def _alike(self, token: int, allowed: torch.Tensor) -> bool:
        """Whether an allowed token is ``token`` but for its case."""
        word = self.tokenizer.decode_bytes([token]).lower()
        return any(self.tokenizer.decode_bytes([i]).lower() == word for i in allowed.nonzero().flatten().tolist())

    def accept(self, token: int) -> None:
        """Follow ``token``; where the grammar cannot go on (a limit of llguidance's met mid-answer: it
        would allow only the end), ``failed`` says why, and the request fails rather than end short."""
        if not self.released:
            self.matcher.consume_token(token)
            if self.matcher.is_error() and self.failed is None:
                self.failed = self._unenforced() if self.strict else None
                self.released = not self.strict

    def _unenforced(self) -> str:
        what = "the schema" if self.field == "response_schema" else "a tool's parameters schema"
        return f"{what} cannot be enforced: {_said(self.matcher.get_error())}"
