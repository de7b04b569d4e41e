"""The real coding agents against model servers: can each read a file and say what it holds?

    python bench/agents.py [--servers mashbox llama-server] [--llama-server PATH] [--url URL]
                           [--bin .agents/node_modules/.bin]

``make agents`` installs the pinned Claude Code, Codex and Pi into ``.agents/`` and runs this. It
starts ``mashbox run qwen2.5-coder-0.5b --ctx 32768 --slots 2`` on a free port (prefix pages in
``.agents/prefixes``, so a second run is warm), runs every agent, stops it, then does the same with
llama.cpp's server on the same GGUF (``--llama-server``, built by bench/build_llama_server.sh), and
prints the two side by side: how many tasks each solved. ``--url`` runs against one server that is
already up instead. Each agent gets a fresh folder holding ``secret.txt`` with a random word (the
same word on both servers; ``/tmp/mashbox-agents/AGENT/work``, the same path every run and
outside any git repository), a fresh home beside it (its own config, nothing from ``~``), and one
prompt: read the file, say the word. ``--task config`` asks for the port a ``config.json`` sets,
``--task find`` which of three modules defines a function named by the word: the same checks, other
files and words.
Claude Code speaks Anthropic Messages, Codex Responses, Pi each of the three protocols.

Every request goes through a logging proxy (bench/agent_proxy.py), which times the first turn's
first model output as the agent sees it and reads the tool calls out of the answers. Prints one
table, and writes every exchange to ``--log-dir`` (request body, raw answer, timings) to explain
an agent that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from agent_proxy import Proxy, summary
from compare import ROOT, amx_without_support, free_port, wait_ready

MODEL = "qwen2.5-coder-0.5b"
MODULES = {"billing.py": "def total(prices):\n    return sum(prices)\n",
           "shapes.py": "def area(width, height):\n    return width * height\n",
           "words.py": "def shout(text):\n    return text.upper() + '!'\n"}
WORDS = ("marmalade", "quokka", "tangerine", "zeppelin", "walrus", "obsidian", "pelican", "saffron",
         "gondola", "juniper", "kumquat", "narwhal", "paprika", "lantern", "meringue", "falcon")
AGENTS = ("pi-openai-completions", "pi-openai-responses", "pi-anthropic-messages", "codex", "claude-code")
SERVERS = ["mashbox", "llama-server"]
WATCHDOG_MS = "1800000"  # Claude Code's stream watchdog and request timeout: a cold prefill may pass 5 min


@dataclass(frozen=True)
class Task:
    """What each agent is asked, in a folder of the files it needs; ``key`` is the run's random word."""

    prompt: str
    files: Callable[[str], dict[str, str]]
    answer: Callable[[str], str]  # what a right answer says
    others: Callable[[str], tuple[str, ...]] = lambda key: ()  # what it does not (the wrong files)

    def solved(self, key: str, text: str) -> bool:
        text = text.lower()
        return self.answer(key).lower() in text and not any(o.lower() in text for o in self.others(key))


def _port(key: str) -> str:
    return str(8000 + int(key[-3:]))


def _config(key: str) -> dict[str, str]:
    return {"config.json": json.dumps({"name": key[:-3], "port": int(_port(key)), "debug": False}, indent=2) + "\n"}


def _home(key: str) -> str:
    """The module that defines the function named ``key``."""
    return sorted(MODULES)[int(key[-3:]) % len(MODULES)]


def _modules(key: str) -> dict[str, str]:
    defined = f"\n\ndef {key}(value):\n    return value * 2\n"
    return {name: code + (defined if name == _home(key) else "") for name, code in MODULES.items()}


TASKS = {
    "secret": Task("Read the file secret.txt in the current folder and tell me the secret word written in it.",
                   lambda key: {"secret.txt": f"{key}\n"}, lambda key: key),
    "config": Task("Read the file config.json in the current folder and tell me which port it sets.", _config, _port),
    "find": Task("Search the Python files in the current folder and tell me which file defines the function {key}.",
                 _modules, _home, lambda key: tuple(name for name in MODULES if name != _home(key))),
}


@dataclass
class Run:
    """One agent's run: what it was asked, how it ended, what it answered."""

    agent: str
    word: str
    folder: Path
    rc: int | None = None
    seconds: float = 0.0
    answer: str = ""
    log: str = ""


def secret_word(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}{rng.randrange(100, 1000)}"


