"""Soak: mixed load over all four protocols against a real ``mashbox run``, for minutes.

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 12] [--url URL] [--json FILE]

Starts ``mashbox run`` on the embedded model (or uses ``--url``), then each client draws cases at
random until the time is up: every generation route streamed and not, with tools, streams the
client cancels after a few events, requests whose client gives up before the answer, and bad
requests. Each answer is checked: a 200 ends as its protocol says (``[DONE]``, ``response.completed``
or ``.incomplete``, ``message_stop``; a finish reason), a bad request gets a 4xx in its protocol's
error shape. At the end every slot must be free (``/health``: no live rows, nothing waiting).
Prints the figures (and writes them as JSON): requests per case and outcome, 5xx (must be 0),
problems (must be none), resident memory of the server and its worker at the start, after
warm-up and at the end. Exits 1 on any 5xx, problem or busy slot.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare import ROOT, free_port, tree_rss_mib, wait_ready  # noqa: E402

TOOLS_CHAT = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOLS_MESSAGES = [{"name": "get_weather", "description": "Weather in a city",
                   "input_schema": TOOLS_CHAT[0]["function"]["parameters"]}]
QUESTIONS = ["Name three planets.", "Write a haiku about rain.", "What is 12 times 7?",
             "Explain recursion in one sentence.", "List four colours.", "What's the weather in Paris?",
             "Translate 'good morning' into French.", "Give me a Python one-liner that reverses a list."]
END_EVENTS = {"/v1/responses": ("response.completed", "response.incomplete"), "/v1/messages": ("message_stop",)}


class Problem(Exception):
    """An answer that breaks the contract."""


def body(route: str, rng: random.Random, stream: bool, tools: bool = False) -> dict:
    text, n = rng.choice(QUESTIONS), rng.randint(4, 48)
    sampling = {"temperature": rng.choice([0, 0.7, 1.0]), "stream": stream}
    if route == "/v1/chat/completions":
        out = {"messages": [{"role": "user", "content": text}], "max_tokens": n, **sampling}
        return out | ({"tools": TOOLS_CHAT} if tools else {})
    if route == "/v1/completions":
        return {"prompt": text, "max_tokens": n, **sampling}
    if route == "/v1/responses":
        return {"input": text, "max_output_tokens": max(n, 16), **sampling}
    out = {"messages": [{"role": "user", "content": text}], "max_tokens": n, **sampling}
    return out | ({"tools": TOOLS_MESSAGES} if tools else {})


async def events(response: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """(event name, data) of each SSE event; comment lines (keep-alives) are skipped."""
    name = None
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            yield name, line[5:].strip()
            name = None


def check_whole(route: str, answer: dict) -> None:
    if route == "/v1/responses":
        ok = answer.get("status") in ("completed", "incomplete")
    elif route == "/v1/messages":
        ok = answer.get("stop_reason") in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    else:
        ok = answer["choices"][0].get("finish_reason") in ("stop", "length", "tool_calls")
    if not ok:
        raise Problem(f"{route}: unfinished answer {json.dumps(answer)[:200]}")


def check_error(route: str, status: int, answer: dict) -> None:
    shape = answer.get("error") if route != "/v1/messages" else (
        answer.get("error") if answer.get("type") == "error" else None)
    if not (400 <= status < 500 and isinstance(shape, dict) and shape.get("message")):
        raise Problem(f"{route}: bad request answered {status} {json.dumps(answer)[:200]}")


async def streamed(client: httpx.AsyncClient, route: str, payload: dict, cancel_after: int | None) -> str:
    async with client.stream("POST", route, json=payload) as response:
        if response.status_code != 200:
            return await refused(route, response)
        seen, last = 0, None
        async for name, data in events(response):
            seen += 1
            if cancel_after is not None and seen >= cancel_after:
                return "cancelled"  # leaving the block closes the connection mid-stream
            if data == "[DONE]":
                if last not in END_EVENTS.get(route, (last,)):  # Responses: [DONE] after its end event
                    raise Problem(f"{route}: [DONE] after {last!r}, not its end")
                return "done"
            event = json.loads(data)
            last = name or event.get("type")
            if "error" in event and (name in (None, "error") or event.get("type") == "error"):
                raise Problem(f"{route}: stream error {data[:200]}")
        if cancel_after is None and last in END_EVENTS.get(route, ()):
            return "done"
        if cancel_after is not None:
            return "done before cancel"
        raise Problem(f"{route}: stream ended after {last!r} without its end")


async def refused(route: str, response: httpx.Response) -> str:
    answer = json.loads(await response.aread())
    if response.status_code >= 500 and response.status_code != 529:
        raise Problem(f"{route}: {response.status_code} {json.dumps(answer)[:200]}")
    check_error(route, response.status_code, answer)
    return f"refused {response.status_code}"


async def whole(client: httpx.AsyncClient, route: str, payload: dict) -> str:
    response = await client.post(route, json=payload)
    if response.status_code != 200:
        return await refused(route, response)
    check_whole(route, response.json())
    return "done"


async def gone(client: httpx.AsyncClient, route: str, payload: dict, rng: random.Random) -> str:
    try:
        await asyncio.wait_for(client.post(route, json=payload), timeout=rng.uniform(0.05, 1.0))
    except TimeoutError:
        return "client left"
    return "done before leaving"


BAD = [  # (route, body): each must be a 4xx in the route's error shape
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-nonexistent"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}),
    ("/v1/responses", {"input": [{"type": "nonsense"}]}),
    ("/v1/messages", {"max_tokens": "many", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}),
]
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


CASES = {"streamed": 5, "whole": 3, "tools": 2, "cancelled mid-stream": 2, "client gone": 1, "bad request": 2}


async def run_case(name: str, client: httpx.AsyncClient, rng: random.Random) -> str:
    route = rng.choice(ROUTES)
    match name:
        case "streamed":
            return await streamed(client, route, body(route, rng, True), None)
        case "whole":
            return await whole(client, route, body(route, rng, False))
        case "tools":
            route = rng.choice([ROUTES[0], ROUTES[3]])
            return await streamed(client, route, body(route, rng, True, tools=True), None)
        case "cancelled mid-stream":
            return await streamed(client, route, body(route, rng, True), rng.randint(2, 6))
        case "client gone":
            return await gone(client, route, body(route, rng, False), rng)
    path, payload = rng.choice(BAD)
    response = await client.post(path, json=payload)
    if response.status_code == 200:
        raise Problem(f"{path}: a bad request was answered 200")
    return await refused(path, response)


async def client_loop(url: str, seed: int, until: float, tally: collections.Counter, problems: list[str]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < until:
            name = rng.choices(list(CASES), list(CASES.values()))[0]
            try:
                outcome = await run_case(name, client, rng)
            except Problem as err:
                outcome = "PROBLEM"
                problems.append(str(err))
            except (httpx.HTTPError, ValueError) as err:
                outcome = "PROBLEM"
                problems.append(f"{name}: {type(err).__name__}: {err}")
            tally[(name, outcome)] += 1


async def soak(url: str, minutes: float, clients: int, pid: int | None) -> dict:
    tally: collections.Counter = collections.Counter()
    problems: list[str] = []

    async def rss() -> dict[str, float | None]:
        async with httpx.AsyncClient(base_url=url) as client:
            cache = (await client.get("/health")).json().get("host_cache_bytes", 0) / 2**20
        return {"rss": tree_rss_mib(pid) if pid else None, "host_cache": cache}

    start = time.monotonic()
    until = start + minutes * 60
    memory = {"start": await rss()}
    workers = [asyncio.create_task(client_loop(url, seed, until, tally, problems)) for seed in range(clients)]
    warm = start + min(60.0, minutes * 60 / 5)
    while not all(w.done() for w in workers):
        await asyncio.sleep(1)
        if "after_warmup" not in memory and time.monotonic() >= warm:
            memory["after_warmup"] = await rss()
    await asyncio.gather(*workers)
    memory["end"] = await rss()
    return {"tally": tally, "problems": problems, "rss_mib": memory, "seconds": time.monotonic() - start,
            "slots_free": await slots_free(url)}


async def slots_free(url: str, within: float = 10.0) -> bool:
    """Whether /health shows no live rows and nothing waiting (asked until ``within`` s)."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(base_url=url) as client:
        while time.monotonic() < deadline:
            health = (await client.get("/health")).json()
            if health.get("live_rows") == 0 and health.get("waiting") == 0:
                return True
            await asyncio.sleep(0.5)
    return False


