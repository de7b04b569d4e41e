"""The canonical internal request: what every protocol translates into.

Nothing here knows HTTP or any protocol's JSON. Configs are frozen after
construction and check themselves in ``__post_init__``, raising ``ValueError``
whose message starts with the field name.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name}: must be {rule} (got {value!r})")


def _typed(owner: Any, kinds: dict[str, type | tuple[type, ...]]) -> None:
    """Each named field of ``owner`` is of its kind (None allowed where the default is None); a bool
    is no number."""
    for name, kind in kinds.items():
        value = getattr(owner, name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
            kinds_named = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ValueError(f"{name}: must be {kinds_named} (got {value!r})")


MAX_STOPS = 64  # every stop string is looked for after every token, in the step all streams share
MAX_STOP_CHARS = 10_000  # each is read once per request (text.stop: its table), on the way every request takes


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), as OpenAI's; a dict is taken

    def __post_init__(self) -> None:
        number = (int, float)
        _typed(self, {"temperature": number, "top_p": number, "top_k": int, "min_p": number, "seed": int,
                      "repetition_penalty": number, "frequency_penalty": number, "presence_penalty": number,
                      "max_tokens": int})
        t = self.temperature
        _check(math.isfinite(t) and 0 <= t <= 4, "temperature", "between 0 and 4", t)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", ">= 0", self.top_k)
        _check(self.seed is None or -2**63 <= self.seed < 2**63, "seed", "a 64-bit integer", self.seed)
        _check(0 <= self.min_p < 1, "min_p", "in [0, 1)", self.min_p)
        _check(0 < self.repetition_penalty < math.inf, "repetition_penalty", "> 0 and finite", self.repetition_penalty)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, "between -2 and 2", value)
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        _check(len(self.stop) <= MAX_STOPS, "stop", f"at most {MAX_STOPS} strings", f"{len(self.stop)} strings")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        if (longest := max(map(len, self.stop), default=0)) > MAX_STOP_CHARS:
            raise ValueError(f"stop: must be strings of at most {MAX_STOP_CHARS} characters (one has {longest})")
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        _check(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 and isinstance(b, int | float)
                   and not isinstance(b, bool) and -100 <= b <= 100 for i, b in self.logit_bias),
               "logit_bias", "token ids (integers >= 0) with biases between -100 and 100", self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True, frozen=True)
class ToolCall:
    """A call the assistant made: ``arguments`` is a JSON string."""

    id: str
    name: str
    arguments: str = "{}"


def object_typed(parameters: dict[str, Any]) -> bool:
    """Whether a JSON schema's ``type`` says an object (``"object"``, or a list of types that holds it)."""
    kind = parameters.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


@dataclass(slots=True, frozen=True)
class Tool:
    """A function the model may call, described by a JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Message:
    """One turn of a conversation, in the shape chat templates expect."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    item: int | None = field(default=None, compare=False)  # the request's item it came from, where that is not
    # its place here (Anthropic's tool results, Responses' instructions); said where a prompt misses the cache

    def __post_init__(self) -> None:
        roles = ("system", "user", "assistant", "tool")
        _check(self.role in roles, "role", "system, user, assistant or tool", self.role)
        _typed(self, {"content": str, "tool_call_id": str, "name": str, "reasoning": str})


@dataclass(slots=True, frozen=True)
class Named:
    """A forced call to the declared tool of this name, whatever it is: a tool may be called ``auto``."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | Named | str  # any other plain string: Named(it)
MODES = ("auto", "none", "required")


def repeated(names: list[str]) -> int | None:
    """Where in ``names`` the first name that came before is (None: each comes once)."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            return i
        seen.add(name)
    return None


def chosen(choice: ToolChoice) -> ToolChoice:
    """A tool choice as the engine reads it: a mode, or ``Named`` (a plain string that is no mode)."""
    return Named(choice) if isinstance(choice, str) and choice not in MODES else choice


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """One generation: a chat (``messages``) or a raw ``prompt``, never both."""

    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True  # False: at most one call
    enable_thinking: bool | None = None
    thinking_budget: int | None = None
    cache_salt: str = ""  # cached prompt prefixes are shared only between requests with the same salt
    session: str | None = None  # the client's session (an agent's): its conversation's prefix is kept warm
    response_schema: dict[str, Any] | None = None  # the answer is JSON valid under this schema (no tool calls)
    prediction: str | None = None  # text the answer should resemble: a source of proposals (speed only)
    continue_final: bool = False  # the answer continues the last (assistant) message's text: a prefill
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if isinstance(self.messages, list):
            object.__setattr__(self, "messages", tuple(self.messages))
        _typed(self, {"messages": tuple, "prompt": str, "sampling": SamplingParams, "tools": (tuple, list)})
        for name, kind, items in (("messages", Message, self.messages or ()), ("tools", Tool, self.tools)):
            wrong = next((item for item in items if not isinstance(item, kind)), None)
            _check(wrong is None, name, f"{kind.__name__} objects", wrong)
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("messages: give either messages or prompt, not both or neither")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must not be empty")
        object.__setattr__(self, "tool_choice", chosen(self.tool_choice))
        if self.tool_choice not in ("auto", "none") and not self.tools:
            raise ValueError("tool_choice: asks for a tool call, but the request declares no tools to call")
        for tool in self.tools:  # as OpenAI's and Anthropic's APIs: a call's arguments are an object
            if not tool.name.strip():  # the model could only write a call of no name: text, even when forced
                raise ValueError("tools: a tool's name is empty")
            kind = tool.parameters.get("type") if isinstance(tool.parameters, dict) else None
            if kind is not None and not object_typed(tool.parameters):
                raise ValueError(f"tools: the tool {tool.name!r}: its parameters must be an object schema "
                                 f"(type 'object', not {kind!r})")
        names = [tool.name for tool in self.tools]
        if (twice := repeated(names)) is not None:
            raise ValueError(f"tools: two tools are named {names[twice]!r}: a call could not say which one it "
                             "means (give each tool a name of its own)")
        if isinstance(self.tool_choice, Named) and all(t.name != self.tool_choice.name for t in self.tools):
            raise ValueError(f"tool_choice: names a tool that is not in tools: {self.tool_choice.name!r}")
