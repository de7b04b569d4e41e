"""``mashbox cluster``: several ``mashbox run`` replicas on one machine behind HAProxy.

mashbox balances nothing itself. ``haproxy_config`` writes the configuration (``deploy/haproxy.cfg``
is its output for three replicas), and ``Cluster`` starts the replicas and Debian's ``haproxy`` with
it, starts a replica (or HAProxy) again when it dies or, once ready, answers nothing for ``HUNG_S``
seconds (its process alive: stopped, or deadlocked), and stops them all on Ctrl-C, SIGTERM or SIGHUP
(and, on Linux, when it is killed: each replica gets SIGTERM as it dies, HAProxy a soft stop).

Each replica runs on an equal share of the machine's cores (its CPU affinity and
``OMP_NUM_THREADS``), so that their threads do not contend; where there are fewer cores than
replicas they share them all.

What the configuration does:

- A request that names its session goes to the replica that holds its prompt prefix: consistent
  hashing on the first of ``SESSION_HEADERS`` it carries (mashbox's, Claude Code's, Codex's, Pi's),
  else on the body's ``prompt_cache_key`` (OpenAI's), else its ``metadata.user_id`` (Claude Code's
  holds its session; both read where the body fits in HAProxy's 256 KiB buffer). Consistent, so that
  a replica leaving or coming back moves only its own sessions.
- A request without one goes to the replica with the fewest open connections. Requests to
  ``/v1/messages`` take backends of their own (the same servers and ring): HAProxy's own errors there
  are in Anthropic's shape.
- Health checks on ``/health`` every second: a replica is out once a check or a connection fails
  and until its ``/health`` answers 200 (it answers 503 while it loads); a request whose
  connection is refused is sent to another replica.
- The agent tasks API (``/v1/tasks``) goes to the first replica that is up: a task lives in the
  replica that runs it, each replica with a tasks file of its own (``tasks-r1.sqlite3``, ...).
- Answers pass as they are: a 429 or 529 with its Retry-After, a stream as it is written. Each
  answer says which replica wrote it in ``x-mashbox-replica``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mashbox.engine.load.catalog import cache_dir
from mashbox.server.errors import OVERLOADED, ApiError, answer
from mashbox.server.generation import SESSION_HEADERS  # as the server reads them; prompt_cache_key after them
from mashbox.server.security import LOOPBACK_NAMES
from mashbox.server.task_routes import paths as task_paths

BUFFER = 256 * 1024  # HAProxy's buffer, so that prompt_cache_key is found in bodies up to its size
RESTART_S = 2.0  # a replica that dies is started again, at most once in this many seconds
HUNG_S = 60.0  # a replica that was ready and has answered nothing for this long is started again
ASK_S = 5.0  # how often a ready replica is asked for /health, each answer awaited ASK_TIMEOUT_S
ASK_TIMEOUT_S = 2.0
TASKS = tuple(task_paths())  # /v1/tasks and its alias: both go to the replica the tasks live in
NOT_UP = "no replica is up: their models are loading, or starting again; retry shortly"
NO_ANSWER = {  # HAProxy's own errors, said as a mashbox server would
    503: NOT_UP,
    502: "the replica closed the connection with no answer (it stopped, or its process died); retry",
    504: "the replica did not answer in time; retry",
}
REFUSED = (1, 2)  # `mashbox run` exits with these when its model or its flags are refused: no restart
# (on a replica's first start, before it was ever ready: a reload the OOM killer stops exits 1 too, and is tried again)
PR_SET_PDEATHSIG = 1  # Linux: the signal a child gets when the cluster dies, killed (its SIGTERM is handled)
HARD_STOP_S = 30  # HAProxy stopping softly waits this long at most for the answers under way
MESSAGES = ("/v1/messages",)  # Anthropic's routes: HAProxy's own errors there in Anthropic's shape
HEALTH = ("/health", "/v1/health")
# LOOPBACK_NAMES as a Host header, as a replica reads one: any case, trailing dots, a port, empty or none
LOCAL_HOST = r"'^(localhost|127\.0\.0\.1|\[::1\])\.*(:[0-9]*)?$'"
BY_SESSION = ["    balance hash var(txn.session)",  # a session to the replica it hashes to, on every such backend
              "    hash-type consistent sdbm avalanche"]  # similar session ids spread (no avalanche: they bunch)


@dataclass(slots=True, frozen=True)
class Replica:
    name: str
    port: int


def replicas(count: int, first_port: int) -> list[Replica]:
    return [Replica(f"r{i + 1}", first_port + i) for i in range(count)]


def haproxy_config(host: str, port: int, members: Sequence[Replica]) -> str:
    """HAProxy's configuration for ``members`` on 127.0.0.1, listening on ``host:port``."""
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sessions = [f"    http-request set-var(txn.session) req.hdr({name}) if !{{ var(txn.session) -m len gt 0 }} "
                f"{{ req.hdr({name}) -m len gt 0 }}" for name in SESSION_HEADERS]  # an empty one names none
    # weight 100: 1600 points each on the hash ring (weight 1 gives 16, and a few sessions land unevenly)
    checked = [f"    server {r.name} 127.0.0.1:{r.port} check weight 100" for r in members]
    tracked = [f"    server {r.name} 127.0.0.1:{r.port} track sessions/{r.name} weight 100" for r in members]
    return "\n".join([
        "# HAProxy in front of mashbox replicas: written by mashbox.cluster.haproxy_config",
        "# (`mashbox cluster` writes and runs it; `haproxy -f haproxy.cfg` runs this one).",
        "global",
        "    maxconn 1024",
        f"    tune.bufsize {BUFFER}",
        "    noreuseport",  # a second cluster on the same port fails to bind, not shares it unseen
        f"    hard-stop-after {HARD_STOP_S}s",  # a soft stop (the cluster stopping, or killed) ends in time
        "",
        "defaults",
        "    mode http",
        "    timeout connect 5s",
        "    timeout client 1h",  # an agent's answer may take many minutes on a CPU
        "    timeout server 1h",
        "    timeout http-request 60s",
        "    timeout check 10s",  # a replica busy on two cores still answers /health within this
        "    retries 2",
        "    retry-on conn-failure empty-response 503",  # 503: a replica loading, which did nothing
        "    option redispatch 1",  # and the retry goes to another replica
        "    option abortonclose",
        "    default-server inter 1s fall 1 rise 1 observe layer4 error-limit 1 on-error mark-down",
        *_errors("/v1"),  # HAProxy's own 502-504 (no replica answered) as a mashbox server's, not its HTML
        "",
        "frontend mashbox",
        f"    bind {bind}",
        "    option http-buffer-request",
        *sessions,
        *(f"    http-request set-var(txn.session) req.body,json_query('{path}') "
          "if !{ var(txn.session) -m len gt 0 } { method POST }"
          for path in ("$.prompt_cache_key", "$.metadata.user_id")),  # Claude Code's session is in its user_id
        "    http-response set-header x-mashbox-replica %[srv_name]",
        # each replica's counters are its own: where they are is said to this machine's names only (as a replica
        # checks Host: a page another site rebinds to 127.0.0.1 is refused by the replica it reaches instead)
        f"    http-request return {_metrics(members)} if {{ path /metrics }} {{ req.hdr(host) -m reg -i {LOCAL_HOST} }}",
        f"    http-request return {_reply(HEALTH[0], more={'status': 'loading'})} if {{ nbsrv(replicas) eq 0 }} "
        f"{{ path {' '.join(HEALTH)} }}",  # a monitor reads the status, as a loading replica's
        *(f"    http-request return {_reply(paths[0])} if {{ nbsrv(replicas) eq 0 }} {{ path_beg {' '.join(paths)} }}"
          for paths in (MESSAGES, TASKS)),
        f"    http-request return {_reply('/v1')} if {{ nbsrv(replicas) eq 0 }}",
        f"    use_backend tasks if {{ path_beg {' '.join(TASKS)} }}",
        f"    use_backend messages_sessions if {{ path_beg {' '.join(MESSAGES)} }} {{ var(txn.session) -m len gt 0 }}",
        f"    use_backend messages if {{ path_beg {' '.join(MESSAGES)} }}",
        "    use_backend sessions if { var(txn.session) -m len gt 0 }",
        "    default_backend replicas",
        "",
        "backend sessions",
        *BY_SESSION,
        "    option httpchk GET /health",
        "    http-check expect status 200",
        *checked,
        "",
        "backend replicas",
        "    balance leastconn",
        *tracked,
        "",
        "backend messages_sessions",  # as sessions and replicas, with HAProxy's own errors in Anthropic's shape
        *BY_SESSION,
        *_errors(MESSAGES[0]),
        *tracked,
        "",
        "backend messages",
        "    balance leastconn",
        *_errors(MESSAGES[0]),
        *tracked,
        "",
        "backend tasks",  # a task lives in the replica that runs it: all on the first one up
        "    balance first",
        *_errors(TASKS[0]),  # the tasks API's shape where no replica answered
        *tracked,
        "",
    ])