def command(agent: str, binaries: Path, proxy_url: str, home: Path,
            prompt: str) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment that run ``agent`` once, non-interactively, asked ``prompt``."""
    env = {"HOME": str(home), "NO_COLOR": "1"}
    if agent == "claude-code":
        env |= {"ANTHROPIC_BASE_URL": proxy_url, "ANTHROPIC_AUTH_TOKEN": "mashbox", "ANTHROPIC_MODEL": MODEL,
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "CLAUDE_STREAM_IDLE_TIMEOUT_MS": WATCHDOG_MS, "API_TIMEOUT_MS": WATCHDOG_MS,
                "DISABLE_AUTOUPDATER": "1"}
        # As root Claude Code refuses --dangerously-skip-permissions; allowing Read is all this needs.
        return [str(binaries / "claude"), "-p", prompt, "--allowedTools", "Read", "--model", MODEL], env
    if agent == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(proxy_url))
        env["CODEX_HOME"] = str(codex_home)
        return [str(binaries / "codex"), "exec", "--skip-git-repo-check", "--color", "never",
                "-s", "read-only", "-o", str(home / "answer.txt"), prompt], env
    api = agent.removeprefix("pi-")
    pi_dir = home / ".pi" / "agent"
    pi_dir.mkdir(parents=True, exist_ok=True)
    (pi_dir / "models.json").write_text(json.dumps(pi_models(proxy_url, api), indent=2))
    env |= {"PI_CODING_AGENT_DIR": str(pi_dir), "PI_OFFLINE": "1", "PI_TELEMETRY": "0"}
    return [str(binaries / "pi"), "-p", "--provider", "mashbox", "--model", MODEL, "--no-session",
            "--no-extensions", "--no-skills", "--no-context-files", prompt], env


def codex_config(proxy_url: str) -> str:
    return f"""model = "{MODEL}"
model_provider = "mashbox"
model_context_window = 32768

