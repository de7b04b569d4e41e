"""A coding agent's first request before and after a server restart: time to first token.

    .venv/bin/python bench/restart.py REQUEST.json [--model qwen2.5-coder-0.5b] [--ctx 32768]

REQUEST.json is a captured request (``method``, ``path``, ``headers``, ``body``), e.g. Claude Code's
first ``POST /v1/messages``, as a logging proxy captures it. Starts
``mashbox run`` with a fresh prefix folder on disk, sends the request cold (everything prefilled),
stops the server, starts it again and sends the same request as a new session would: its system
prompt and tools come from the disk tier of the prefix cache. Prints the time to the first
streamed output of each, and the tokens the server says came from the cache.
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


def first_output(url: str, request: dict, max_tokens: int) -> tuple[float, dict]:
    """Seconds to the first text of the answer, and the answer's final usage."""
    body = {**request["body"], "stream": True, "max_tokens": max_tokens}
    started, ttft, usage = time.monotonic(), None, {}
    with httpx.Client(base_url=url, timeout=1800) as client:
        with client.stream("POST", request["path"], json=body) as response:
            response.raise_for_status()
            for _name, data in _lines(response):
                event = json.loads(data) if data != "[DONE]" else {}
                if ttft is None and _is_output(event):
                    ttft = time.monotonic() - started
                usage |= event.get("usage") or (event.get("message") or {}).get("usage") or {}
    return ttft if ttft is not None else float("nan"), usage


def _lines(response: httpx.Response):
    """(event name, data) of each SSE event; comments (keep-alives) are skipped."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            yield name, line[5:].strip()


def _is_output(event: dict) -> bool:
    return event.get("type") in ("content_block_delta", "response.output_text.delta") or any(
        (c.get("delta") or {}).get("content") for c in event.get("choices") or [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("request", type=Path)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--ctx", default="32768")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cache-dir", help="keep the pages here (default: a temporary folder); a folder that "
                                            "already holds them skips the cold run")
    args = parser.parse_args()
    request = json.loads(args.request.read_text())
    with tempfile.TemporaryDirectory(prefix="mashbox-prefixes-") as temporary:
        folder = args.cache_dir or temporary
        flags = (args.model, "--ctx", args.ctx, "--slots", "2", "--cache-dir", folder)
        warm = args.cache_dir and any(Path(folder).glob("*.safetensors"))
        for run in ("cold", "after a restart")[1 if warm else 0:]:
            ttft, usage = with_server(lambda url, pid: first_output(url, request, args.max_tokens), *flags)
            print(f"{run}: first output after {ttft:.1f} s; usage {json.dumps(usage)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