def _errors(path: str) -> list[str]:
    """The ``http-error`` lines of a backend whose requests go to ``path``: HAProxy's own 502-504 in
    that route's shape. Anthropic's 529 is no status ``http-error`` takes: set after, on 503 (a replica
    says 529 itself there, never 503)."""
    lines = [f"    http-error {_reply(path, status, status=status)}" for status in NO_ANSWER]
    if answer(path, ApiError(503, NOT_UP))[0] != 503:
        lines.append(f"    http-after-response set-status {OVERLOADED} if {{ status 503 }}")
    return lines


def _metrics(members: Sequence[Replica]) -> str:
    """HAProxy's answer to ``/metrics`` on its port: where to scrape. Passed to the replicas in turn, each
    scrape read another one's counters (a reset to Prometheus every other scrape)."""
    where = ", ".join(f"127.0.0.1:{r.port}/metrics" for r in members)
    message = f"the metrics of a cluster are those of each replica: scrape {where} (docs/scale-out.md)"  # no quote
    return _returned(*answer("/metrics", ApiError(404, message, code="not_found")))


def _reply(path: str, error: int = 503, more: dict | None = None, status: int | None = None) -> str:
    """HAProxy's arguments for the answer a mashbox server at ``path`` gives with ``error`` (the
    protocol's error shape: for 503, as while it loads, Anthropic's 529 with x-should-retry;
    Retry-After; ``more`` fields beside the error, e.g. /health's status; ``status`` in place of the
    answer's), for the moments no replica answers: the balancer's own page would be HTML."""
    code, body, headers = answer(path, ApiError(error, NO_ANSWER[error], retry_after=1))
    return _returned(status or code, {**(more or {}), **body}, headers)


