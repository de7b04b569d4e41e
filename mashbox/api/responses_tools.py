"""Responses tools: what the model can call, and how its calls map back to Responses items.

Function tools pass through. A ``namespace`` tool (Codex) contributes its inner tools, under
their own names unless another tool has taken the name (then ``<namespace>__<name>``); calls keep
their namespace. A ``custom`` tool takes one string ``input`` (held to its regex format, if it has
one); ``local_shell`` takes a command list. Hosted tools (web_search, file_search, ...) are skipped
and reported as ``tools[<type>]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from mashbox.api.base import Part, parameters_of, type_of
from mashbox.engine.request import Named, Tool
from mashbox.engine.request import ToolChoice as EngineToolChoice
from mashbox.errors import InvalidRequestError


class FunctionTool(Part):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomTool(Part):
    type: Literal["custom"] = "custom"
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


InnerTool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class NamespaceTool(Part):
    type: Literal["namespace"] = "namespace"
    name: str
    description: str = ""
    tools: list[InnerTool] = Field(default_factory=list)


class LocalShellTool(Part):
    type: Literal["local_shell"] = "local_shell"


class HostedTool(Part):
    """A tool that runs on OpenAI's side: this server cannot run it."""

    type: str

    def left_out(self) -> bool:
        return True


_USABLE = ("function", "custom", "namespace", "local_shell")


def _tool_tag(value: Any) -> str:
    kind = type_of(value, "function")
    return kind if kind in _USABLE else "hosted"


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[LocalShellTool, Tag("local_shell")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_tag),
]

LOCAL_SHELL = "local_shell"
LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "minItems": 1, "description": "argv of the command"},
        "workdir": {"type": "string", "description": "working directory"},
        "timeout_ms": {"type": "integer", "minimum": 1, "description": "time limit in milliseconds"},  # 0: killed at once
    },
    "required": ["command"],
}
CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "the raw input of the tool"}},
    "required": ["input"],
}


@dataclass(slots=True, frozen=True)
class ToolRef:
    """What a name the model calls stands for."""

    kind: Literal["function", "custom", "local_shell"]
    name: str
    namespace: str | None = None


class ToolMap:
    """The engine's tools for a request, and the way back from a called name to its item."""

    def __init__(self, tools: list[Any] | None) -> None:
        self.tools: list[Tool] = []
        self._refs: dict[str, ToolRef] = {}
        self._top = {LOCAL_SHELL if isinstance(t, LocalShellTool) else t.name  # names taken outright
                     for t in tools or () if isinstance(t, FunctionTool | CustomTool | LocalShellTool)}
        for tool in tools or ():
            self._add(tool)

    def ref(self, called: str) -> ToolRef:
        return self._refs.get(called, ToolRef("function", called))

    def visible(self, name: str, namespace: str | None = None) -> str:
        """The name the model knows a (namespace, name) tool by."""
        for called, ref in self._refs.items():
            if ref.name == name and ref.namespace == namespace:
                return called
        return name

    def _add(self, tool: Any, namespace: str | None = None) -> None:
        if isinstance(tool, NamespaceTool):
            for inner in tool.tools:
                self._add(inner, tool.name)
        elif isinstance(tool, FunctionTool):
            self._register(ToolRef("function", tool.name, namespace), tool.description, tool.parameters)
        elif isinstance(tool, CustomTool):
            ref = ToolRef("custom", tool.name, namespace)
            self._register(ref, _custom_description(tool), _custom_parameters(tool))
        elif isinstance(tool, LocalShellTool):
            description = "Run a command on the user's machine and return its output."
            self._register(ToolRef("local_shell", LOCAL_SHELL), description, LOCAL_SHELL_PARAMETERS)

    def allowed(self, entry: dict[str, Any]) -> set[str]:
        """The names the model knows the tools an ``allowed_tools`` entry lists by: a namespace's, the shell
        (named by its type alone), or one tool."""
        if entry.get("type") == "local_shell":
            return {LOCAL_SHELL} & self._refs.keys()
        if entry.get("type") == "namespace":
            return {called for called, ref in self._refs.items() if ref.namespace == entry.get("name")}
        return {self.visible(entry.get("name", ""), entry.get("namespace"))}

    def _register(self, ref: ToolRef, description: str | None, parameters: dict[str, Any] | None) -> None:
        if ref.namespace and any((r.name, r.namespace) == (ref.name, ref.namespace) for r in self._refs.values()):
            raise InvalidRequestError("tools", f"two tools of the namespace {ref.namespace!r} are named {ref.name!r}: "
                                               "a call could not say which one it means (give each a name of its own)")
        called = ref.name
        if ref.namespace and (called in self._refs or called in self._top):  # a tool of its name before it or after
            called = f"{ref.namespace}__{ref.name}"
        self._refs[called] = ref
        self.tools.append(Tool(called, description or "", parameters_of(parameters)))


