"""Speculation from the prompt, side by side: mashbox with and without it, llama-server with none and
with its n-gram modes, on the same GGUF and the same requests.

    .venv/bin/python bench/speculation.py [--model qwen2.5-coder-0.5b] [--streams 1 4 16]
                                          [--llama-server PATH] [--modes ngram-simple ngram-map-k ngram-mod]
                                          [--temperature 0.7]

Two workloads, non-streaming chat requests of ``--max-tokens`` new tokens each, greedy (or sampled at
``--temperature``, stream i with seed i):
  * edit: an agent's edit turn: a real source file of this repository shown in full, and the whole
    file asked back with one function renamed (the answer copies most of the prompt);
  * prose: a story, with nothing in the prompt to copy.
At each stream count, that many requests at once (each stream its own file or topic, each prompt
sent once before with one token to make, so that its prefix is cached and decoding is measured); it prints
output tokens per second (completion tokens over the wall time) for each server and workload, and
the ratio to mashbox without speculation. Servers start one at a time on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from compare import DEFAULT_LLAMA, ROOT, Server, free_port, llama_server, mashbox_server, stop, wait_ready

FILES = ["mashbox/engine/sched/draft.py", "mashbox/engine/sched/slots.py", "mashbox/engine/sched/pace.py",
         "mashbox/engine/channel.py", "mashbox/server/gate.py", "mashbox/server/context.py",
         "mashbox/engine/text/stop.py", "mashbox/server/page.py"]
TOPICS = ["the sea", "a lighthouse", "mountains", "a robot", "the moon", "a forest", "a train", "rain"]
CHARS = 2400  # of each file: its start, so that the prompt and the answer fit the context


def edit(i: int) -> str:
    text = (ROOT / FILES[i % len(FILES)]).read_text()[:CHARS]
    return (f"Here is a file of my project:\n```python\n{text}\n```\nRename the first function or class in it to "
            f"have the suffix `_v2`, and show me the whole file again with that change, nothing else.")


def prose(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}, with several characters and a clear ending."


async def run(url: str, model: str, prompts: list[str], max_tokens: int, temperature: float) -> float:
    """Output tokens per second of ``prompts`` sent at once."""
    async with httpx.AsyncClient(timeout=900) as client:
        async def one(prompt: str, seed: int, most: int = max_tokens) -> int:
            r = await client.post(f"{url}/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": most,
                "temperature": temperature, "seed": seed})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        for prompt in prompts:  # each prompt once first: the answers' speed, not the prompts', is measured
            await one(prompt, 0, 1)
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))
        return sum(tokens) / (time.perf_counter() - start)


def measure(server: Server, args, ctx: int) -> dict[str, float]:
    port = server.command[server.command.index("--port") + 1]
    proc = subprocess.Popen(server.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, **server.env})
    url, figures = f"http://127.0.0.1:{port}", {}
    try:
        if wait_ready(url + server.health, proc, args.ready_timeout) is None:
            raise SystemExit(f"{server.name} did not start: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        for streams in args.streams:
            for name, make in (("edit", edit), ("prose", prose)):
                prompts = [make(i) for i in range(streams)]
                rate = asyncio.run(run(url, server.model, prompts, args.max_tokens, args.temperature))
                figures[f"{name} x{streams}"] = rate
                print(f"  {server.name}: {name} x{streams}: {rate:.1f} tok/s", flush=True)
    finally:
        stop(proc)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--llama-server", default=str(DEFAULT_LLAMA))
    parser.add_argument("--modes", nargs="*", default=["ngram-simple", "ngram-map-k", "ngram-mod"],
                        help="llama-server's --spec-type values to run (none is always run)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ready-timeout", type=float, default=180)
    args = parser.parse_args()
    ctx, slots = 4096, max(args.streams)
    servers = []
    with tempfile.TemporaryDirectory() as pages:
        for flags, name in ((["--no-speculation"], "mashbox"), ([], "mashbox (speculation)")):
            server = mashbox_server(args.model, free_port(), args.threads, pages, ctx, slots)
            server.command += flags
            server.name = name
            servers.append(server)
        if Path(args.llama_server).is_file():
            for mode in ["none", *args.modes]:
                server = llama_server(args.model, args.llama_server, free_port(), args.threads, ctx, slots)
                server.command += ["--spec-type", mode]
                server.name = f"llama-server {mode}"
                servers.append(server)
        else:
            print(f"no llama-server at {args.llama_server}: bench/build_llama_server.sh builds one")
        results = {}
        for server in servers:
            print(f"{server.name}: {' '.join(server.command)}", flush=True)
            results[server.name] = measure(server, args, ctx)
    base = results["mashbox"]
    print("\n| server | " + " | ".join(base) + " |")
    print("|---|" + "---|" * len(base))
    for name, figures in results.items():
        cells = [f"{figures[k]:.1f} ({figures[k] / base[k]:.2f}x)" for k in base]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
