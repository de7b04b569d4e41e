"""mashbox against the peers it finds, side by side in one run, on the same GGUF and load.

    .venv/bin/python bench/compare.py [--model ID-or-.gguf] [--llama-server PATH] [--llama-cpp-python PYTHON]
                                      [--transformers] [--speculation]

Starts each server in turn on 127.0.0.1 (never two at once: they share the machine), once untimed (a
first start packs mashbox's weights and fills the page cache) and then for each round: waits for its
health (time to ready, a second start), then drives it with bench/loadgen.py at each stream count
(~107-token prompts, 128 new tokens, greedy, streaming), times one 2k-token prompt to its first token
(prefill speed), and a second 2k-token prompt sharing the first's prefix (the prefix cache).
``--model`` takes a catalog id or a GGUF path (default smollm2-135m); the table then says how many
bytes of weights a decode step reads (every matrix of the file once; the embedding only if it is also
the output) and the GB/s each server reaches at one stream, beside what this machine's memory gives a
plain read (bench/memory_read.py). Peers: llama.cpp's ``llama-server`` (``--llama-server``, else on
PATH, else where bench/build_llama_server.sh puts it) with 16 slots on the same GGUF; llama-cpp-python's
server (``--llama-cpp-python``, a python that has it, else where bench/build_llama_cpp_python.sh puts
it) on the same GGUF, which answers one request at a time; ``transformers serve`` with ``--transformers`` (its
dependencies: ``pip install -e '.[bench]'``). Prints one table with each figure and mashbox's
ratio to the best peer, and writes it as JSON with --json.

``--rounds N`` measures every server N times, taking turns (mashbox first in odd rounds, last in even
ones), and reports each figure's median: this machine's speed drifts 10-30% within minutes, and a short
one-stream sample run minutes after its peer's can swing the ratio by as much; each round's ratios are
printed as well.

mashbox runs with ``--no-speculation`` unless ``--speculation`` is given, as the peers run without
theirs: the load generator's answers repeat themselves enough that proposals from the prompt would
measure speculation, not the kernels (bench/speculation.py measures it, beside llama-server's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import loadgen  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LLAMA = Path("/tmp/llama-peer/build/bin/llama-server")
DEFAULT_LLAMA_PYTHON = Path("/tmp/llama-peer/python/bin/python")
CTX = 2048
SLOTS = 16


@dataclass
class Server:
    name: str
    command: list[str]
    model: str
    env: dict[str, str] = field(default_factory=dict)
    figures: dict[str, float | None] = field(default_factory=dict)
    rounds: list[dict[str, float | None]] = field(default_factory=list)  # each round's figures
    note: str = ""
    health: str = "/health"  # the path that answers 200 once the model is loaded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_of(model: str) -> tuple[str, Path]:
    """(id, GGUF path) of a catalog id or a GGUF path."""
    from mashbox.engine.load.catalog import resolve

    source = resolve(model)
    if source.kind != "gguf":
        raise SystemExit(f"{model}: compare.py runs the peers on a GGUF; this is an HF directory")
    return source.id, source.path


def bytes_per_token(gguf: Path) -> int:
    """Bytes of weights a decode step reads: every matrix once, the embedding only where it is the output."""
    from mashbox.engine.load.gguf_file import GGUFFile

    f = GGUFFile(gguf)
    sizes = {name: f.raw(name).numel() for name, info in f.tensors.items() if len(info.shape) > 1}
    tied = "output.weight" not in sizes
    return sum(size for name, size in sizes.items() if name != "token_embd.weight" or tied)


def amx_without_support() -> bool:
    """llama.cpp's AMX repacking crashes on some VMs that report AMX: run it with --no-repack there."""
    try:
        return "amx" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def mashbox_server(model: str, port: int, threads: int, pages: str, ctx: int = CTX, slots: int = SLOTS) -> Server:
    """mashbox with its prompt pages in ``pages``, an empty folder: the cold prompt is cold."""
    command = [str(ROOT / ".venv/bin/mashbox"), "run", model, "--port", str(port), "--ctx", str(ctx), "--slots",
               str(slots), "--cache-dir", pages]
    return Server("mashbox", command, gguf_of(model)[0], {"OMP_NUM_THREADS": str(threads)})


