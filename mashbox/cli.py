"""The ``mashbox`` command: serve a model, chat with it in the terminal, list models."""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from mashbox.chat import HELP
from mashbox.engine.config import MOST_CACHE_GIB
from mashbox.engine.load.catalog import catalog, check_named, looks_like_path
from mashbox.errors import ConfigError, MashboxError
from mashbox.server.settings import HANG_S

if TYPE_CHECKING:
    from mashbox.server.launch import Launch

DEFAULT_MODEL = "smollm2-135m"
COMMANDS = ("chat", "models", "run", "cluster")

EXIT_STATUS = """\
exit status:
  0  stopped by Ctrl-C or SIGTERM (while loading too)
  1  the model did not load (unknown id, missing path, corrupt file, the worker killed while loading)
  2  refused before loading: a bad flag value, a non-loopback --host without API keys,
     or an address that cannot be listened on (the port in use); or refused once the
     model is read, before any allocation: a --ctx past the model's training (without
     --allow-long-context) or a --ctx x --slots KV cache larger than the memory free"""


class Parser(argparse.ArgumentParser):
    """argparse's, but a bad flag or value is one line (exit 2) naming where the flags are told, not
    the usage block; and a flag is taken only whole (`--ho` is no `--host`: the cluster checks replicas'
    flags by name)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """Flags no command knows are told with the command's help, where its flags are."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            prog = f"{self.prog} {parsed.command}" if getattr(parsed, "command", None) else self.prog
            self.exit(2, f"{prog}: unrecognized arguments: {' '.join(extra)} (see {prog} --help)\n")
        return parsed


