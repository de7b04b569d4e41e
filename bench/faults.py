"""Faults: what ``mashbox run`` does when its worker dies or its disk cache is damaged.

    .venv/bin/python bench/faults.py [kill-streams] [kill-loading] [corrupt-cache]

Each scenario starts its own ``mashbox run`` on the embedded model and prints what it saw:

- ``kill-streams``: 24 streamed chats on 16 slots; once some have output, ``kill -9`` the worker.
  Streams that had output must end with the Chat error chunk carrying their response id; the
  others (no output yet: queued or prefilling) must be sent again once by the server and answer in
  full. The server must be ready again with one restart and every slot free; nothing may hang.
- ``kill-loading``: ``kill -9`` the worker while the model loads. ``mashbox run`` must say why in
  one line and exit 1 within seconds (a supervisor starts it again).
- ``corrupt-cache``: the tokenizer the cache keeps of the GGUF (``converted/.../tokenizer.json``) cut
  short. The server must name the file, build it again from the GGUF and serve.

Exits 1 when any scenario does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare import ROOT, free_port  # noqa: E402
from soak import events, slots_free, with_server  # noqa: E402

MASHBOX = str(ROOT / ".venv/bin/mashbox")


async def stream(client: httpx.AsyncClient, n: int, killed: asyncio.Event) -> dict:
    """One streamed chat; what it got before and after the kill, and how it ended."""
    payload = {"messages": [{"role": "user", "content": f"Story {n}: tell me a long story about a lighthouse."}],
               "max_tokens": 160, "temperature": 0, "stream": True}
    seen = {"output_before_kill": False, "end": None, "response_id": None, "error_id": None}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            return seen | {"end": f"HTTP {response.status_code}"}
        async for _, data in events(response):
            if data == "[DONE]":
                seen["end"] = seen["end"] or "no finish reason"
                break
            chunk = json.loads(data)
            seen["response_id"] = chunk.get("id")
            if "error" in chunk:
                seen.update(end="error", error_id=chunk["error"].get("request_id"))
                continue
            for choice in chunk.get("choices") or []:
                if choice["delta"].get("content") and not killed.is_set():
                    seen["output_before_kill"] = True
                if choice.get("finish_reason"):
                    seen["end"] = choice["finish_reason"]
    return seen


async def kill_during_streams(url: str) -> list[str]:
    killed = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        old_pid = (await client.get("/health")).json()["worker_pid"]
        tasks = [asyncio.create_task(stream(client, n, killed)) for n in range(24)]
        await asyncio.sleep(6)  # long enough for the first streams to have output, not to finish
        os.kill(old_pid, signal.SIGKILL)
        killed.set()
        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
        took = time.monotonic() - started
        health = (await client.get("/health")).json()
    with_output = [r for r in results if r["output_before_kill"]]
    without = [r for r in results if not r["output_before_kill"]]
    print(f"  killed worker {old_pid}: {len(with_output)} streams had output, {len(without)} had none; "
          f"all ended {took:.1f} s after the kill")
    print(f"  had output: {sorted(str(r['end']) for r in with_output)}")
    print(f"  had none:   {sorted(str(r['end']) for r in without)}")
    print(f"  health: {health['status']}, worker_restarts {health['worker_restarts']}, "
          f"worker_pid {health['worker_pid']}")
    problems = [f"a stream with output ended {r['end']!r}, error id {r['error_id']!r} (id {r['response_id']!r})"
                for r in with_output if r["end"] != "error" or r["error_id"] != r["response_id"]]
    problems += [f"a stream without output ended {r['end']!r}" for r in without if r["end"] not in ("stop", "length")]
    if not with_output or not without:
        problems.append("the kill did not find both kinds of stream; change the timing")
    if health["worker_restarts"] != 1 or health["worker_pid"] == old_pid:
        problems.append(f"the worker was not restarted once: {health}")
    if not await slots_free(url):
        problems.append("slots still busy after the kill")
    return problems


def kill_while_loading() -> list[str]:
    port = free_port()
    proc = subprocess.Popen([MASHBOX, "run", "--port", str(port)], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pid = _worker_pid(f"http://127.0.0.1:{port}", proc)
        if pid is None:
            return ["the worker's pid never showed on /health while loading"]
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - started
        said = [line for line in proc.stderr.read().splitlines() if line.startswith("mashbox:")]
    except subprocess.TimeoutExpired:
        return ["mashbox run still runs 30 s after its worker was killed while loading"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"  killed worker {pid} while loading: exit code {code} after {took:.1f} s; it said:")
    print("\n".join(f"    {line}" for line in said))
    problems = [] if code == 1 else [f"exit code {code}, not 1"]
    if not any("did not load" in line and "killed" in line for line in said):
        problems.append("no line saying the worker was killed while loading")
    return problems


def _worker_pid(url: str, proc: subprocess.Popen, timeout: float = 60) -> int | None:
    """The worker's pid as soon as /health shows it, while the status is still ``loading``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            health = httpx.get(f"{url}/health", timeout=1).json()
            if health.get("worker_pid") and health["status"] == "loading":
                return health["worker_pid"]
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return None


def corrupt_cache() -> list[str]:
    from mashbox.engine.load.catalog import cache_dir, resolve
    from mashbox.engine.load.loader import converted_dir

    source = resolve("smollm2-135m")
    own = converted_dir(source)
    with tempfile.TemporaryDirectory(prefix="mashbox-cache-") as cache:
        copy = Path(cache) / own.relative_to(cache_dir())
        if (own / "complete").is_file():
            shutil.copytree(own, copy)  # the user's copy stays whole
        else:
            return [f"no converted copy in {own} yet: run mashbox once first"]
        tokenizer = copy / "tokenizer.json"
        whole = tokenizer.stat().st_size
        with tokenizer.open("r+b") as file:
            file.truncate(1_000)
        log = Path(cache) / "server.log"
        with log.open("w") as out:
            started = time.monotonic()
            with_server(lambda url, pid: {}, env={"MASHBOX_CACHE": cache}, stderr=out)
        took = time.monotonic() - started
        said = [line for line in log.read_text().splitlines() if "does not read" in line]
        size = tokenizer.stat().st_size
    print(f"  cut {tokenizer} to 1,000 bytes; the server served after {took:.1f} s; the file is {size:,} bytes "
          f"again ({whole:,} before)")
    print("\n".join(f"    {line}" for line in said))
    problems = [] if said and str(tokenizer) in said[0] else ["no line naming the unreadable file"]
    return problems + ([] if size == whole else ["the file was not built again"])


SCENARIOS = {
    "kill-streams": lambda: with_server(lambda url, pid: asyncio.run(kill_during_streams(url)), "--slots", "16"),
    "kill-loading": kill_while_loading,
    "corrupt-cache": corrupt_cache,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=", ".join(SCENARIOS) + " (default: all)")
    names = parser.parse_args().scenarios or list(SCENARIOS)
    if unknown := set(names) - set(SCENARIOS):
        parser.error(f"unknown scenario {', '.join(sorted(unknown))}; choose from {', '.join(SCENARIOS)}")
    failed = False
    for name in names:
        print(f"{name}:", flush=True)
        problems = SCENARIOS[name]()
        failed |= bool(problems)
        print("\n".join(f"  PROBLEM: {p}" for p in problems) or "  held", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