def _custom_description(tool: CustomTool) -> str:
    description = tool.description or ""
    fmt = tool.format or {}
    if fmt.get("type") != "grammar":
        return description
    syntax = fmt.get("syntax", "grammar")
    return f"{description}\n\nThe input must follow this {syntax} grammar:\n{fmt.get('definition', '')}"


def _custom_parameters(tool: CustomTool) -> dict[str, Any]:
    """A custom tool's one string ``input``; a regex format is its pattern, which the call is held to (a
    lark grammar is only shown to the model: said in x-mashbox-ignored-fields)."""
    if (regex := _regex(tool)) is None:
        return CUSTOM_PARAMETERS
    whole = {**CUSTOM_PARAMETERS["properties"]["input"], "pattern": f"^(?:{regex})$"}  # all of it, not a part
    return {**CUSTOM_PARAMETERS, "properties": {"input": whole}, "additionalProperties": False}


def _regex(tool: CustomTool) -> str | None:
    fmt = tool.format or {}
    regex = fmt.get("definition") if fmt.get("type") == "grammar" and fmt.get("syntax") == "regex" else None
    return regex if isinstance(regex, str) else None


def _unheld(tool: Any) -> bool:
    """A custom tool whose grammar the call is not held to (lark)."""
    return isinstance(tool, CustomTool) and (tool.format or {}).get("type") == "grammar" and _regex(tool) is None


def echo_tool(tool: Any) -> dict[str, Any]:
    """A request tool as the response repeats it; function tools keep their null fields."""
    return tool.model_dump(mode="json", exclude_none=not isinstance(tool, FunctionTool))


def skipped(tools: list[Any] | None, choice: ToolChoice | None) -> list[str]:
    """What of the tools is not used: the hosted tools (skipped), a custom tool's lark grammar (shown to the
    model only), and a ``tool_choice`` that names a hosted tool (it is ``auto`` here)."""
    unused = [f"tools[{t.type}]" for t in tools or () if t.left_out()]
    inner = [i for t in tools or () for i in (t.tools if isinstance(t, NamespaceTool) else [t])]
    unused += [f"tools[{t.name}].format" for t in inner if _unheld(t)]
    if isinstance(choice, ToolChoiceObject) and choice.type not in _CHOOSABLE:
        unused.append(f"tool_choice[{choice.type}]")
    return unused


class ToolChoiceObject(Part):
    type: str
    name: str | None = None
    namespace: str | None = None  # a function of a namespace tool
    function: dict[str, Any] | None = None
    mode: Literal["auto", "required", "none"] | None = None
    tools: list[dict[str, Any]] | None = None

    def named(self) -> str | None:
        return self.name or (self.function or {}).get("name")


ToolChoice = Literal["auto", "none", "required"] | ToolChoiceObject


_CHOOSABLE = ("function", "custom", "allowed_tools", "local_shell")


def engine_tool_choice(choice: ToolChoice | None, tools: ToolMap) -> EngineToolChoice:
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.type == "local_shell":
        return Named(LOCAL_SHELL)
    if choice.type in ("function", "custom"):  # an mcp choice's name is its server's
        if not (name := choice.named()):
            raise InvalidRequestError("tool_choice.name", f"a {choice.type} tool_choice names the tool it forces: "
                                                          "give its name (or use \"required\" for any tool)")
        return Named(tools.visible(name, choice.namespace))
    return choice.mode or "auto"


def allowed_tools(choice: ToolChoice | None, tools: ToolMap) -> tuple[Tool, ...]:
    """The tools the model may call: all, or those an ``allowed_tools`` choice lists."""
    if not isinstance(choice, ToolChoiceObject) or choice.type != "allowed_tools":
        return tuple(tools.tools)
    if not choice.tools:
        raise InvalidRequestError("tool_choice.tools", "an allowed_tools choice lists the tools it allows (one or more)")
    names = set().union(*(tools.allowed(entry) for entry in choice.tools))
    allowed = tuple(t for t in tools.tools if t.name in names)
    if not allowed and choice.mode != "none":
        raise InvalidRequestError("tool_choice.tools", "names none of the request's tools")
    return allowed


def echo_tool_choice(choice: ToolChoice | None) -> str | dict[str, Any]:
    """The request's tool_choice in the Responses shape the response carries."""
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    name = choice.named()
    if name is not None and choice.type in ("function", "custom"):
        return {"type": choice.type, "name": name}
    known = choice.model_dump(exclude_none=True, include=set(ToolChoiceObject.model_fields))  # not a field it ignored
    if choice.type == "allowed_tools":  # its mode is required in the response (default: auto)
        return {**known, "mode": choice.mode or "auto"}
    return known