def _with_command(argv: list[str]) -> list[str]:
    """``argv`` with the default command, chat, where it names none: nothing, chat's flags (``mashbox
    --max-tokens 8``) or a model (a catalog id, a file or folder, or what reads as a path) first. Another word
    stays, to be refused as no command; a command after chat's flags is refused as out of place."""
    first = argv[0] if argv else "-"
    if first in COMMANDS or first in ("-h", "--help", "--version"):
        return argv
    if first.startswith("-") and (command := next((a for a in argv if a in COMMANDS), None)):
        build_parser().error(f"{command} comes first: `mashbox {command} ...` (the flags before it are chat's)")
    if first.startswith("-") or first in catalog() or looks_like_path(first) or os.path.exists(first):
        return ["chat", *argv]  # a missing path is chat's to say
    return argv


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mashbox", description="A local LLM engine for notebooks and agents.")
    parser.add_argument("--version", action="version", version=f"mashbox {version('mashbox')}")
    commands = parser.add_subparsers(dest="command", parser_class=Parser)
    chat = commands.add_parser("chat", help="chat with a model in the terminal (the default command: "
                               "`mashbox [MODEL] [flags]` is `mashbox chat ...`)",
                               description=textwrap.fill(f"Chat with a model in the terminal. In the chat: {HELP}. "
                                                         "Piped in, each line (or block) gets one answer.", 78))
    chat.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                      help="catalog id, HF model directory or .gguf file (default: %(default)s)")
    chat.add_argument("--ctx", type=int, default=None, help="context length per slot (default: the model's)")
    chat.add_argument("--slots", type=int, default=4, help="requests decoded together (default: %(default)s)")
    chat.add_argument("--allow-long-context", action="store_true",
                      help="let --ctx exceed the context the model was trained on (default: off)")
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("--max-tokens", type=int, default=512, help="most new tokens per answer (default: %(default)s)")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    commands.add_parser("models", help="list the models in the catalog")
    _add_run(commands)
    _add_cluster(commands)
    return parser


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run", help="serve a model over HTTP (OpenAI and Anthropic APIs)",
        description=textwrap.fill(
            "Serve one model over HTTP: OpenAI Chat Completions, Completions and Responses, and "
            "Anthropic Messages. The server answers /health with 503 while the model loads. "
            "API keys: --api-key-file and/or the MASHBOX_API_KEY environment variable; clients "
            "send one as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.", 78),
        epilog=EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                     help="catalog id (see `mashbox models`), HF model directory or .gguf file "
                          "(default: %(default)s)")
    run.add_argument("--host", default="127.0.0.1",
                     help="address to listen on; any non-loopback address requires API keys "
                          "(default: %(default)s)")
    run.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    run.add_argument("--ctx", type=int, default=None,
                     help="context length of each slot, in tokens (default: the catalog's for its ids; else "
                          "the context the model was trained on, up to 8192)")
    run.add_argument("--slots", type=int, default=16,
                     help="requests decoded together; each slot holds one whole context of KV cache "
                          "(default: %(default)s)")
    run.add_argument("--kv-dtype", choices=("f16", "q8_0"), default=None,
                     help="how the KV cache keeps keys and values: f16, or q8_0 (int8 with a scale for each 32, "
                          "about half the memory, as llama.cpp's -ctk/-ctv q8_0; CPU only) (default: f16 with "
                          "mashbox's CPU kernels, else float32 on CPU and the weights' dtype on CUDA: bfloat16)")
    run.add_argument("--verbatim-template", action="store_true",
                     help="render the model's chat template as written; by default tools that a template puts "
                          "after the system text come before it, so an agent's tools stay cached when its "
                          "system text (folder, date) changes (default: off)")
    run.add_argument("--free-calls", action="store_true",
                     help="in tool_choice auto, leave a tool call the model begins unconstrained; by default "
                          "the rest of it is held to the declared tools' names and parameter schemas, a call to a "
                          "tool the request lacks is written again, and a model looping on one call is told so "
                          "(default: off)")
    run.add_argument("--no-speculation", action="store_true",
                     help="turn off speculation: by default answers propose their next tokens from the prompt and "
                          "their own text (where their last tokens occurred before) and check them in one step: "
                          "the same tokens (greedy, or sampled with the same seed), faster where an answer copies "
                          "(an agent re-writing a file)")
    run.add_argument("--sampling", type=_sampling, default={}, metavar="NAME=VALUE,...", action=_Merged,
                     help="sampling for requests that leave these fields out, e.g. temperature=0.7,top_p=0.8 "
                          "(Qwen's advice for agents; fields: " + ", ".join(SAMPLING_FIELDS) + "); a request's own "
                          "values win; repeatable (default: none: greedy)")
    run.add_argument("--cache-ram", type=_mib, default=2048, metavar="MiB",
                     help="host memory for prompt prefixes saved from slots about to be reused, in MiB; "
                          "0 = off (default: %(default)s)")
    run.add_argument("--cache-disk", type=_gib, default=4.0, metavar="GiB",
                     help="disk for prompt prefixes kept across restarts (pages of 256 tokens, least recently "
                          "used out first), so an agent's long system prompt is prefilled once per machine; "
                          "0 = off (default: %(default)s)")
    run.add_argument("--cache-dir", default=None, metavar="PATH",
                     help="where those prefixes live (default: the mashbox cache's prefixes folder)")
    run.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="file of API keys, one per line, optionally followed by a tenant name; '#' starts "
                          "a comment. With keys, /v1 routes, /tasks, /metrics and /openapi.json need one "
                          "(default: none; MASHBOX_API_KEY adds one more key)")
    run.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                     help="a web page origin (e.g. http://localhost:3000; '*' for any) whose scripts may call the "
                          "API, with CORS; repeatable; MASHBOX_ALLOW_ORIGINS adds a comma-separated list "
                          "(default: none: pages of other origins are refused)")
    run.add_argument("--max-waiting", type=_count, default=256, metavar="N",
                     help="requests that may wait for a slot in all; one more is answered 429 (Anthropic: 529) "
                          "with Retry-After (default: %(default)s)")
    run.add_argument("--max-waiting-per-tenant", type=_count, default=32, metavar="N",
                     help="requests of one tenant (an API key's, see --api-key-file; without keys, everyone) that "
                          "may wait for a slot; one more is answered 429 with Retry-After (default: %(default)s)")
    run.add_argument("--ui", action="store_true",
                     help="serve the MASHBOX Chat page at / (default: off: / answers like /health)")
    run.add_argument("--tasks-db", default=None, metavar="PATH",
                     help="SQLite file of the agent tasks (/v1/tasks) (default: tasks.sqlite3 in the mashbox cache)")
    run.add_argument("--tasks-ttl", type=_hours, default=24.0, metavar="HOURS",
                     help="a task untouched this long expires, or is deleted once finished (default: %(default)s)")
    run.add_argument("--allow-long-context", action="store_true",
                     help="let --ctx exceed the context the model was trained on, where answers degrade "
                          "(default: off: such a --ctx is refused)")
    run.add_argument("--hang-timeout", type=_seconds, default=HANG_S, metavar="SECONDS",
                     help="a worker that says nothing this long while it has requests to answer (stopped, or "
                          "deadlocked; it reports after every step) is killed and started again, and requests whose "
                          "clients have received nothing are sent again; 0 = never (default: %(default)s)")
    run.add_argument("--in-process", action="store_true",
                     help="run the engine in the server process instead of a worker process that is "
                          "started again if it dies (default: off)")