def llama_server(model: str, binary: str, port: int, threads: int, ctx: int = CTX, slots: int = SLOTS) -> Server:
    name, path = gguf_of(model)
    command = [binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(ctx * slots), "-np", str(slots), "-t", str(threads), "--no-webui"]
    if amx_without_support():
        command.append("--no-repack")
    return Server("llama-server", command, name)


def llama_cpp_python_server(model: str, python: str, port: int, threads: int) -> Server:
    name, path = gguf_of(model)
    command = [python, "-m", "llama_cpp.server", "--model", str(path), "--model_alias", name,
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(CTX), "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--interrupt_requests", "False", "--verbose", "False"]
    return Server("llama-cpp-python", command, name, health="/v1/models")


def transformers_server(port: int, threads: int) -> Server:
    """``transformers serve`` on the embedded model, dequantized once into an HF directory for it."""
    from mashbox.engine.load.catalog import cache_dir
    from mashbox.engine.load.loader import hf_model, load

    model = cache_dir() / "bench" / "smollm2-135m-hf"
    if not (model / "config.json").is_file():
        hf_model("smollm2-135m").save_pretrained(model)
        load("smollm2-135m").tokenizer.save(model)
    command = [str(ROOT / ".venv/bin/transformers"), "serve", str(model), "--port", str(port), "--continuous-batching"]
    return Server("transformers serve", command, str(model), {"OMP_NUM_THREADS": str(threads)})


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float | None:
    """Seconds until GET ``url`` answers 200, or None if the process died or time ran out."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            return None
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return None


def load(url: str, model: str, streams: int, requests: int, max_tokens: int) -> dict:
    args = argparse.Namespace(
        url=url, model=model, concurrency=streams, requests=requests, max_tokens=max_tokens, prompt_len=64,
        prompt_seed=1234, seed=0, warmup=1, request_timeout=300.0, deadline=900.0, no_usage=False,
        ignore_eos=False, extra_body=None, label="", json_out=None, quiet=True)
    return asyncio.run(loadgen.run(args))


def first_token(url: str, model: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens) of one request."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, first, prompt_tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return (first or time.perf_counter() - start), prompt_tokens


def prompt_tokens(url: str, model: str, prompt: str) -> int:
    """The prompt's tokens by the usage of a plain answer, for a server whose stream has no usage."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["usage"]["prompt_tokens"]


def long_prompt(seed: int, words: int = 1500) -> str:
    return loadgen.make_prompts(1, words, seed=seed)[0]


