"""A fixed set of tool-call prompts with the calls expected of them, run on one model in each
template layout, with and without auto mode's call constraint: how often the model calls the
right tool with the right arguments.

    .venv/bin/python bench/tool_calls.py [--model qwen2.5-coder-0.5b] [--layouts tools-first verbatim]
                                         [--calls constrained free]

Each case is an agent-style request (a system text naming the working folder, six coding tools
in the shape Claude Code, Codex and Pi declare theirs, one user turn) answered greedily in auto mode
through ``Engine.chat``. A case passes when the answer's first call names the expected tool and its
arguments hold the expected values (substrings), or, for the questions that need no tool, when it
makes no call. Also counted: calls to a tool that was not declared, and answers that wrote a call
as text that the server did not read as one. Prints one table (markdown) and each failure.
"""

from __future__ import annotations

import argparse
import json
import time

from mashbox import Engine

LAYOUTS = ["tools-first", "verbatim"]
CALLS = ["constrained", "free"]
SYSTEM = ("You are a coding agent working in a user's project. Use the tools to read, search and "
          "change files and to run commands; answer directly when no tool is needed.\n\n"
          "Environment:\n - Working directory: {folder}\n - Platform: linux\n - Today's date: 2026-12-02")


def tool(name: str, description: str, **properties: str) -> dict:
    schema = {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in properties.items()},
              "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    tool("Read", "Read a file from the local filesystem.", file_path="The absolute path of the file to read"),
    tool("Write", "Write a file, replacing it if it exists.", file_path="The absolute path of the file",
         content="The content to write"),
    tool("Edit", "Replace text in a file.", file_path="The absolute path of the file",
         old_string="The text to replace", new_string="The text to put in its place"),
    tool("Bash", "Run a shell command and return its output.", command="The command to run"),
    tool("Grep", "Search file contents with a regular expression.", pattern="The regular expression",
         path="The folder to search"),
    tool("Glob", "Find files whose paths match a glob pattern.", pattern="The glob pattern, e.g. **/*.py"),
]

# (folder, user turn, expected tool or None for no call, expected substrings of its arguments)
CASES = [
    ("/home/ana/shop", "Read the file /home/ana/shop/README.md and summarise it.", "Read", {"file_path": "README.md"}),
    ("/home/ana/shop", "What is in /home/ana/shop/setup.cfg?", "Read", {"file_path": "setup.cfg"}),
    ("/srv/api", "Show me the contents of /srv/api/main.py", "Read", {"file_path": "main.py"}),
    ("/srv/api", "Run the test suite with pytest.", "Bash", {"command": "pytest"}),
    ("/srv/api", "List the files in the current folder using ls.", "Bash", {"command": "ls"}),
    ("/home/bo/game", "Run `git status` and tell me what changed.", "Bash", {"command": "git status"}),
    ("/home/bo/game", "Install the requests package with pip.", "Bash", {"command": "pip install requests"}),
    ("/home/bo/game", "Search the code for the string TODO.", "Grep", {"pattern": "TODO"}),
    ("/opt/tool", "Find where the function parse_args is defined.", "Grep", {"pattern": "parse_args"}),
    ("/opt/tool", "Find all Python files in this project.", "Glob", {"pattern": ".py"}),
    ("/opt/tool", "Find every Markdown file in the docs folder.", "Glob", {"pattern": ".md"}),
    ("/home/cy/site", "Create a file /home/cy/site/hello.txt containing the text hello world.", "Write",
     {"file_path": "hello.txt", "content": "hello world"}),
    ("/home/cy/site", "Write a file /home/cy/site/.gitignore that ignores __pycache__.", "Write",
     {"file_path": ".gitignore", "content": "__pycache__"}),
    ("/home/cy/site", "In /home/cy/site/app.py replace the text DEBUG = True with DEBUG = False.", "Edit",
     {"file_path": "app.py", "old_string": "DEBUG = True", "new_string": "DEBUG = False"}),
    ("/home/cy/site", "In /home/cy/site/config.py change port = 80 to port = 8080.", "Edit",
     {"file_path": "config.py", "old_string": "80", "new_string": "8080"}),
    ("/srv/api", "What does the Python keyword `yield` do? Answer in one sentence.", None, {}),
    ("/srv/api", "What is 17 times 3?", None, {}),
    ("/home/bo/game", "Say hello.", None, {}),
]


def judge(expected: str | None, wanted: dict, message: dict, names: set[str]) -> tuple[bool, str]:
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if not calls:
        if expected is None:
            return True, "no call"
        return False, "a call as text" if '"name"' in text or "<tool_call>" in text else "no call"
    name = calls[0]["function"]["name"]
    if name not in names:
        return False, f"undeclared tool {name!r}"
    if expected is None:
        return False, f"called {name}"
    if name != expected:
        return False, f"called {name}, not {expected}"
    try:
        arguments = json.loads(calls[0]["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        return False, "arguments are not JSON"
    missing = [k for k, v in wanted.items() if v.lower() not in str(arguments.get(k, "")).lower()]
    return (False, f"arguments {arguments} lack {missing}") if missing else (True, "right call")


def run(engine: Engine) -> tuple[dict, list[str]]:
    names = {t["function"]["name"] for t in TOOLS}
    counts = {"passed": 0, "right tool": 0, "undeclared": 0, "as text": 0, "seconds": 0.0}
    failures = []
    for folder, user, expected, wanted in CASES:
        start = time.perf_counter()
        answer = engine.chat(messages=[{"role": "system", "content": SYSTEM.format(folder=folder)},
                                       {"role": "user", "content": user}],
                             tools=TOOLS, temperature=0, max_tokens=160)
        counts["seconds"] += time.perf_counter() - start
        message = answer.model_dump()["choices"][0]["message"]
        ok, why = judge(expected, wanted, message, names)
        calls = message.get("tool_calls") or []
        counts["passed"] += ok
        named = calls[0]["function"]["name"] if calls else None
        counts["right tool"] += named == expected
        counts["undeclared"] += why.startswith("undeclared")
        counts["as text"] += why == "a call as text"
        if not ok:
            failures.append(f"{user!r}: {why}; answered {json.dumps(message.get('content'))[:160]}")
    return counts, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, choices=LAYOUTS)
    parser.add_argument("--calls", nargs="+", default=CALLS, choices=CALLS)
    args = parser.parse_args()
    rows = []
    for layout in args.layouts:
        for calls in args.calls:
            with Engine(args.model, slots=1, ctx=4096, verbatim_template=layout == "verbatim",
                        constrain_calls=calls == "constrained", quiet=True) as engine:
                counts, failures = run(engine)
            rows.append((layout, calls, counts))
            for failure in failures:
                print(f"[{layout}, {calls}] {failure}")
    print(f"\n{len(CASES)} cases ({sum(c[2] is None for c in CASES)} need no tool), model {args.model}, greedy\n")
    print("| layout | calls in auto mode | passed | right tool (or rightly none) | undeclared tool | call left as text "
          "| seconds |")
    print("|---|---|---|---|---|---|---|")
    for layout, calls, c in rows:
        print(f"| {layout} | {calls} | {c['passed']}/{len(CASES)} | {c['right tool']} | {c['undeclared']} | "
              f"{c['as text']} | {c['seconds']:.0f} |")


if __name__ == "__main__":
    main()
