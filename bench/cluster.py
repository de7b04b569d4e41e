"""Two replicas behind HAProxy (`mashbox cluster`) against one server, on agent-style sessions.

    .venv/bin/python bench/cluster.py [--model smollm2-135m] [--sessions 8] [--turns 4] [--slots 8]

Each session is an agent's conversation: a long prefix that every session shares (the agent's
tools), a part of its own (its project), then turns that each add the last answer and a short
question, one after another, each on a new connection; the sessions run at once. The same sessions go to three set-ups in
one run: one `mashbox run --slots SLOTS`; two replicas with SLOTS/2 each behind HAProxy, the
sessions named (x-session-id: each stays on one replica); and the same cluster with the sessions
unnamed (least connections: a turn may land where its prefix is not). Printed for each: the share
of prompt tokens served from the cache, output tokens per second, requests per replica and time to
first token (p50, p95). The disk cache is off, so that hits come from the replica's own memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare import free_port  # noqa: E402


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    output: int = 0
    replicas: Counter = field(default_factory=Counter)
    seconds: float = 0.0


def start(kind: str, model: str, slots: int, port: int) -> subprocess.Popen:
    flags = ["--ctx", "8192", "--cache-disk", "0"]
    if kind == "single":
        argv = ["run", model, "--port", str(port), "--slots", str(slots), *flags]
    else:
        argv = ["cluster", "--replicas", "2", "--port", str(port), "--", model, "--slots", str(slots // 2), *flags]
    return subprocess.Popen([sys.executable, "-m", "mashbox", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def wait_ready(url: str, replicas: int, timeout: float = 300) -> None:
    """Until ``replicas`` distinct replicas answer through ``url`` (one, for a single server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen = {httpx.get(f"{url}/v1/models", headers={"x-session-id": f"probe-{i}"}, timeout=5)
                    .headers.get("x-mashbox-replica", "one") for i in range(16)}
            if len(seen) == replicas and "one" not in seen or replicas == 1 and seen == {"one"}:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not ready in {timeout} s")


def sessions(count: int, shared_words: int, own_words: int, run: str) -> list[list[dict]]:
    """The sessions' opening messages: the shared tools, then a project of each session's own (new
    in each ``run``, so that a run starts with no session of its own cached)."""
    tools = " ".join(f"tool_{i}(path, text): edits file {i} of the project." for i in range(shared_words // 8))
    return [[{"role": "system", "content": f"You are a coding agent. Tools: {tools}"},
             {"role": "user", "content": f"Project {run}-{s}: " + " ".join(f"module{s}_{i}.py" for i in range(own_words))}]
            for s in range(count)]


async def turn(url: str, history: list[dict], session: str | None, max_tokens: int, result: Result) -> str:
    """One turn on a connection of its own, as an agent's next turn comes after its tools ran a while
    (an idle connection is closed after seconds: kept alive, HAProxy would keep it on one replica)."""
    headers = {"x-session-id": session} if session else {}
    body = {"messages": history, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    start, text, first = time.perf_counter(), [], None
    async with httpx.AsyncClient(timeout=600) as client, \
            client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise SystemExit(f"{response.status_code}: {(await response.aread()).decode()}")
        result.replicas[response.headers.get("x-mashbox-replica", "one")] += 1
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter() - start
                text.append(chunk["choices"][0]["delta"]["content"])
            if chunk.get("usage"):
                usage = chunk["usage"]
                result.prompt += usage["prompt_tokens"]
                result.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                result.output += usage["completion_tokens"]
    result.ttft.append(first or time.perf_counter() - start)
    return "".join(text)


async def session_run(url, history, name, turns, max_tokens, result) -> None:
    history = list(history)
    for number in range(turns):
        answer = await turn(url, history, name, max_tokens, result)
        history += [{"role": "assistant", "content": answer or "ok"},
                    {"role": "user", "content": f"Now step {number + 2}: change the next function."}]


async def workload(url: str, args, named: bool) -> Result:
    result, run = Result(), f"{os.getpid()}-{time.monotonic_ns()}"
    start = time.perf_counter()
    await asyncio.gather(*(session_run(url, history, f"bench-{run}-{i}" if named else None, args.turns,
                                       args.max_tokens, result)
                           for i, history in enumerate(sessions(args.sessions, args.shared, args.own, run))))
    result.seconds = time.perf_counter() - start
    return result


def measure(kind: str, args) -> list[tuple[str, Result]]:
    port = free_port()
    process = start(kind, args.model, args.slots, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 1 if kind == "single" else 2)
        asyncio.run(workload(url, argparse.Namespace(**{**vars(args), "sessions": 2, "turns": 1}), True))  # warm-up
        if kind == "single":
            return [("1 server", asyncio.run(workload(url, args, True)))]
        return [("2 replicas, sessions named", asyncio.run(workload(url, args, True))),
                ("2 replicas, sessions unnamed", asyncio.run(workload(url, args, False)))]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8, help="of the one server; each replica gets half")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shared", type=int, default=600, help="words of the prefix all sessions share")
    parser.add_argument("--own", type=int, default=600, help="words of each session's own part")
    args = parser.parse_args()
    rows = measure("single", args) + measure("cluster", args)
    print(f"model {args.model}, {args.sessions} sessions x {args.turns} turns, {args.max_tokens} tokens a turn")
    print("| set-up | cached prompt tokens | output tok/s | TTFT p50 (s) | TTFT p95 (s) | requests per replica |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        p95 = statistics.quantiles(r.ttft, n=20)[-1] if len(r.ttft) > 1 else r.ttft[0]
        per = ", ".join(f"{k} {v}" for k, v in sorted(r.replicas.items()))
        print(f"| {name} | {r.cached / max(r.prompt, 1):.1%} | {r.output / r.seconds:.1f} | "
              f"{statistics.median(r.ttft):.2f} | {p95:.2f} | {per} |")


if __name__ == "__main__":
    main()