[model_providers.mashbox]
name = "mashbox"
base_url = "{proxy_url}/v1"
wire_api = "responses"
stream_idle_timeout_ms = {WATCHDOG_MS}
request_max_retries = 1
stream_max_retries = 1
"""


def pi_models(proxy_url: str, api: str) -> dict:
    base = proxy_url if api == "anthropic-messages" else f"{proxy_url}/v1"
    model = {"id": MODEL, "contextWindow": 32768, "maxTokens": 4096}
    return {"providers": {"mashbox": {"baseUrl": base, "api": api, "apiKey": "mashbox", "models": [model]}}}


def run_agent(agent: str, binaries: Path, proxy: Proxy, scratch: Path, task: Task, word: str,
              timeout: float) -> Run:
    folder = scratch / agent
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "work").mkdir(parents=True)
    for name, text in task.files(word).items():
        (folder / "work" / name).write_text(text)
    argv, env = command(agent, binaries, proxy.url, folder / "home", task.prompt.format(key=word))
    run, proxy.label, started = Run(agent, word, folder), agent, time.monotonic()
    print(f"[{time.strftime('%H:%M:%S')}] {agent}: {' '.join(argv[:2])} ... (word {word})", flush=True)
    try:
        done = subprocess.run(argv, check=False, cwd=folder / "work", env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
        run.rc, run.answer, run.log = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        run.answer, run.log = _text(expired.stdout), _text(expired.stderr) + f"\n[timed out after {timeout:.0f} s]"
    run.seconds = time.monotonic() - started
    if (folder / "home" / "answer.txt").exists():
        run.answer = (folder / "home" / "answer.txt").read_text()
    return run


def _text(value: bytes | str | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def row(run: Run, proxy: Proxy, task: Task) -> dict:
    exchanges = proxy.of(run.agent)
    turns = [x for x in exchanges if x.is_turn]
    summaries = [summary(x) for x in turns]
    first = turns[0].ttft() if turns else None
    errors = [e for s in summaries for e in s.errors] + [f"{x.method} {x.path}: HTTP {x.status}"
                                                           for x in exchanges if not x.is_turn and x.status >= 400]
    return {"agent": run.agent, "rc": "timeout" if run.rc is None else run.rc, "seconds": round(run.seconds),
            "ttft_s": None if first is None else round(first, 1), "turns": len(turns),
            "tool_calls": sum(len(s.calls) for s in summaries), "calls": [c for s in summaries for c in s.calls],
            "solved": task.solved(run.word, run.answer), "word": run.word, "expected": task.answer(run.word),
            "answer": run.answer.strip()[:400], "protocol_errors": errors}


def table(rows: list[dict]) -> str:
    head = "| agent / protocol | exit | first token, turn 1 | model turns | tool calls | answer holds the word |"
    lines = [head + " the answer begins |", "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s']:.1f} s"
        begins = " ".join(r["answer"].split())[:50].replace("|", "\\|").replace("`", "'")
        lines.append(f"| {r['agent']} | {r['rc']} | {ttft} | {r['turns']} | {r['tool_calls']} | "
                     f"{'yes' if r['solved'] else 'no'} | `{begins}` |")
    return "\n".join(lines)


def write_log(log_dir: Path, run: Run, proxy: Proxy) -> None:
    folder = log_dir / run.agent
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "agent.log").write_text(f"exit {run.rc} after {run.seconds:.0f} s\n--- stdout\n{run.answer}\n"
                                      f"--- stderr\n{run.log}")
    for n, x in enumerate(proxy.of(run.agent), 1):
        s = summary(x)
        meta = {"method": x.method, "path": x.path, "status": x.status, "error": x.error,
                "headers_s": x.headers_at and round(x.headers_at - x.started, 2), "first_output_s": x.ttft(),
                "total_s": x.ended_at and round(x.ended_at - x.started, 2), "calls": s.calls, "text": s.text,
                "stop": s.stop, "usage": s.usage, "errors": s.errors}
        (folder / f"{n:02d}.json").write_text(json.dumps({"summary": meta, "request": x.body}, indent=1))
        (folder / f"{n:02d}.answer.txt").write_bytes(bytes(x.raw))


def server_command(args: argparse.Namespace, server: str, port: int) -> list[str]:
    if server == "llama-server":
        from mashbox.engine.load.catalog import resolve

        command = [args.llama_server, "-m", str(resolve(MODEL).path), "--host", "127.0.0.1", "--port", str(port),
                   "-c", str(args.ctx), "-np", "1", "--jinja", "--no-webui"]
        return command + (["--no-repack"] if amx_without_support() else [])
    return [sys.executable, "-m", "mashbox", "run", MODEL, "--port", str(port), "--ctx", str(args.ctx),
            "--slots", "2", "--cache-dir", str(args.cache_dir), *shlex.split(args.mashbox_flags)]


def serve(args: argparse.Namespace, server: str, log_path: Path) -> tuple[str, subprocess.Popen | None]:
    if server == "url":
        return args.url.rstrip("/"), None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    argv = server_command(args, server, port)
    print(f"starting {' '.join(argv)}; its log: {log_path}", flush=True)
    proc = subprocess.Popen(argv, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    if wait_ready(url + "/health", proc, 900) is None:  # llama-server without its web page answers no /
        proc.terminate()
        raise SystemExit(f"the server did not become ready; see {log_path}")
    return url, proc


def run_all(args: argparse.Namespace, server: str, words: dict[str, str], log_dir: Path) -> list[dict]:
    """Every agent against one server (started here unless ``server`` is ``url``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    url, proc = serve(args, server, log_dir / "server.log")
    rows = []
    try:
        with Proxy(url) as proxy:
            for agent in args.agents:
                task = TASKS[args.task]
                run = run_agent(agent, args.bin.resolve(), proxy, args.work.resolve(), task, words[agent],
                                args.timeout)
                write_log(log_dir, run, proxy)
                rows.append(row(run, proxy, task))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return rows


def side_by_side(results: dict[str, list[dict]]) -> str:
    """One line per agent: each server's exit, first token, calls and whether it solved the task."""
    servers = list(results)
    head = "| agent / protocol | " + " | ".join(f"{s}: exit, first token, calls, solved" for s in servers) + " |"
    lines = [head, "|---|" + "---|" * len(servers)]
    for i, r in enumerate(results[servers[0]]):
        cells = []
        for server in servers:
            x = results[server][i]
            ttft = "-" if x["ttft_s"] is None else f"{x['ttft_s']:.1f} s"
            cells.append(f"{x['rc']}, {ttft}, {x['tool_calls']}, **{'yes' if x['solved'] else 'no'}**")
        lines.append(f"| {r['agent']} | " + " | ".join(cells) + " |")
    solved = ", ".join(f"{s} {sum(x['solved'] for x in rows)} of {len(rows)}" for s, rows in results.items())
    return "\n".join(lines) + f"\n\nSolved: {solved}."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=SERVERS, choices=SERVERS)
    parser.add_argument("--url", help="run against this already running server instead")
    parser.add_argument("--llama-server", default="/tmp/llama-peer/build/bin/llama-server",
                        help="llama.cpp's server binary (default: where bench/build_llama_server.sh puts it)")
    parser.add_argument("--mashbox-flags", default="",
                        help="more flags for mashbox run: --mashbox-flags='--sampling temperature=0.7'")
    parser.add_argument("--bin", type=Path, default=ROOT / ".agents/node_modules/.bin", help="the agents' binaries")
    parser.add_argument("--agents", nargs="+", default=list(AGENTS), choices=AGENTS)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".agents/prefixes")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mashbox-agents",
                        help="each agent's folder and home go here (the same folder every run)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each agent may take")
    parser.add_argument("--log-dir", type=Path, help="default: a new folder under /tmp")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--seed", type=int, help="for the secret words (default: random)")
    parser.add_argument("--task", default="secret", choices=TASKS, help="secret (default): say the word secret.txt "
                        "holds; config: the port config.json sets; find: which of three modules defines a function")
    args = parser.parse_args()
    servers = ["url"] if args.url else args.servers
    if "llama-server" in servers and not Path(args.llama_server).exists():
        parser.error(f"--llama-server: {args.llama_server} does not exist; build it with bench/build_llama_server.sh")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="mashbox-agents-"))
    rng = random.Random(args.seed)
    words = {agent: secret_word(rng) for agent in args.agents}
    results = {}
    for server in servers:
        results[server] = run_all(args, server, words, log_dir / server)
        name = args.url if server == "url" else f"llama-server {args.llama_server}" if server == "llama-server" \
            else f"mashbox run {MODEL}"
        print(f"\n{name}, {date.today()}; logs: {log_dir / server}\n\n{table(results[server])}", flush=True)
    if len(results) > 1:
        print(f"\n{side_by_side(results)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    rows = [r for server_rows in results.values() for r in server_rows]
    return 0 if all(r["rc"] == 0 and not r["protocol_errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