def start(server: Server) -> tuple[str, subprocess.Popen]:
    """``server`` started: its base URL and its process."""
    port = int(server.command[server.command.index("--port") + 1])
    proc = subprocess.Popen(server.command, env={**os.environ, **server.env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    return f"http://127.0.0.1:{port}", proc


def prime(server: Server, args) -> None:
    """Start ``server`` once and stop it when ready, untimed: a first start packs mashbox's weights for its
    kernels (a new GGUF, or new kernels) and reads the file into the page cache, for either server, so
    that every round's time to ready is a second start's."""
    url, proc = start(server)
    try:
        if wait_ready(url + server.health, proc, args.ready_timeout) is None:
            server.note = f"did not become ready: {_tail(proc)}"
    finally:
        stop(proc)


def measure(server: Server, args) -> None:
    url, proc = start(server)
    try:
        ready = wait_ready(url + server.health, proc, args.ready_timeout)
        if ready is None:
            server.note = f"did not become ready: {_tail(proc)}"
            return
        server.figures["ready_s"] = ready
        server.figures["rss_idle_mib"] = tree_rss_mib(proc.pid)
        for n in args.streams:
            summary = load(url, server.model, n, args.requests, args.max_tokens)
            server.figures[f"tok_s_{n}"] = summary["output_tok_per_s"] if summary["errors"] == 0 else None
            ttft = summary["ttft_ms"]["p50"]  # None where no answer wrote any text
            server.figures[f"ttft_p50_{n}"] = None if ttft is None else ttft / 1000
            server.figures["rss_load_mib"] = max(server.figures.get("rss_load_mib", 0), tree_rss_mib(proc.pid))
            print(f"  {server.name}: {n} streams {summary['output_tok_per_s']} tok/s, "
                  f"TTFT p50 {summary['ttft_ms']['p50']} ms, errors {summary['errors']}", flush=True)
        cold, tokens = first_token(url, server.model, long_prompt(7) + " Summarise this.")
        warm, _ = first_token(url, server.model, long_prompt(7) + " List the nouns.")
        tokens = tokens or prompt_tokens(url, server.model, long_prompt(7) + " Summarise this.")
        server.figures.update(prefill_tok_s=tokens / cold, cold_ttft_s=cold, warm_ttft_s=warm,
                              prefix_warm_share=warm / cold)
        print(f"  {server.name}: {tokens}-token prompt: cold TTFT {cold:.2f} s, shared prefix {warm:.2f} s", flush=True)
    finally:
        stop(proc)


def median_figures(rounds: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each figure's median over the rounds that have it (None where none has)."""
    keys = {k for r in rounds for k in r}
    return {k: statistics.median(vs) if (vs := [r[k] for r in rounds if r.get(k) is not None]) else None
            for k in keys}


def round_ratios(servers: list[Server], i: int) -> str:
    """Round i's one- and many-stream ratios, mashbox over the first peer."""
    mine, peer = servers[0].rounds[i], servers[1].rounds[i]
    cells = [f"{key.removeprefix('tok_s_')} streams {mine[key] / peer[key]:.2f}x" for key in sorted(mine)
             if key.startswith("tok_s_") and mine.get(key) and peer.get(key)]
    return f"round {i + 1}: " + ", ".join(cells)


def stop(proc: subprocess.Popen) -> None:
    """End a server's process group (one that exited on its own is left as it is)."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        return "timed out"
    lines = (proc.stderr.read() or b"").decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (the server and its worker), MiB."""
    pids, total = [pid], 0
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        pids += [int(c) for c in children]
    return total / 1024


ROWS = [  # (figure, label, higher is better)
    ("ready_s", "time to ready, second start: /health 200 (s)", False),
    ("rss_idle_mib", "resident memory idle (MiB)", False),
    ("rss_load_mib", "resident memory under load (MiB)", False),
    *[(f"tok_s_{n}", f"{n} stream{'s' * (n > 1)}: output tok/s", True) for n in (1, 4, 16)],
    *[(f"ttft_p50_{n}", f"{n} stream{'s' * (n > 1)}: TTFT p50 (s)", False) for n in (1, 4, 16)],
    ("prefill_tok_s", "2k prompt: prefill tok/s", True),
    ("cold_ttft_s", "2k prompt: TTFT cold (s)", False),
    ("warm_ttft_s", "2k shared prefix: TTFT (s)", False),
    ("prefix_warm_share", "shared prefix TTFT / cold", False),
]


def roofline(servers: list[Server], weights: int, threads: int) -> str:
    """Bytes a decode step reads, the GB/s each server reaches at one stream, and the machine's plain read."""
    import memory_read

    read = memory_read.gb_per_s(threads)
    lines = [f"weights read per decode step: {weights / 1e9:.3f} GB; a plain memory read here: {read:.1f} GB/s "
             f"({threads} threads, bench/memory_read.py)"]
    for s in servers:
        tok_s = s.figures.get("tok_s_1")
        if tok_s:
            gb_s = tok_s * weights / 1e9
            lines.append(f"{s.name}: {tok_s:.1f} tok/s at one stream = {gb_s:.1f} GB/s of weights, "
                         f"{gb_s / read:.0%} of the plain read")
    return "\n".join(lines)


def table(servers: list[Server]) -> str:
    mine = servers[0]
    head = ["figure", *(s.name for s in servers), "mashbox / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, higher in ROWS:
        values = [s.figures.get(key) for s in servers]
        if all(v is None for v in values):
            continue
        peer_values = [v for v in values[1:] if v]
        best = (max if higher else min)(peer_values) if peer_values else None
        mine_value = mine.figures.get(key)
        ratio = "" if not (best and mine_value) else f"{(mine_value / best if higher else best / mine_value):.2f}x"
        cells = ["—" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}" for v in values]
        lines.append("| " + " | ".join([label, *cells, ratio]) + " |")
    notes = [f"{s.name}: {s.note}" for s in servers if s.note]
    return "\n".join(lines + notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a catalog id or a .gguf path (default smollm2-135m)")
    parser.add_argument("--llama-server", default=None, help="the llama-server binary (default: PATH, then "
                        f"{DEFAULT_LLAMA})")
    parser.add_argument("--llama-cpp-python", default=None, help="a python with llama-cpp-python[server] (default: "
                        f"{DEFAULT_LLAMA_PYTHON} if there)")
    parser.add_argument("--transformers", action="store_true", help="also run `transformers serve`")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests per stream")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--ready-timeout", type=float, default=180)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--speculation", action="store_true", help="run mashbox with speculation (its default)")
    parser.add_argument("--rounds", type=int, default=1, help="measure each server this many times, taking "
                        "turns, and report the medians (default 1)")
    args = parser.parse_args()

    pages = tempfile.TemporaryDirectory(prefix="mashbox-compare-")  # removed at exit
    servers = [mashbox_server(args.model, free_port(), args.threads, pages.name)]
    servers[0].command += [] if args.speculation else ["--no-speculation"]
    binary = args.llama_server or shutil.which("llama-server") or (str(DEFAULT_LLAMA) if DEFAULT_LLAMA.exists() else None)
    if binary:
        servers.append(llama_server(args.model, binary, free_port(), args.threads))
    else:
        print("no llama-server found: build it with bench/build_llama_server.sh", file=sys.stderr)
    python = args.llama_cpp_python or (str(DEFAULT_LLAMA_PYTHON) if DEFAULT_LLAMA_PYTHON.exists() else None)
    if python:
        servers.append(llama_cpp_python_server(args.model, python, free_port(), args.threads))
    else:
        print("no llama-cpp-python found: install it with bench/build_llama_cpp_python.sh", file=sys.stderr)
    if args.transformers:
        servers.append(transformers_server(free_port(), args.threads))
    for server in servers:
        print(f"{server.name}: a first start, untimed", flush=True)
        prime(server, args)
    for i in range(args.rounds):
        for server in servers if i % 2 == 0 else servers[::-1]:
            print(f"{server.name}: {' '.join(server.command)}" + (f" (round {i + 1})" if args.rounds > 1 else ""),
                  flush=True)
            server.figures = {}
            shutil.rmtree(pages.name)  # mashbox's prompt pages of a round before: this one starts cold too
            os.mkdir(pages.name)
            measure(server, args)
            server.rounds.append(server.figures)
    for server in servers:
        server.figures = median_figures(server.rounds)
    print()
    if args.rounds > 1 and len(servers) > 1:
        print("\n".join(round_ratios(servers, i) for i in range(args.rounds)))
        print(f"(the table: each figure's median over {args.rounds} rounds)")
    print(table(servers))
    print()
    print(roofline(servers, bytes_per_token(gguf_of(args.model)[1]), args.threads))
    if args.json:
        Path(args.json).write_text(json.dumps({s.name: {"figures": s.figures, "rounds": s.rounds, "note": s.note}
                                               for s in servers}, indent=2))


if __name__ == "__main__":
    main()