def _add_cluster(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser(
        "cluster", help="serve several replicas of a model behind HAProxy",
        description=textwrap.fill(
            "Start REPLICAS `mashbox run` processes on 127.0.0.1 (ports FIRST_PORT, FIRST_PORT+1, ...) and "
            "Debian's haproxy in front of them on HOST:PORT: a request that names its session (x-session-id, "
            "Claude Code's, Codex's or Pi's session header, or prompt_cache_key) goes to the replica that "
            "holds its cached prefix, others to the least busy; a replica that dies is started again and "
            "takes requests once its /health is 200. Everything after -- goes to each `mashbox run`, e.g. "
            "`mashbox cluster --replicas 2 -- qwen2.5-coder-0.5b --slots 8`. See docs/scale-out.md.", 78))
    cluster.add_argument("--replicas", type=int, default=2, help="replicas to start (default: %(default)s)")
    cluster.add_argument("--host", default="127.0.0.1",
                         help="address HAProxy listens on: 127.0.0.1, ::1 or localhost (default: %(default)s)")
    cluster.add_argument("--port", type=int, default=8000, help="port HAProxy listens on (default: %(default)s)")
    cluster.add_argument("--first-port", type=int, default=None,
                         help="port of the first replica, the next ones after it (default: PORT + 1)")
    cluster.add_argument("--haproxy", default=None, metavar="PATH",
                         help="the haproxy executable (default: the one on PATH)")
    cluster.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- RUN_ARGS",
                         help="the model and flags of each `mashbox run` (default: the embedded model)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_with_command(list(sys.argv[1:] if argv is None else argv)))
    try:
        if args.command == "models":
            return list_models()
        if args.command == "run":
            return run(args)
        if args.command == "cluster":
            return cluster(args)
        return chat(args)
    except ConfigError as err:  # a setting refused before any allocation
        return _refused(err)
    except MashboxError as err:
        print(f"mashbox: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the server stops on Ctrl-C as it was asked to; a chat was cut short
        return 0 if args.command == "run" else 130
    except BrokenPipeError:  # the reader of the output went (`mashbox models | head -1`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nor at exit, when stdout is flushed)
        return 1
    except OSError as err:  # the output cannot be written (a full disk: `> /dev/full`)
        if err.filename is not None or args.command not in ("chat", "models"):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"mashbox: the output cannot be written: {err.strerror or err}", file=sys.stderr)
        return 1


def list_models() -> int:
    """The catalog: each model's default context, the size of its weights file, and whether it is
    installed (``/v1/models`` and ``engine.info`` give the loaded model's size in memory instead)."""
    from mashbox.engine.load.catalog import installed

    for entry in catalog().values():
        where = "installed" if installed(entry) else f"not installed: {entry.install}"
        print(f"{entry.id:22} ctx {entry.ctx:>6}  file {entry.gb:5.2f} GB  {where}\n{'':24}{entry.description}")
    return 0


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty")


class _Merged(argparse.Action):
    """A flag of NAME=VALUE pairs given again adds its pairs (it replaced them all); a name given twice is
    refused."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest) or {}
        if twice := sorted(before.keys() & values.keys()):
            parser.error(f"argument {option_string}: {', '.join(twice)} given twice")
        setattr(namespace, self.dest, {**before, **values})


def _sampling(text: str) -> dict[str, float]:
    from mashbox.engine.request import SamplingParams

    values: dict[str, float] = {}
    for part in filter(str.strip, text.split(",")):
        name, eq, value = (x.strip() for x in part.partition("="))
        if name not in SAMPLING_FIELDS or not eq:
            raise argparse.ArgumentTypeError(f"must be NAME=VALUE pairs of {', '.join(SAMPLING_FIELDS)} (got {text!r})")
        if name in values:
            raise argparse.ArgumentTypeError(f"{name} given twice (got {text!r})")
        try:
            values[name] = int(value) if name == "top_k" else float(value)
        except ValueError:
            kind = "a whole number" if name == "top_k" else "a number"
            raise argparse.ArgumentTypeError(f"{name}: must be {kind} (got {value!r})") from None
    try:
        SamplingParams(**values)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return values


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, 1 or more (got {text!r})")
    return int(text)


def _mib(text: str) -> int:
    if not text.isdigit() or int(text) > MOST_CACHE_GIB * 1024:
        raise argparse.ArgumentTypeError(f"must be a whole number of MiB, 0 to {MOST_CACHE_GIB * 1024} (got {text!r})")
    return int(text)


def _number(text: str) -> float:
    """``text`` as a number; NaN, which no range holds, where it is none."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _gib(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= MOST_CACHE_GIB:
        raise argparse.ArgumentTypeError(f"must be a number of GiB, 0 to {MOST_CACHE_GIB} (got {text!r})")
    return value


def _hours(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of hours, more than 0 (got {text!r})")
    return value


def _seconds(text: str) -> float:
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more (got {text!r})")
    return value


def _folder(name: str, path: Path) -> None:
    """Make ``path`` a folder this process can write in, or raise ValueError naming ``name``."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}: {path} cannot be a folder here (it is there, and is no folder)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{name}: {path} cannot be a folder here ({err.strerror or err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: {path} is a folder this user cannot write in")


def run(args: argparse.Namespace) -> int:
    from mashbox.server.launch import Stop, serve  # litestar and uvicorn load only in serve

    stop = Stop()  # Ctrl-C and SIGTERM stop it from here: exit 0, while loading too
    try:
        launch = _launch(args)
    except ValueError as err:
        return _refused(err)
    return serve(launch, stop)


def _refused(err: Exception) -> int:
    """Say a refused setting in one line, by its flag (``--cache-dir``, not the field ``cache_dir``); exit 2."""
    message = str(err)
    field, colon, rest = message.partition(": ")
    flag = "--" + field.replace("_", "-")
    if colon and field.isidentifier() and flag in _flags(build_parser()):
        message = f"{flag}: {rest}"
    print(f"mashbox: {message}", file=sys.stderr)
    return 2


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag of ``parser`` and of its commands."""
    found = {flag for action in parser._actions for flag in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found |= {flag for command in action.choices.values() for flag in _flags(command)}
    return found


def _launch(args: argparse.Namespace) -> Launch:
    """What ``mashbox run`` serves, every flag checked before the model loads; ValueError naming one refused."""
    from mashbox.server import task_store
    from mashbox.server.launch import Launch

    try:  # the default file too, before the model loads (a read-only home): not a 500 at every task
        task_store.check(task_store.path_of(args.tasks_db))
    except ValueError as err:
        if args.tasks_db:
            raise
        raise ValueError(f"{err}; choose its file with --tasks-db, or the cache with MASHBOX_CACHE") from None
    if args.cache_dir:
        _folder("cache_dir", Path(args.cache_dir))
    elif args.cache_disk:  # the default folder too, before the model loads (a read-only home)
        from mashbox.engine.load.catalog import cache_dir

        _folder("the disk prefix cache (choose its folder with --cache-dir or MASHBOX_CACHE, or none with "
                "--cache-disk 0)", cache_dir() / "prefixes")
    check_named(args.model)  # an unknown id or a missing path: exit 1 at once, before the server listens
    return Launch(args.model, _settings(args), _engine_options(args), args.in_process)


def cluster(args: argparse.Namespace) -> int:
    from mashbox.cluster import Cluster, check, find_haproxy, replica_args, replicas

    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    first = args.port + 1 if args.first_port is None else args.first_port
    try:
        check(args.host, args.port, first, args.replicas, run_args)
        members = replicas(args.replicas, first)
        haproxy = find_haproxy(args.haproxy)
        # a bad flag or value stops here (exit 2), not in each replica: the first one's checked as it would run
        _launch(build_parser().parse_args(["run", *replica_args(run_args, members[0])]))
    except ValueError as err:
        return _refused(err)
    return Cluster(members, args.host.strip("[]"), args.port, run_args, haproxy).run()


def _settings(args: argparse.Namespace):
    from mashbox.server.security import load_keys
    from mashbox.server.settings import Settings

    keys = load_keys(args.api_key_file, os.environ.get("MASHBOX_API_KEY"))
    origins = [*args.allow_origin, *os.environ.get("MASHBOX_ALLOW_ORIGINS", "").split(",")]
    return Settings(host=args.host, port=args.port, api_keys=keys, key_file=args.api_key_file, ui=args.ui,
                    allow_origins=tuple(o.strip().rstrip("/") for o in origins if o.strip()),
                    cache_ram_mib=args.cache_ram, max_waiting=args.max_waiting,
                    max_waiting_per_tenant=args.max_waiting_per_tenant, tasks_db=args.tasks_db, tasks_ttl_s=args.tasks_ttl * 3600,
                    sampling=args.sampling, hang_s=args.hang_timeout)


def _engine_options(args: argparse.Namespace) -> dict:
    from mashbox.engine.config import EngineConfig

    options = {"ctx": args.ctx, "slots": args.slots, "cache_ram_mib": args.cache_ram,
               "cache_disk_gib": args.cache_disk, "cache_dir": args.cache_dir,
               "allow_long_context": args.allow_long_context, "kv_dtype": args.kv_dtype,
               "verbatim_template": args.verbatim_template, "constrain_calls": not args.free_calls,
               "speculation": not args.no_speculation}
    EngineConfig(model=args.model, **options)  # bad values fail here, before loading
    return options


def chat(args: argparse.Namespace) -> int:
    from mashbox.chat import run
    from mashbox.engine.config import EngineConfig
    from mashbox.engine.request import SamplingParams
    from mashbox.facade import Engine  # torch loads only when needed

    if sys.stdin is None or sys.stdout is None:
        which = "reads its questions from stdin" if sys.stdin is None else "writes its answers to stdout"
        print(f"mashbox: chat {which}, and there is none (it is closed)", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    engine_options = {"ctx": args.ctx, "slots": args.slots, "allow_long_context": args.allow_long_context}
    try:  # bad values fail here, before loading, as run's do
        EngineConfig(model=args.model, **engine_options)
        SamplingParams(**options)
    except ValueError as err:
        return _refused(err)
    with Engine(args.model, **engine_options, quiet=not interactive) as engine:
        return run(engine, args.system, options, interactive)
