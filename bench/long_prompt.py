"""A coding agent's long first prompt on mashbox and llama-server, side by side: prefill and decode at depth.

    .venv/bin/python bench/long_prompt.py [--llama-server PATH] [--request REQUEST.json] [--model qwen2.5-coder-0.5b]
    .venv/bin/python bench/long_prompt.py --tokens 8192 --ctx 9216 --kv-dtype q8_0    # a prompt of a given length

The prompt is a captured agent request (default: Claude Code's first ``POST /v1/messages`` in
../shared/clients, about 18k tokens on qwen2.5-coder), flattened to one system and one user
message of plain text so that both servers tokenize the same text with the model's own chat
template. Each server starts fresh (mashbox with an empty prefix folder: nothing cached) on the
same GGUF and the same number of threads, gets the request once, streaming, greedy, and reports:
prompt tokens (as it counts them), seconds to the first token, prompt tokens per second, and
decode tokens per second at that depth (the answer's tokens after the first, over their time).

``--tokens N`` asks instead about a text of about N tokens (bench/quality.py's standard-library
docstrings, repeated as needed); ``--kv-dtype q8_0`` runs both KV caches in q8_0 (llama-server's
``-ctk/-ctv q8_0``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare import DEFAULT_LLAMA, ROOT, amx_without_support, free_port, stop, wait_ready

CLAUDE_CODE = ROOT.parent / "shared" / "clients" / "claude-code_POST_v1_messages.json"
ASK = "\n\nBefore anything else, describe in detail, in at least 300 words, what you are and what tools you have."
SUMMARIZE = "\n\nSummarize the text above in detail, in at least 300 words."


def flatten(request: dict) -> list[dict]:
    """A captured request as a system message (its system text, then its tools as JSON) and a user message."""
    body = request["body"]
    system = body.get("system") or body.get("instructions") or ""
    if isinstance(system, list):
        system = "\n\n".join(part.get("text", "") for part in system)
    tools = json.dumps(body.get("tools") or [], indent=1)
    messages = body.get("messages") or body.get("input") or []
    texts = []
    for message in [{"content": messages}] if isinstance(messages, str) else messages:
        content = message.get("content")
        parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content or []]
        texts += [p for p in parts if p]
    return [{"role": "system", "content": f"{system}\n\n# Tools\n{tools}"},
            {"role": "user", "content": "\n\n".join(texts) + ASK}]


def sized(tokens: int, model: str) -> list[dict]:
    """One user message: about ``tokens`` tokens of fixed English prose, then a request to summarize it."""
    from quality import text

    from mashbox.engine.load.loader import load

    tokenizer = load(model).tokenizer
    ids = tokenizer.encode(text(), add_special_tokens=False)
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    return [{"role": "user", "content": tokenizer.decode(ids) + SUMMARIZE}]


def measure(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """Stream one greedy answer; time its first and last tokens."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, stamps, usage = time.monotonic(), [], {}
    with httpx.Client(base_url=url, timeout=3600) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                stamps.append(time.monotonic() - started)
    prompt, answer = usage.get("prompt_tokens", 0), usage.get("completion_tokens", len(stamps))
    ttft = stamps[0] if stamps else float("nan")
    decode = (answer - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and answer > 1 else float("nan")
    return {"prompt_tokens": prompt, "ttft_s": ttft, "prefill_tok_s": prompt / ttft, "answer_tokens": answer,
            "decode_tok_s": decode}


@contextmanager
def serving(command: list[str], url: str, env: dict[str, str], log: str) -> Iterator[None]:
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=out, start_new_session=True)
    try:
        if wait_ready(url + "/health", proc, 600) is None:  # both answer 200 there once loaded
            raise SystemExit(f"{command[0]} did not become ready; see {log}")
        yield
    finally:
        stop(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=str(DEFAULT_LLAMA))
    parser.add_argument("--request", type=Path, default=CLAUDE_CODE)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--only", choices=["mashbox", "llama-server"])
    parser.add_argument("--tokens", type=int, default=None, help="a prompt of about this many tokens of prose "
                        "instead of the captured request")
    parser.add_argument("--kv-dtype", choices=["f16", "q8_0"], default="f16")
    args = parser.parse_args()
    from mashbox.engine.load.catalog import resolve

    gguf = resolve(args.model).path
    messages = sized(args.tokens, args.model) if args.tokens else flatten(json.loads(args.request.read_text()))
    kv = args.kv_dtype
    results = {}
    with tempfile.TemporaryDirectory(prefix="mashbox-long-") as folder:
        port = free_port()
        servers = {
            "mashbox": ([str(ROOT / ".venv/bin/mashbox"), "run", args.model, "--port", str(port), "--ctx",
                         str(args.ctx), "--slots", "1", "--cache-dir", folder, "--kv-dtype", kv],
                        {"OMP_NUM_THREADS": str(args.threads)}),
            "llama-server": ([args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                              "-c", str(args.ctx), "-np", "1", "-t", str(args.threads), "--jinja", "--no-webui",
                              "-ctk", kv, "-ctv", kv,
                              *(["--no-repack"] if amx_without_support() else [])], {}),
        }
        for name, (command, env) in servers.items():
            if args.only and name != args.only:
                continue
            url = f"http://127.0.0.1:{port}"
            with serving(command, url, env, f"{folder}/{name}.log"):
                results[name] = measure(url, args.model, messages, args.max_tokens)
            print(name, json.dumps(results[name]), flush=True)
    if len(results) == 2:
        mine, peer = results["mashbox"], results["llama-server"]
        print(f"prefill: mashbox {mine['prefill_tok_s']:.1f} tok/s, llama-server {peer['prefill_tok_s']:.1f} tok/s"
              f" ({mine['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x); decode at depth: mashbox "
              f"{mine['decode_tok_s']:.2f} tok/s, llama-server {peer['decode_tok_s']:.2f} tok/s "
              f"({mine['decode_tok_s'] / peer['decode_tok_s']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
