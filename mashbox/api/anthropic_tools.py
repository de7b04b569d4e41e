"""Anthropic's own client tools: a tool of type ``bash_20250124``, ``text_editor_*`` or ``memory_*`` has
no ``input_schema`` in the request (Anthropic's models know it), but runs on the client as a custom tool
does; here it gets the input schema Anthropic documents for it. Other typed tools (web_search,
code_execution, computer use, ...) run on Anthropic's side or need images: they are skipped."""

from __future__ import annotations

from typing import Any

_PATH = {"type": "string", "description": "the absolute path of a file or directory"}
_EDIT = {
    "path": _PATH,
    "file_text": {"type": "string", "description": "create: the new file's content"},
    "old_str": {"type": "string", "description": "str_replace: the exact text to replace (once in the file)"},
    "new_str": {"type": "string", "description": "str_replace: the text that replaces it; insert: the text to insert"},
    "insert_line": {"type": "integer", "minimum": 0, "description": "insert: after this line (0: at the top)"},
    "insert_text": {"type": "string", "description": "insert: the text to insert"},
    "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                   "description": "view: the first and last line to show (-1: to the end)"},
}


def _schema(commands: list[str], properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    command = {"type": "string", "enum": commands}
    return {"type": "object", "properties": {"command": command, **properties}, "required": ["command", *required],
            "additionalProperties": False}


# type prefix -> (description, input schema)
CLIENT_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "bash_": ("Run a command in a persistent bash shell and return its output.", {
        "type": "object", "required": ["command"], "additionalProperties": False, "properties": {
            "command": {"type": "string", "description": "the command to run"},
            "restart": {"type": "boolean", "description": "restart the shell instead"}}}),
    "text_editor_": ("View, create and edit text files: view a file or directory, create a file, replace a "
                     "string in a file, insert text after a line.",
                     _schema(["view", "create", "str_replace", "insert", "undo_edit"], _EDIT, ["path"])),
    "memory_": ("Keep notes across conversations in a /memories directory: view, create, edit, delete and "
                "rename its files.",
                _schema(["view", "create", "str_replace", "insert", "delete", "rename"],
                        {**_EDIT, "old_path": _PATH, "new_path": _PATH}, [])),
}


def client_tool(kind: str | None) -> tuple[str, dict[str, Any]] | None:
    """The description and input schema of Anthropic's client tool of type ``kind``; None for another type."""
    return next((tool for prefix, tool in CLIENT_TOOLS.items() if kind and kind.startswith(prefix)), None)
