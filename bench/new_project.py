"""A coding agent's first request in a second, never-seen project: time to its first token, with
the tools rendered before the system text (mashbox's default) and with the template as written.

    .venv/bin/python bench/new_project.py [REQUEST.json] [--model qwen2.5-coder-0.5b] [--layouts tools-first verbatim]

REQUEST.json (default: Claude Code's captured first request in tests/fixtures/clients) is sent
once as it is (a session in one project, everything prefilled), then as the same agent would send it
from another folder on another day: its working folder, git state and date changed. For each
layout a fresh ``mashbox run`` (empty prefix folder) answers both with one token each (so the time
is prefill and one token); prints the seconds and the prompt tokens read from the prefix cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from soak import with_server  # noqa: E402

CAPTURED = Path(__file__).parents[1] / "tests/fixtures/clients/claude-code_POST_v1_messages.json"
LAYOUTS = ["tools-first", "verbatim"]
ELSEWHERE = (("/home/user/work-claude", "/home/dev/billing-service"),
             ("Is a git repository: false", "Is a git repository: true"),
             ("2026-11-30", "2026-12-01"))


def moved(request: dict) -> dict:
    """The same request as sent from another folder (a git repository) on the next day."""
    text = json.dumps(request)
    for old, new in ELSEWHERE:
        text = text.replace(old, new)
    return json.loads(text)


def first_token(url: str, request: dict) -> tuple[float, int, int]:
    """Seconds to a one-token answer, its prompt tokens and those read from the cache."""
    body = {**request["body"], "stream": False, "max_tokens": 1}
    start = time.monotonic()
    answer = httpx.post(url + request["path"], json=body, timeout=3600).raise_for_status().json()
    usage = answer["usage"]
    cached = usage.get("cache_read_input_tokens", 0)
    return time.monotonic() - start, usage["input_tokens"] + cached, cached


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("request", type=Path, nargs="?", default=CAPTURED)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, choices=LAYOUTS)
    args = parser.parse_args()
    request = json.loads(args.request.read_text())
    other = moved(request)
    assert other != request, "the request holds none of the folder, git state or date this changes"
    rows = []
    for layout in args.layouts:
        with tempfile.TemporaryDirectory(prefix="mashbox-prefixes-") as folder:
            flags = [args.model, "--ctx", "32768", "--slots", "2", "--cache-dir", folder]
            flags += ["--verbatim-template"] if layout == "verbatim" else []
            runs = with_server(lambda url, pid: [first_token(url, r) for r in (request, other)], *flags)
        for name, (seconds, tokens, cached) in zip(("first project", "second project"), runs):
            rows.append((layout, name, seconds, tokens, cached))
            print(f"{layout}, {name}: first token after {seconds:.1f} s; {cached} of {tokens} prompt tokens cached",
                  flush=True)
    print("\n| layout | request | first token (s) | prompt tokens | from the cache |\n|---|---|---|---|---|")
    for layout, name, seconds, tokens, cached in rows:
        print(f"| {layout} | {name} | {seconds:.1f} | {tokens} | {cached} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