def report(result: dict) -> str:
    tally: collections.Counter = result["tally"]
    lines = [f"{'case':<22} {'outcome':<22} {'requests':>8}"]
    lines += [f"{case:<22} {outcome:<22} {n:>8}" for (case, outcome), n in sorted(tally.items())]
    fives = sum(n for (_, outcome), n in tally.items() if outcome.startswith("refused 5"))
    mem = result["rss_mib"]
    lines += ["", f"requests: {sum(tally.values())} in {result['seconds']:.0f} s; 5xx: {fives}; "
              f"problems: {len(result['problems'])}; every slot free at the end: {result['slots_free']}",
              "resident memory of server + worker (of which prompt cache in host memory), MiB: " + ", ".join(
                  f"{k} {_mib(v['rss'])} ({v['host_cache']:.0f})" for k, v in mem.items())]
    lines += [f"  problem: {p}" for p in result["problems"][:20]]
    return "\n".join(lines)


def _mib(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def failed(result: dict) -> bool:
    return bool(result["problems"]) or not result["slots_free"] or any(
        outcome.startswith("refused 5") for _, outcome in result["tally"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--url", help="a running server (default: start mashbox run here)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if args.url:
        result = asyncio.run(soak(args.url, args.minutes, args.clients, None))
    else:
        result = with_server(lambda url, pid: asyncio.run(soak(url, args.minutes, args.clients, pid)))
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps({**result, "tally": [[*k, n] for k, n in result["tally"].items()]}, indent=1))
    return 1 if failed(result) else 0


def with_server(work: Callable[[str, int], dict], *flags: str, env: dict[str, str] | None = None,
                stderr: IO[str] | None = None) -> dict:
    """Run ``work(url, pid)`` against a fresh ``mashbox run`` on the embedded model (its log to
    ``stderr``, else to a file in /tmp)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(ROOT / ".venv/bin/mashbox"), "run", "--port", str(port), *flags]
    if stderr is None:
        stderr = tempfile.NamedTemporaryFile("w", prefix="mashbox-", suffix=".log", delete=False)
        print(f"mashbox run on {url}; its log: {stderr.name}", flush=True)
    proc = subprocess.Popen(command, env={**os.environ, **(env or {})}, stderr=stderr, start_new_session=True)
    try:
        if wait_ready(url, proc, 300) is None:
            raise SystemExit(f"mashbox run did not become ready; see {stderr.name}")
        return work(url, proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
