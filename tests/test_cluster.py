"""``mashbox cluster``: two real replicas of the embedded model behind Debian's HAProxy, on loopback.

Sessions stay on the replica that holds their prefix (the cache hits of one server), requests
without one spread, a full queue's 429/529 reaches the client with its Retry-After, and a replica
killed under load ends its streams, its requests go to the other one, and it takes requests again
only once its /health is 200. HAProxy comes from Debian (`make test` installs it as root)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from mashbox.cluster import haproxy_config, replicas, share
from tests.test_cli_run import free_port, gone

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
STORY = [{"role": "user", "content": "Write a very long story about a lighthouse keeper and her cat."}]


def haproxy() -> str:
    found = shutil.which("haproxy") or shutil.which("/usr/sbin/haproxy")
    if found:
        return found
    reason = "the cluster tests need Debian's haproxy: `make test` installs it as root"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


class Running:
    """A `mashbox cluster` process, its log, and clients of it and of each replica."""

    def __init__(self, tmp: Path) -> None:
        self.port, first = free_port(), free_port()
        while first + 1 == self.port or not _free(first + 1):
            first = free_port()
        self.replica_ports = {"r1": first, "r2": first + 1}
        self.log = tmp / "cluster.log"
        argv = [sys.executable, "-m", "mashbox", "cluster", "--replicas", "2", "--port", str(self.port),
                "--first-port", str(first), "--haproxy", haproxy(), "--", "smollm2-135m", "--ctx", "2048",
                "--slots", "2", "--cache-disk", "0", "--max-waiting", "2"]
        env = {**os.environ, "MASHBOX_CACHE": str(tmp / "cache")}
        with self.log.open("w") as log:  # a process group of its own, as a terminal's job: Ctrl-C reaches it all
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def text(self) -> str:
        return self.log.read_text()

    def pid(self, name: str) -> int:
        return int(re.findall(rf"replica {name} \(pid (\d+)\)", self.text())[-1])

    def healthy(self, name: str) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.replica_ports[name]}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def replica_of(self, session: str) -> str:
        return self.chat(session, "Say hi.", 2).headers["x-mashbox-replica"]

    def chat(self, session: str | None, text: str, max_tokens: int = 8) -> httpx.Response:
        headers = {"x-session-id": session} if session else {}
        answer = httpx.post(f"{self.url}/v1/chat/completions", headers=headers, timeout=120, json={
            "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
        assert answer.status_code == 200, answer.text
        return answer

    def session_on(self, name: str) -> str:
        return next(s for s in (f"session-{i}" for i in range(64)) if self.replica_of(s) == name)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(condition, timeout: float = 120, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def both_in_rotation(cluster: Running) -> bool:
    """Whether HAProxy sends sessions to both replicas (its checks see them up)."""
    seen = set()
    for i in range(16):
        answer = httpx.get(f"{cluster.url}/v1/models", headers={"x-session-id": f"probe-{i}"}, timeout=30)
        seen.add(answer.headers.get("x-mashbox-replica") if answer.status_code == 200 else None)
    return seen == {"r1", "r2"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    running = Running(tmp_path_factory.mktemp("cluster"))
    try:
        wait_until(lambda: running.process.poll() is None and running.healthy("r1") and running.healthy("r2"))
        wait_until(lambda: both_in_rotation(running), timeout=30, every=0.5)
        yield running
    finally:
        running.stop()
    assert running.process.returncode == 0, running.text()
    assert "Traceback" not in running.text()


def test_deploy_config_is_the_generators_and_haproxy_accepts_it():
    written = (ROOT / "deploy" / "haproxy.cfg").read_text()
    assert written == haproxy_config("127.0.0.1", 8000, replicas(3, 8001))
    check = subprocess.run([haproxy(), "-c", "-f", str(ROOT / "deploy" / "haproxy.cfg")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_with_no_replica_up_the_balancer_answers_as_a_loading_server_would(tmp_path):
    """Before any replica is up (or once none is), HAProxy's own answers are a mashbox server's while it
    loads, in the route's shape with Retry-After, not its HTML page: the SDKs and agents retry them."""
    port, first = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config("127.0.0.1", port, replicas(2, first)))  # nothing listens there
    balancer = subprocess.Popen([haproxy(), "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url), timeout=10, every=0.1)
        for path, status, shape in [("/v1/chat/completions", 503, "error"), ("/v1/messages", 529, "type"),
                                    ("/v1/tasks", 503, "jsonrpc"), ("/tasks", 503, "jsonrpc"), ("/health", 503, "error")]:
            answer = httpx.post(url + path, json={}, timeout=10)
            assert answer.status_code == status and answer.headers["content-type"] == "application/json", answer.text
            assert answer.headers["retry-after"] == "1" and shape in answer.json()
        assert httpx.post(url + "/v1/messages", json={}).headers["x-should-retry"] == "true"
        assert httpx.get(url + "/health").json()["status"] == "loading"  # as a replica's, for a monitor
        scraped = httpx.get(url + "/metrics")  # one replica's counters, then another's: scrape each
        assert scraped.status_code == 404 and f"127.0.0.1:{first + 1}/metrics" in scraped.json()["error"]["message"]
        for host in ("localhost", f"[::1]:{port}", f"LOCALHOST:{port}", "localhost.", "localhost:", f"127.0.0.1.:{port}"):
            assert httpx.get(url + "/metrics", headers={"host": host}).status_code == 404
        for host in ("rebound.example", f"rebound.example:{port}", "127.0.0.1.evil.example", "127x0x0x1"):
            rebound = httpx.get(url + "/metrics", headers={"host": host})  # a page rebound to 127.0.0.1
            assert rebound.status_code == 503 and str(first) not in rebound.text, rebound.text
    finally:
        balancer.terminate()
        balancer.wait(timeout=10)


def _closer(port: int, stop: threading.Event) -> None:
    """A replica that is up (/health 200) and closes every other connection with no answer: a process
    that died mid-request."""
    import socket

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(16)
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                connection, _ = server.accept()
                with connection:
                    if connection.recv(65536).startswith(b"GET /health"):
                        connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")


def test_a_replica_that_answers_nothing_gets_the_routes_error_shape_not_haproxys_page(tmp_path):
    """HAProxy's own 502 (every replica tried closed the connection with no answer) was its HTML page,
    and its 503 on /v1/messages OpenAI's shape: each in the route's shape, as a mashbox server's."""
    port, first = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config("127.0.0.1", port, replicas(1, first)))
    stop = threading.Event()
    closer = threading.Thread(target=_closer, args=(first, stop), daemon=True)
    closer.start()
    balancer = subprocess.Popen([haproxy(), "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url, 200), timeout=10, every=0.2)  # its check saw the replica up
        for path, headers, shape in [("/v1/chat/completions", {}, "error"), ("/v1/messages", {}, "type"),
                                     ("/v1/messages", {"x-session-id": "s"}, "type"), ("/v1/tasks", {}, "jsonrpc")]:
            answer = httpx.post(url + path, json={}, headers=headers, timeout=10)
            assert answer.status_code == 502 and answer.headers["content-type"] == "application/json", answer.text
            assert shape in answer.json() and "closed the connection" in answer.text
    finally:
        stop.set()
        balancer.terminate()
        balancer.wait(timeout=10)
        closer.join(timeout=5)


def test_a_second_balancer_on_a_taken_port_fails_to_bind_rather_than_share_it(tmp_path):
    """HAProxy binds with SO_REUSEPORT unless told not to: a second cluster on the port of one already
    running started, and the two took turns answering its clients."""
    port, first = free_port(), free_port()
    balancers = []
    try:
        for n in range(2):
            config = tmp_path / f"haproxy-{n}.cfg"
            config.write_text(haproxy_config("127.0.0.1", port, replicas(1, first)))
            balancers.append(subprocess.Popen([haproxy(), "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, text=True))
            if n == 0:
                wait_until(lambda: _answers(f"http://127.0.0.1:{port}"), timeout=10, every=0.1)
        assert balancers[1].wait(timeout=10) != 0 and "cannot bind" in balancers[1].stderr.read()
    finally:
        for balancer in balancers:
            balancer.kill()
            balancer.wait(timeout=10)


def _answers(url: str, status: int | None = None) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == (status or 200) or status is None
    except httpx.TransportError:
        return False


@pytest.mark.parametrize(("cores", "count"), [(8, 3), (8, 5), (16, 3), (4, 4), (2, 3)])
def test_the_replicas_share_every_core(monkeypatch, cores, count):
    """The cores left over by an uneven split sat idle (5 replicas on 8 cores: 3 unused)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    parts = [share(i, count) for i in range(count)]
    if cores < count:
        assert parts == [[]] * count  # fewer cores than replicas: no pinning, they share them all
        return
    assert sorted(sum(parts, [])) == list(range(cores))  # each core once
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_each_replica_runs_on_cores_of_its_own(cluster):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the replicas share it")
    cores = [os.sched_getaffinity(cluster.pid(name)) for name in ("r1", "r2")]
    assert cores == [set(share(0, 2)), set(share(1, 2))] and not cores[0] & cores[1]


def _turns(client_call, session_kwargs: dict, nonce: str) -> list[tuple[str, int]]:
    """Three turns of one conversation: (replica, cached prompt tokens) of each."""
    history = [{"role": "user", "content": f"[{nonce}] " + "Tell me about the sea. " * 60}]
    out = []
    for turn in range(3):
        replica, cached, text = client_call(history, session_kwargs)
        out.append((replica, cached))
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And turn {turn + 2}?"}]
    return out


def _openai_chat(url: str):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    def call(history, kwargs):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=history, max_tokens=8, **kwargs)
        answer = raw.parse()
        return (raw.headers.get("x-mashbox-replica", "direct"), answer.usage.prompt_tokens_details.cached_tokens,
                answer.choices[0].message.content)
    return call


def _openai_responses(url: str):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    def call(history, kwargs):
        raw = client.responses.with_raw_response.create(model=MODEL, input=history, max_output_tokens=16, **kwargs)
        answer = raw.parse()
        return (raw.headers.get("x-mashbox-replica", "direct"), answer.usage.input_tokens_details.cached_tokens,
                answer.output_text)
    return call


def _anthropic(url: str):
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)

    def call(history, kwargs):
        raw = client.messages.with_raw_response.create(model=MODEL, messages=history, max_tokens=8, **kwargs)
        answer = raw.parse()
        text = "".join(block.text for block in answer.content if block.type == "text") or "ok"
        return raw.headers.get("x-mashbox-replica", "direct"), answer.usage.cache_read_input_tokens, text
    return call


CARRIERS = {  # how each client names its session: mashbox's header, Claude Code's, Codex's, Pi's, OpenAI's body,
    # Claude Code's body (its user_id, a JSON object with the session's id, where a proxy dropped the header)
    "x-session-id": (_openai_chat, lambda s: {"extra_headers": {"X-Session-Id": s}}),
    "claude-code": (_anthropic, lambda s: {"extra_headers": {"X-Claude-Code-Session-Id": s}}),
    "codex": (_openai_responses, lambda s: {"extra_headers": {"session-id": s}}),
    "pi": (_openai_responses, lambda s: {"extra_headers": {"session_id": s}}),
    "prompt_cache_key": (_openai_responses, lambda s: {"prompt_cache_key": s}),
    "metadata.user_id": (_anthropic, lambda s: {"metadata": {"user_id": json.dumps({"session_id": s})}}),
}


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_session_stays_on_one_replica_with_the_cache_hits_of_one_server(cluster, carrier):
    """Each conversation again, straight to the other replica (which never saw it, if the session
    stayed put): the same cache hits turn by turn."""
    client, kwargs = CARRIERS[carrier]
    for i in range(3):
        nonce = uuid.uuid4().hex  # a conversation no server has seen
        through = _turns(client(cluster.url), kwargs(f"{carrier}-{i}"), nonce)
        replica = through[0][0]
        assert replica in ("r1", "r2") and {r for r, _ in through} == {replica}, through  # every turn on one
        other = cluster.replica_ports["r2" if replica == "r1" else "r1"]
        direct = _turns(client(f"http://127.0.0.1:{other}"), {}, nonce)
        assert [cached for _, cached in through] == [cached for _, cached in direct], (through, direct)
        assert direct[0][1] == 0 < direct[1][1] <= direct[2][1]  # cold, then the later turns hit the cache


def test_sessions_and_requests_without_one_spread_over_the_replicas(cluster):
    assert {cluster.replica_of(f"user-{i}") for i in range(16)} == {"r1", "r2"}
    with ThreadPoolExecutor(4) as pool:  # least connections: concurrent requests go to both
        answers = list(pool.map(lambda _: cluster.chat(None, "Count to fifty.", 64), range(4)))
    assert {a.headers["x-mashbox-replica"] for a in answers} == {"r1", "r2"}


def _stream(cluster: Running, session: str, started: threading.Event | None = None) -> str:
    """Stream a long story with ``session``; how it ended: finished, error event, or cut."""
    try:
        stream = cluster.openai.chat.completions.create(model=MODEL, messages=STORY, max_tokens=1800, stream=True,
                                                        extra_headers={"X-Session-Id": session})
        for _ in stream:
            if started is not None:
                started.set()
        return "finished"
    except openai.APIError as err:
        return f"error event: {err}" if not isinstance(err, openai.APIConnectionError) else "cut"
    except httpx.HTTPError:
        return "cut"


def _health(cluster: Running, name: str) -> dict:
    health = httpx.get(f"http://127.0.0.1:{cluster.replica_ports[name]}/health", timeout=5).json()
    return health


def test_an_empty_session_names_none_and_spreads(cluster):
    """An empty session header (or prompt_cache_key) was hashed as a session: all such requests on one
    replica, where the servers themselves take it for none."""
    seen = {cluster.chat("", "Say hi.", 1).headers["x-mashbox-replica"] for _ in range(8)}
    assert seen == {"r1", "r2"}


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL])
def test_a_cluster_hung_up_or_killed_leaves_nothing_serving(tmp_path, sig):
    """SIGHUP (its terminal closed) killed the cluster at once, and so does SIGKILL: HAProxy and every
    replica, in sessions of their own, went on serving its port, orphans."""
    port, first = free_port(), free_port()
    log = tmp_path / "cluster.log"
    argv = [sys.executable, "-m", "mashbox", "cluster", "--replicas", "1", "--port", str(port), "--first-port",
            str(first), "--haproxy", haproxy(), "--", MODEL, "--ctx", "256", "--slots", "1", "--cache-disk", "0"]
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                   env={**os.environ, "MASHBOX_CACHE": str(tmp_path / "cache")})
    try:
        wait_until(lambda: "HAProxy (pid" in log.read_text() and _answers(f"http://127.0.0.1:{first}"))
        pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", log.read_text())]
        process.send_signal(sig)
        process.wait(timeout=60)
        assert len(pids) == 2 and all(gone(pid, timeout=60) for pid in pids), log.read_text()
    finally:
        process.kill()
        process.wait()
        for pid in re.findall(r"\(pid (\d+)\)", log.read_text()):  # none left, whatever the test found
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_a_replica_that_fails_to_load_again_after_a_crash_is_started_again(tmp_path, monkeypatch):
    """Exit status 1 (its model did not load) stopped the whole cluster at any time: also where the OOM
    killer stopped the reload of a replica that had crashed, the healthy replicas with it (on its first
    start too: a replica whose worker crashed and failed its reloads exits 1). A refusal is told by a
    replica's first start, before it was ever ready; after that it is started again."""
    from mashbox.cluster import Cluster

    cluster = Cluster(replicas(1, free_port()), "127.0.0.1", free_port(), [])
    balancer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    restarted = []

    def start(member):
        restarted.append(member.name)
        raise KeyboardInterrupt  # out of the watch

    monkeypatch.setattr(cluster, "_start", start)
    try:
        for starts, served, stopped in ((1, False, True), (2, False, False), (1, True, False)):
            restarted.clear()
            cluster._replicas["r1"] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
            cluster._replicas["r1"].wait()
            cluster._starts["r1"], cluster._started["r1"] = starts, 0.0
            cluster._served = {"r1"} if served else set()
            if stopped:
                assert cluster._watch(tmp_path / "haproxy.cfg", balancer) == 1 and not restarted
            else:
                with pytest.raises(KeyboardInterrupt):
                    cluster._watch(tmp_path / "haproxy.cfg", balancer)
                assert restarted == ["r1"]
    finally:
        balancer.kill()
        balancer.wait()


SILENT = """
import signal, socket, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a stopped or deadlocked process: only SIGKILL ends it
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
held = []
while True:
    held.append(server.accept())  # the connection is taken, and nothing is ever answered
"""
LOADING = """
import http.server, sys
class Loading(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Loading).serve_forever()
"""


@pytest.mark.parametrize("script,hung", [(SILENT, True), (LOADING, False)])
def test_a_ready_replica_that_answers_nothing_is_ended_and_started_again(tmp_path, monkeypatch, script, hung):
    """A replica whose process lived on but answered nothing (stopped, deadlocked) was out of HAProxy's
    rotation for good, never started again. One that was ready and has answered no /health for
    ``hung_s`` is killed (SIGKILL where SIGTERM does nothing) and started again; one that answers, if only
    503 while its worker loads again, is left as it is."""
    from mashbox import cluster as module
    from mashbox.cluster import Cluster

    port = free_port()
    cluster = Cluster(replicas(1, port), "127.0.0.1", free_port(), [], hung_s=1.0)
    replica = subprocess.Popen([sys.executable, "-c", script, str(port)], start_new_session=True)
    balancer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cluster._replicas["r1"], cluster._served = replica, {"r1"}
    cluster._starts["r1"], cluster._started["r1"], cluster._heard["r1"] = 1, time.monotonic(), time.monotonic()
    restarted, rounds, wait = [], [], time.sleep

    def start(member):
        restarted.append(member.name)
        raise KeyboardInterrupt  # out of the watch

    def sleep(seconds):
        rounds.extend([seconds] if seconds >= 0.5 else [])  # the watch's, not subprocess's own waits
        if len(rounds) > 12:  # 6 s of watching
            raise KeyboardInterrupt
        wait(seconds)

    try:
        wait(1.0)  # listening
        monkeypatch.setattr(cluster, "_start", start)
        monkeypatch.setattr(module, "ASK_S", 0.5)
        monkeypatch.setattr(module.time, "sleep", sleep)
        with pytest.raises(KeyboardInterrupt):
            cluster._watch(tmp_path / "haproxy.cfg", balancer)
        assert restarted == (["r1"] if hung else [])
        assert (replica.poll() is not None) == hung, "a hung replica is ended before its new start"
    finally:
        for process in (replica, balancer):
            process.kill()
            process.wait()


def test_haproxy_that_dies_is_started_again_and_one_that_cannot_start_stops_the_cluster(tmp_path, monkeypatch):
    """HAProxy killed (the OOM killer, an operator) stopped the whole cluster, healthy replicas and all;
    one that exits with an error right after its start (its port taken) still does, not one killed then."""
    from mashbox.cluster import Cluster

    cluster = Cluster(replicas(1, free_port()), "127.0.0.1", free_port(), [])
    cluster._replicas["r1"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cluster._starts["r1"], cluster._started["r1"] = 1, time.monotonic()
    started = []

    def balance(config):
        started.append(config)
        raise KeyboardInterrupt  # out of the watch

    monkeypatch.setattr(cluster, "_balance", balance)
    try:
        dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])  # as HAProxy on a taken port
        dead.wait()
        cluster._balanced = time.monotonic()  # just started: it could not
        assert cluster._watch(tmp_path / "haproxy.cfg", dead) == 1 and not started
        cluster._balanced = time.monotonic() - 60  # it ran a minute, then died
        with pytest.raises(KeyboardInterrupt):
            cluster._watch(tmp_path / "haproxy.cfg", dead)
        assert started == [tmp_path / "haproxy.cfg"]
        killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        killed.kill()
        killed.wait()
        cluster._balanced = time.monotonic()  # killed again right after its restart: no failure to start
        with pytest.raises(KeyboardInterrupt):
            cluster._watch(tmp_path / "haproxy.cfg", killed)
        assert len(started) == 2
    finally:
        cluster._replicas["r1"].kill()
        cluster._replicas["r1"].wait()


@pytest.mark.parametrize("path", ["/v1/tasks", "/tasks"])
def test_a_task_is_found_on_its_replica_under_either_path(cluster, path):
    """The tasks API lives in one replica (its own tasks file): every call, under /v1/tasks or its /tasks
    alias, goes there (the alias went to any replica: the task was there one call in two)."""
    made = httpx.post(f"{cluster.url}{path}", timeout=60, json={
        "stream": False, "user_message_content": "Hi.", "inference_args": {"max_tokens": 2}}).json()["result"]
    for _ in range(6):
        found = httpx.get(f"{cluster.url}{path}/{made['id']}", timeout=30)
        assert found.status_code == 200 and found.json()["result"]["id"] == made["id"], found.text


def test_a_full_queue_answers_429_and_529_through_the_balancer_with_retry_after(cluster):
    session, other = cluster.session_on("r1"), cluster.session_on("r2")
    with ThreadPoolExecutor(4) as pool:
        running = [threading.Event(), threading.Event()]
        streams = [pool.submit(_stream, cluster, session, event) for event in running]
        wait_until(lambda: all(event.is_set() for event in running), timeout=60, every=0.05)
        # two wait for a slot: r1's queue (--max-waiting 2) is full
        streams += [pool.submit(_stream, cluster, session) for _ in range(2)]
        wait_until(lambda: _health(cluster, "r1")["waiting"] == 2, timeout=30, every=0.05)
        chat = httpx.post(f"{cluster.url}/v1/chat/completions", headers={"x-session-id": session}, timeout=30,
                          json={"messages": STORY, "max_tokens": 4})
        messages = httpx.post(f"{cluster.url}/v1/messages", headers={"x-session-id": session}, timeout=30,
                              json={"model": MODEL, "messages": STORY, "max_tokens": 4})
        elsewhere = cluster.chat(other, "Say hi.")  # the limits are each replica's own
        for stream in streams:
            assert stream.result(timeout=120) == "finished"
    assert chat.status_code == 429 and int(chat.headers["retry-after"]) >= 1, chat.text
    assert chat.headers["x-mashbox-replica"] == "r1" and chat.json()["error"]["type"]
    assert messages.status_code == 529 and int(messages.headers["retry-after"]) >= 1, messages.text
    assert messages.json()["error"]["type"] == "overloaded_error"
    assert elsewhere.headers["x-mashbox-replica"] == "r2"


def test_a_killed_worker_ends_its_streams_with_the_error_event_through_the_balancer(cluster):
    session = cluster.session_on("r2")
    worker = _health(cluster, "r2")["worker_pid"]
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream, cluster, session, started)
        wait_until(started.is_set, timeout=60, every=0.05)
        os.kill(worker, signal.SIGKILL)
        ended = stream.result(timeout=60)
    assert ended.startswith("error event:") and "worker" in ended, ended
    wait_until(lambda: cluster.healthy("r2"))  # the replica started its worker again
    wait_until(lambda: both_in_rotation(cluster), timeout=30, every=0.5)


def test_a_killed_replica_ends_its_streams_and_is_back_only_once_healthy(cluster):
    session = cluster.session_on("r1")
    killed = cluster.pid("r1")
    events = [threading.Event() for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(_stream, cluster, session, event) for event in events]
        wait_until(lambda: all(event.is_set() for event in events), timeout=60, every=0.05)
        os.kill(killed, signal.SIGKILL)
        start = time.monotonic()
        ended = [stream.result(timeout=30) for stream in streams]
    assert ended == ["cut", "cut"] and time.monotonic() - start < 10  # nothing hangs
    assert gone(killed)
    answered = []  # the session's requests while r1 is away: all answered, by r2
    while not cluster.healthy("r1"):
        answered.append(cluster.chat(session, "Say hi.").headers["x-mashbox-replica"])
        time.sleep(0.1)
    assert answered and set(answered) == {"r2"}, answered
    assert cluster.pid("r1") != killed and "replica r1 stopped (killed by SIGKILL); starting it again" in cluster.text()
    wait_until(lambda: cluster.replica_of(session) == "r1", timeout=30)  # back where its sessions hash to


@pytest.mark.parametrize(("flags", "words"), [
    (["--host", "0.0.0.0"], "host: 0.0.0.0 is not one of 127.0.0.1, ::1, localhost"),
    (["--host", "127.0.0.2"], "host: 127.0.0.2 is not one of"),  # loopback, but no name the replicas answer to
    (["--replicas", "0"], "replicas: must be between 1 and 64"),
    (["--", "--port", "9000"], "run_args: --port is set by the cluster"),
    (["--haproxy", "/no/such/haproxy"], "haproxy: /no/such/haproxy is not an executable"),
    (["--", "--slots", "0"], "slots"),
    # the server's own checks too (each replica refused them after HAProxy and all of them started: exit 1)
    (["--", "--api-key-file", "/no/such/keys"], "api key file /no/such/keys: cannot read it"),
    (["--", "--allow-origin", "foo"], "--allow-origin: 'foo' is no origin"),
    (["--", "--cache-dir", "/etc/passwd"], "--cache-dir: /etc/passwd cannot be a folder here (it is there, and is no "
                                           "folder)"),
])
def test_bad_cluster_flags_are_one_line_and_exit_2(flags, words):
    process = subprocess.run([sys.executable, "-m", "mashbox", "cluster", "--port", str(free_port()), *flags],
                             capture_output=True, text=True, timeout=60)
    assert process.returncode == 2, process.stderr
    assert words in process.stderr and "Traceback" not in process.stderr


@pytest.mark.parametrize("held", ["balancer", "replica"])
def test_a_port_in_use_is_one_line_and_exit_2_before_anything_starts(held):
    """HAProxy's port taken stopped the cluster seconds later, after every replica had started (exit 1); a replica's
    told the user to pick another --port, which the cluster refuses after --."""
    port, first = free_port(), free_port()
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port if held == "balancer" else first + 1))
        holder.listen()
        began = time.monotonic()
        process = subprocess.run([sys.executable, "-m", "mashbox", "cluster", "--port", str(port), "--first-port",
                                  str(first), "--replicas", "2"], capture_output=True, text=True, timeout=60)
    words = (f"port: {port} is in use on 127.0.0.1" if held == "balancer"
             else f"--first-port: replica r2's port {first + 1} is in use")
    assert process.returncode == 2 and words in process.stderr and len(process.stderr.splitlines()) == 1, process.stderr
    assert "--first-port" in process.stderr or held == "balancer"
    assert time.monotonic() - began < 20, "refused before any replica started"


def test_stopping_the_cluster_ends_its_streams_with_the_error_event(cluster):
    """Last: Ctrl-C in the cluster's terminal (SIGINT to its whole process group; SIGTERM takes the same
    way out). The replicas end what runs with the protocol's error event and HAProxy passes it on
    before it goes (a soft stop: HAProxy, in a session of its own, once got the SIGINT itself and
    cut every stream), then all exit 0. A second Ctrl-C does not cut it short (it killed the cluster, and
    HAProxy cut the streams)."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream, cluster, "stopping", started)
        wait_until(started.is_set, timeout=60, every=0.05)
        os.killpg(cluster.process.pid, signal.SIGINT)
        time.sleep(0.3)
        os.killpg(cluster.process.pid, signal.SIGINT)  # impatient: a second Ctrl-C cut the stop short, and the stream
        ended = stream.result(timeout=30)
    assert ended.startswith("error event:") and "shutting down" in ended, ended
    assert cluster.process.wait(timeout=60) == 0