def _returned(status: int, body: dict, headers: dict[str, str]) -> str:
    """An answer as the arguments of HAProxy's ``http-request return`` and ``http-error``."""
    hdrs = "".join(f' hdr {name} "{value}"' for name, value in headers.items())
    return f"status {status} content-type application/json string '{json.dumps(body)}'{hdrs}"


@dataclass
class Cluster:
    """The replicas (``mashbox run RUN_ARGS --port P``) and HAProxy in front of them."""

    members: list[Replica]
    host: str
    port: int
    run_args: list[str]
    haproxy: str = "haproxy"
    _replicas: dict[str, subprocess.Popen] = field(default_factory=dict)
    _started: dict[str, float] = field(default_factory=dict)
    _starts: dict[str, int] = field(default_factory=dict)
    _served: set[str] = field(default_factory=set)  # the replicas that were ready once: none is refused since
    _heard: dict[str, float] = field(default_factory=dict)  # when each last answered /health (any status)
    _asked: dict[str, float] = field(default_factory=dict)
    hung_s: float = HUNG_S
    _balancer: subprocess.Popen | None = None
    _balanced: float = 0.0  # when HAProxy was started

    def run(self) -> int:
        """Serve until Ctrl-C, SIGTERM or SIGHUP (0); 1 when HAProxy cannot start; a replica's status (1 or 2) when
        its model or a setting is refused."""
        # a closed terminal (SIGHUP) stops it as Ctrl-C does
        previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
        with tempfile.TemporaryDirectory(prefix="mashbox-cluster-") as folder:
            config = Path(folder) / "haproxy.cfg"
            config.write_text(haproxy_config(self.host, self.port, self.members))
            try:
                for member in self.members:
                    self._start(member)
                balancer = self._balance(config)
                host = f"[{self.host}]" if ":" in self.host else self.host
                _say(f"on http://{host}:{self.port}: HAProxy (pid {balancer.pid}) in front of "
                     + ", ".join(f"{r.name} on 127.0.0.1:{r.port}" for r in self.members))
                return self._watch(config, balancer)
            except KeyboardInterrupt:
                return 0
            finally:
                interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C (or SIGTERM) cut the
                for sig in previous:  # stop short, and HAProxy with it: the stop (bounded) goes on
                    signal.signal(sig, signal.SIG_IGN)
                self._stop()
                for sig, handler in [*previous.items(), (signal.SIGINT, interrupt)]:
                    signal.signal(sig, handler)

    def _balance(self, config: Path) -> subprocess.Popen:
        # a session of its own, as the replicas': a terminal's Ctrl-C reaches the cluster only, which stops
        # HAProxy softly (it stopped at once, cutting every stream); killed, the cluster stops it softly too
        self._balancer = subprocess.Popen([self.haproxy, "-db", "-f", str(config)], start_new_session=True,
                                          preexec_fn=_child(death=signal.SIGUSR1))
        self._balanced = time.monotonic()
        return self._balancer

    def _start(self, member: Replica) -> None:
        argv = [sys.executable, "-m", "mashbox", "run", *replica_args(self.run_args, member)]
        cores = share(self.members.index(member), len(self.members))
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))} if cores else None
        process = subprocess.Popen(argv, env=env, start_new_session=True,  # Ctrl-C reaches the cluster: it stops them
                                   preexec_fn=_child(cores))
        self._replicas[member.name], self._started[member.name] = process, time.monotonic()
        self._heard[member.name] = time.monotonic()  # a replica starting answers nothing for a second or two
        self._starts[member.name] = self._starts.get(member.name, 0) + 1
        where = f", cores {_ranges(cores)}" if cores else ""
        _say(f"replica {member.name} (pid {process.pid}) on 127.0.0.1:{member.port}{where}")

    def _watch(self, config: Path, balancer: subprocess.Popen) -> int:
        while True:
            if (code := balancer.poll()) is not None:
                if code > 0 and time.monotonic() - self._balanced < RESTART_S:  # it could not start (its port taken)
                    _say(f"HAProxy stopped ({_status(code)}); stopping the replicas")
                    return 1
                _say(f"HAProxy stopped ({_status(code)}); starting it again")
                balancer = self._balance(config)
            for member in self.members:
                code = self._replicas[member.name].poll()
                if code is None and member.name in self._served and self._hung(member):
                    _say(f"replica {member.name} answered nothing for {self.hung_s:.0f} s; starting it again")
                    _end(self._replicas[member.name])
                    self._start(member)
                    continue
                if code is None:
                    if member.name not in self._served and _health(member.port, 0.5) == 200:
                        self._served.add(member.name)
                    continue
                if code in REFUSED and self._starts[member.name] == 1 and member.name not in self._served:
                    _say(f"replica {member.name} exited with status {code}; stopping the cluster")
                    return code
                if time.monotonic() - self._started[member.name] >= RESTART_S:
                    _say(f"replica {member.name} stopped ({_status(code)}); starting it again")
                    self._start(member)
            time.sleep(0.5)

    def _hung(self, member: Replica) -> bool:
        """Whether ``member`` (ready once, its process alive) has answered no /health for ``hung_s``: asked
        every ``ASK_S``; a loading one's 503 is an answer."""
        now = time.monotonic()
        if now - self._asked.get(member.name, 0.0) < ASK_S:
            return False
        self._asked[member.name] = now
        if _health(member.port, ASK_TIMEOUT_S) is not None:
            self._heard[member.name] = time.monotonic()
            return False
        return now - self._heard.get(member.name, now) >= self.hung_s

    def _stop(self) -> None:
        """The replicas end their answers (SIGTERM: in flight ones end within seconds, with their
        error event at worst) while HAProxy stops listening and passes them on (SIGUSR1: soft stop)."""
        balancer = self._balancer
        for process in self._replicas.values():
            if process.poll() is None:
                process.terminate()
        if balancer is not None and balancer.poll() is None:
            balancer.send_signal(signal.SIGUSR1)
        for process in [*self._replicas.values(), balancer]:
            if process is None:
                continue
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def _child(cores: Sequence[int] = (), death: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """What a replica or HAProxy does before it runs: its cores, and (Linux) ``death`` when the cluster
    dies unable to stop it (killed): neither is left serving, nor holding its port."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None

    def setup() -> None:
        if cores:
            os.sched_setaffinity(0, cores)
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, death)

    return setup


def _end(process: subprocess.Popen) -> None:
    """A hung replica ended: SIGTERM, then (a stopped or deadlocked one takes no SIGTERM) SIGKILL to its
    session, its worker with it."""
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(process.pid) == process.pid:  # its own session, as _start makes it
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
        process.wait()


def _health(port: int, timeout: float) -> int | None:
    """The status the replica on ``port`` answers /health with within ``timeout`` (200: its model loaded,
    503: loading); None for no answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", "/health")
        answer = connection.getresponse()
        answer.read()
        return answer.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def share(index: int, count: int) -> list[int]:
    """The cores replica ``index`` of ``count`` runs on: an equal part of this process's (the first
    replicas one more where they do not divide evenly), so that the replicas' threads do not contend;
    [] (no pinning) where there are fewer cores than replicas."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    cores = sorted(os.sched_getaffinity(0))
    each, more = divmod(len(cores), count)
    start = index * each + min(index, more)
    return cores[start:start + each + (index < more)] if each else []


def _ranges(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 and cores[-1] - cores[0] == len(cores) - 1 else \
        ",".join(map(str, cores))


def check(host: str, port: int, first: int, count: int, run_args: Sequence[str]) -> None:
    """ValueError naming the setting of a cluster that cannot run."""
    if host.strip("[]") not in LOOPBACK_NAMES:
        raise ValueError(f"host: {host} is not one of {', '.join(sorted(LOOPBACK_NAMES))}; the replicas check the "
                         "Host of each request against the names they answer to, so a cluster listens on those "
                         "only (docs/scale-out.md: serving other machines)")
    if not 1 <= count <= 64:
        raise ValueError(f"replicas: must be between 1 and 64 (got {count})")
    if not (0 < port < 65536 and 0 < first and first + count <= 65536):
        raise ValueError(f"port: {port} and replica ports from {first} must lie in 1..65535")
    if port in range(first, first + count):
        raise ValueError(f"first_port: the replicas' ports {first}..{first + count - 1} include HAProxy's {port}")
    taken = {"--port", "--host", "--tasks-db"} & {arg.partition("=")[0] for arg in run_args}
    if taken:
        raise ValueError(f"run_args: {', '.join(sorted(taken))} is set by the cluster, not per replica")
    if _in_use(host, port):  # else HAProxy fails seconds later, after every replica has started
        raise ValueError(f"port: {port} is in use on {host} (stop what listens there, or pick another --port)")
    for member in replicas(count, first):  # else that replica's own refusal names its --port, which is not to set
        if _in_use("127.0.0.1", member.port):
            raise ValueError(f"first_port: replica {member.name}'s port {member.port} is in use (stop what listens "
                             "there, or give the replicas other ports with --first-port)")


def _in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host``:``port`` (a bind as the servers make it fails: with SO_REUSEADDR,
    so a closed connection's TIME_WAIT is no use)."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def replica_args(run_args: list[str], member: Replica) -> list[str]:
    """A replica's ``mashbox run`` arguments: the cluster's, its port and its own tasks file."""
    return [*run_args, "--port", str(member.port), "--tasks-db", str(cache_dir() / f"tasks-{member.name}.sqlite3")]


def find_haproxy(path: str | None) -> str:
    """The haproxy executable: ``path``, else the one on PATH; ValueError naming how to get it."""
    found = shutil.which(path or "haproxy")
    if found is None:
        raise ValueError(f"haproxy: {path or 'haproxy'} is not an executable; install Debian's haproxy "
                         "(`sudo apt-get install haproxy`) or pass --haproxy PATH")
    return found


def _status(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def _say(text: str) -> None:
    print(f"mashbox cluster: {text}", file=sys.stderr, flush=True)

