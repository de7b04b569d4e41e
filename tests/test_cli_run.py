"""``mashbox run`` as a real process: serves while loading, answers, restarts a killed worker,
stops cleanly."""

import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mashbox.server import task_store

FLAGS = ("--host", "--port", "--ctx", "--slots", "--cache-ram", "--cache-disk", "--cache-dir", "--api-key-file", "--ui",
         "--allow-origin", "--tasks-db", "--tasks-ttl", "--allow-long-context", "--in-process", "--kv-dtype",
         "--verbatim-template", "--free-calls", "--sampling", "--max-waiting", "--max-waiting-per-tenant",
         "--hang-timeout")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mashbox(*args, env=None):
    env = {**os.environ, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "mashbox", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def poll_health(url, process, timeout=90):
    """Status codes of /health until 200 (connection refusals not counted)."""
    seen, deadline = [], time.monotonic() + timeout
    while not seen or seen[-1] != 200:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, f"no 200 from /health: {seen[-3:]}"
        try:
            seen.append(httpx.get(f"{url}/health", timeout=5).status_code)
        except httpx.TransportError:
            time.sleep(0.1)
    return seen


def wait_for_restarts(url, n, timeout=60):
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health", timeout=5).json().get("worker_restarts") != n:
        assert time.monotonic() < deadline, "the server did not start its worker again"
        time.sleep(0.05)


def gone(pid, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_serves_while_loading_answers_then_stops_cleanly(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = mashbox(str(tiny_model_dir), "--port", str(port), "--ctx", "512", "--slots", "4")
    try:
        seen = poll_health(url, process)
        assert seen[0] in (503, 200) and set(seen) <= {503, 200}
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["worker_restarts"] == 0
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"X-Session-Id": "sess-9"}, json={
            "messages": [{"role": "user", "content": "Name three planets."}], "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        request_id = answer.headers["x-request-id"]
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        os.kill(health["worker_pid"], signal.SIGKILL)
        wait_for_restarts(url, 1)  # the server notices the worker's death and loads the model again
        poll_health(url, process)
        restarted = httpx.get(f"{url}/health").json()
        assert restarted["worker_restarts"] == 1 and restarted["worker_pid"] != health["worker_pid"]
        again = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Name three planets."}], "max_tokens": 8})
        assert again.json()["choices"] == answer.json()["choices"]
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert f"serving {tiny_model_dir.name} on {url} (loading...)" in err and "ready" in err  # the id it answers to
    assert "Traceback" not in err
    assert gone(restarted["worker_pid"])
    assert "loading the model again (restart 1)" in err
    assert any(request_id in line and "session=sess-9" in line for line in err.splitlines()), err


def test_the_workers_engine_says_its_notes_in_the_servers_log(tiny_model_dir, tmp_path):
    """The worker's engine log (here: the packed weights of a model never packed before, saved) goes where
    the server's does; it went nowhere, so a format widened at load was said to no one."""
    model = tmp_path / "never-packed"
    shutil.copytree(tiny_model_dir, model)
    port = free_port()
    process = mashbox(str(model), "--port", str(port), "--ctx", "512", "--slots", "2")
    try:
        poll_health(f"http://127.0.0.1:{port}", process)
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert " INFO mashbox.engine: packed weights saved to " in err, err


def test_sigterm_lets_answers_end_then_ends_the_rest_with_the_error_event():
    """A stream still running when the server is told to stop gets its protocol's error event and
    [DONE] within the grace period, not a cut connection nor a traceback; a short one finishes; a
    whole answer still running gets 503 saying so (it was a 500: sent again to a worker that was gone)."""
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = mashbox("--port", str(port), "--ctx", "8192", "--slots", "3", "--cache-disk", "0")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        poll_health(url, process)
        whole = ThreadPoolExecutor(1).submit(httpx.post, f"{url}/v1/responses", timeout=60, json={
            "input": "Write a very long story about a lighthouse.", "max_output_tokens": 6000})
        long = client.chat.completions.create(stream=True, max_tokens=6000, model="smollm2-135m", messages=[
            {"role": "user", "content": "Write a very long story about a lighthouse."}])
        short = client.chat.completions.create(stream=True, max_tokens=40, model="smollm2-135m", messages=[
            {"role": "user", "content": "Say hi."}])
        next(iter(long)), next(iter(short))
        process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert list(short)[-1].choices[0].finish_reason in ("stop", "length")  # it ended on its own
        with pytest.raises(openai.APIError, match="the server is shutting down"):
            list(long)
        refused = whole.result()
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        assert refused.json()["error"]["message"] == "the server is shutting down"
        assert time.monotonic() - start < 6
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0 and "Traceback" not in err and "Exception in ASGI" not in err, err
    # the whole answer was logged as re-sent (it was not) and as left by its client
    assert "re-sending" not in err and "stopped before it finished" not in err, err
    assert err.count("failed after") >= 2 and "the server is shutting down" in err, err
    assert "stopping: 3 answers under way, given up to 4 s to end" in err  # said at once, not after the drain


def test_sigterm_to_the_process_group_stops_it_as_the_server_alone_would(tiny_model_dir):
    """systemd, ``timeout`` and a shell's kill of a job signal the whole group: the worker leaves the
    stop to the server, so an answer under way ends and no worker restart is tried (it once died at
    once, was said to be killed and loaded again while the server stopped)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "mashbox", "run", str(tiny_model_dir), "--port", str(port),
                                "--ctx", "512", "--slots", "2"], stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        poll_health(url, process)
        pid = httpx.get(f"{url}/health").json()["worker_pid"]
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 60, "stream": True}) as answer:
            lines = answer.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            os.killpg(process.pid, signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest).replace(" ", "")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0 and "again" not in err and "restart" not in err, err
    assert gone(pid)


def test_ctrl_c_stops_the_server_and_its_worker(tiny_model_dir):
    port = free_port()
    process = mashbox(str(tiny_model_dir), "--port", str(port), "--ctx", "512", "--slots", "4")
    try:
        poll_health(f"http://127.0.0.1:{port}", process)
        pid = httpx.get(f"http://127.0.0.1:{port}/health").json()["worker_pid"]
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0 and "Traceback" not in err, err
    assert gone(pid)


@pytest.mark.parametrize(("model", "words"), [("{tmp}/no-such-model", "does not exist"),
                                             ("no-such-model", "Unknown model 'no-such-model'. Known ids:")])
def test_a_model_that_cannot_be_had_is_refused_before_the_server_listens(tmp_path, model, words):
    """An unknown id or a missing path was found only by the worker: the server listened and said it was serving
    the model ("loading..."), then stopped, exit 1; now it is said at once, in one line."""
    process = mashbox(model.format(tmp=tmp_path), "--port", str(free_port()))
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert words in err and "serving" not in err and len(err.splitlines()) == 1, err


def test_a_worker_killed_while_loading_is_said_in_one_line_and_exits_1(tiny_model_dir):
    port = free_port()
    process = mashbox(str(tiny_model_dir), "--port", str(port), "--ctx", "512", "--slots", "4")
    pid = loading_worker(port, process)
    os.kill(pid, signal.SIGKILL)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 1 and "Traceback" not in err, err
    assert "the model did not load: the worker was killed by SIGKILL (out of memory?) while loading" in err


def test_a_port_in_use_is_one_line_and_exit_2_before_loading(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = mashbox(str(tiny_model_dir), "--port", str(port), "--ctx", "512", "--slots", "2")
        _, err = process.communicate(timeout=60)
    assert process.returncode == 2, err
    assert err.splitlines() == [f"mashbox: cannot listen on 127.0.0.1:{port}: address already in use "
                                "(another server is on it: stop it or pick another --port)"]


@pytest.mark.parametrize(("flags", "words"), [
    (["--ctx", "4096"], "ctx: 4096 is more than the 1024 tokens"),
    (["--ctx", "1000000000", "--allow-long-context"], "ctx 1000000000 x 4 slots needs "),
    (["--ctx", "512", "--kv-dtype", "q8_0"], "kv_dtype: q8_0 takes heads of a multiple of 32 values"),
])
def test_a_ctx_the_model_or_the_memory_cannot_take_is_one_line_and_exit_2(tiny_model_dir, flags, words):
    process = mashbox(str(tiny_model_dir), "--port", str(free_port()), "--slots", "4", *flags)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2, err
    said = [line for line in err.splitlines() if words in line]
    assert len(said) == 1 and said[0].startswith(f"mashbox: {words}"), err
    assert "Traceback" not in err and "did not load" not in err and "ready" not in err


def test_ctrl_c_while_loading_stops_within_a_second(tiny_model_dir):
    port = free_port()
    process = mashbox(str(tiny_model_dir), "--port", str(port), "--ctx", "512", "--slots", "4")
    pid = loading_worker(port, process)
    process.send_signal(signal.SIGINT)
    start = time.monotonic()
    _, err = process.communicate(timeout=30)
    assert time.monotonic() - start < 1.5, err
    assert process.returncode == 0 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "mashbox: stopping" and "ready" not in err
    assert gone(pid, timeout=1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["worker", "in-process"])
def test_a_stop_as_the_server_starts_is_a_stop_and_exit_0(tiny_model_dir, mode, signum):
    """As the exit statuses say: a stop while loading is 0. Sent as the port is bound (the in-process server then
    imports torch): SIGTERM, not taken yet, killed it (143 to a supervisor); an interrupt raised inside numpy's
    import broke it (a traceback, exit 1) or was swallowed there (the server served on)."""
    port = free_port()
    process = mashbox(str(tiny_model_dir), "--port", str(port), "--ctx", "512", "--slots", "4", *mode)
    deadline = time.monotonic() + 60
    while not _accepts(port):
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.005)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in err and "ready" not in err, err


def _accepts(port):
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def loading_worker(port, process, timeout=60):
    """The worker's pid as soon as /health shows it while the model still loads."""
    deadline = time.monotonic() + timeout
    while (pid := _worker_pid_if_loading(port)) is None:
        assert time.monotonic() < deadline and process.poll() is None, "no worker pid while loading"
        time.sleep(0.02)
    return pid


def _worker_pid_if_loading(port):
    try:
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
    except httpx.TransportError:
        return None
    return health.get("worker_pid") if health["status"] == "loading" else None


@pytest.mark.parametrize(("flags", "words"), [
    (["--cache-disk", "inf"], "mashbox run: argument --cache-disk: must be a number of GiB, 0 to 1048576"),
    (["--cache-disk", "1e300"], "mashbox run: argument --cache-disk: must be a number of GiB, 0 to"),  # overflowed
    (["--cache-ram", "99999999999999999999"], "mashbox run: argument --cache-ram: must be a whole number of MiB, 0 to"),
    (["--sampling", "temperature=0.7", "--sampling", "temperature=0.1"],
     "mashbox run: argument --sampling: temperature given twice"),
    (["--sampling", "top_k=5,top_k=6"], "mashbox run: argument --sampling: top_k given twice"),
    (["--cache-dir", "/proc/no-such-folder"], "mashbox: --cache-dir: /proc/no-such-folder cannot be a folder here"),
    (["--cache-dir", "/dev/null"], "mashbox: --cache-dir: /dev/null cannot be a folder here (it is there, and is no "
                                   "folder)"),  # it said "(File exists)"
    (["--slots", "abc"], "mashbox run: argument --slots: invalid int value: 'abc' (see mashbox run --help)"),
    (["--sampling", "top_p=2"], "mashbox run: argument --sampling: top_p: must be in (0, 1]"),
    (["--tasks-ttl", "inf"], "mashbox run: argument --tasks-ttl: must be a number of hours, more than 0"),
    (["--hang-timeout", "-1"], "mashbox run: argument --hang-timeout: must be a number of seconds, 0 or more"),
    (["--allow-origin", "notanorigin"], "mashbox: --allow-origin: 'notanorigin' is no origin"),
    (["--allow-origin", "http://localhost:3000/app"],
     "mashbox: --allow-origin: 'http://localhost:3000/app' is no origin"),
])
def test_a_bad_flag_is_one_line_and_exit_2_before_loading(flags, words):
    """Refused at once in one line (argparse's usage block is not printed), never after loading began."""
    process = mashbox("--port", str(free_port()), *flags)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and err.startswith(words) and len(err.splitlines()) == 1, err


def test_a_default_prefix_cache_folder_that_cannot_be_made_is_said_before_loading(tmp_path):
    """A cache under a file (a read-only home, say) was said only after the model loaded; --cache-disk 0
    needs no folder."""
    (tmp_path / "afile").write_text("")
    env = {"MASHBOX_CACHE": str(tmp_path / "afile" / "cache")}
    process = mashbox("--port", str(free_port()), "--tasks-db", str(tmp_path / "tasks.sqlite3"), env=env)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("mashbox: the disk prefix cache (choose its folder with --cache-dir or MASHBOX_CACHE, or "
                          f"none with --cache-disk 0): {tmp_path}/afile/cache/prefixes cannot be a folder here"), err


def test_a_default_tasks_db_that_cannot_be_made_is_said_before_loading(tmp_path):
    """The default tasks file (in the mashbox cache) was not checked at start: under a home that cannot be
    written every /v1/tasks call was a 500, while the server ran on."""
    (tmp_path / "afile").write_text("")
    env = {"MASHBOX_CACHE": str(tmp_path / "afile" / "cache")}
    process = mashbox("--port", str(free_port()), "--cache-disk", "0", env=env)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"mashbox: --tasks-db: {tmp_path}/afile/cache/tasks.sqlite3 cannot hold the tasks"), err
    assert "--tasks-db" in err


def test_a_tasks_db_that_cannot_hold_the_tasks_is_one_line_and_exit_2(tmp_path):
    """Refused at start, not a 500 on every /v1/tasks call later."""
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("not a database")
    (tmp_path / "nowhere.sqlite3").symlink_to("/no-such-folder/tasks.sqlite3")  # it was a 500 at every task
    for path in ("/proc/no-such-folder/tasks.sqlite3", str(not_a_db), str(tmp_path / "nowhere.sqlite3"),
                 "/proc/tasks.sqlite3"):
        process = mashbox("--port", str(free_port()), "--tasks-db", path)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 2 and err.startswith(f"mashbox: --tasks-db: {path} cannot hold the tasks"), err
        assert len(err.splitlines()) == 1
    fresh = tmp_path / "new" / "tasks.sqlite3"
    task_store.check(fresh)
    assert fresh.is_file(), "the folder and an empty database are made"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20"])
def test_a_public_host_without_keys_refuses_to_start(host):
    process = mashbox("--host", host, env={"MASHBOX_API_KEY": ""})
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert f"host: {host} is not a loopback address, so API keys are required" in err


def test_help_documents_every_flag():
    process = mashbox("--help")
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    for flag in FLAGS:
        assert flag in out
    assert out.count("(default:") >= len(FLAGS) + 1  # every flag and the model say their default
    status = out[out.index("exit status:"):]
    for code in ("0", "1", "2"):
        assert f"\n  {code}  " in status


def test_sighup_reads_the_key_file_again_and_a_bad_file_keeps_the_keys(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-old alice\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = mashbox(str(tiny_model_dir), "--port", str(port), "--ctx", "512", "--slots", "2",
                      "--api-key-file", str(keys), env={"MASHBOX_API_KEY": ""})

    def status(key):
        return httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=5).status_code

    def until(check, timeout=20):
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    try:
        poll_health(url, process)
        assert (status("sk-old"), status("sk-new")) == (200, 401)
        keys.write_text("sk-new bob\n")
        process.send_signal(signal.SIGHUP)
        until(lambda: status("sk-new") == 200)
        assert status("sk-old") == 401
        keys.write_text("# no keys at all\n")  # a file that does not read: the keys in use stay
        process.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert (status("sk-new"), status("sk-old")) == (200, 401)
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert "API keys read again" in err and "kept the API keys in use" in err and "sk-new" not in err


def test_sighup_without_a_key_file_changes_nothing(tiny_model_dir):
    """Keys from MASHBOX_API_KEY alone: a SIGHUP (as docs/scale-out.md says to send every replica) once
    ended the server at once, its answers cut."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = mashbox(str(tiny_model_dir), "--port", str(port), "--ctx", "512", "--slots", "2",
                      env={"MASHBOX_API_KEY": "sk-env"})
    try:
        poll_health(url, process)
        process.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert process.poll() is None
        assert httpx.get(f"{url}/v1/models", headers={"x-api-key": "sk-env"}, timeout=5).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0 and "there is none (--api-key-file): nothing changed" in err, err


def test_a_server_whose_stderr_nobody_reads_goes_on_serving_and_stops(tiny_model_dir):
    """Its terminal closed, or `mashbox run | head`: a SIGHUP left it listening but answering nothing, and
    a SIGTERM left it (and its worker) running for good, its goodbye line raising BrokenPipeError."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "mashbox", "run", str(tiny_model_dir), "--port", str(port),
                                "--ctx", "512", "--slots", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "MASHBOX_API_KEY": ""})
    try:
        process.stderr.readline()  # "serving ... (loading...)"
        process.stderr.close()  # the reader goes
        poll_health(url, process)
        process.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()


def test_a_second_ctrl_c_ends_the_answers_at_once_each_with_its_error_event():
    """The first Ctrl-C lets answers end (5 s); a second one, uvicorn's, cut every stream mid-answer (no error
    event, no [DONE]) and logged a traceback for each."""
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = mashbox("--port", str(port), "--ctx", "8192", "--slots", "2", "--cache-disk", "0")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        poll_health(url, process)
        long = client.chat.completions.create(stream=True, max_tokens=6000, model="smollm2-135m", messages=[
            {"role": "user", "content": "Write a very long story about a lighthouse."}])
        next(iter(long))
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        start = time.monotonic()
        with pytest.raises(openai.APIError, match="the server is shutting down"):
            list(long)
        assert time.monotonic() - start < 3  # not the 5 s the first one gives
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0 and "Traceback" not in err and "Exception in ASGI" not in err, err


def test_sampling_flags_given_again_add_up():
    """The second --sampling replaced the first whole: its temperature gone, unsaid."""
    from mashbox.cli import build_parser

    args = build_parser().parse_args(["run", "--sampling", "temperature=0.7", "--sampling", "top_p=0.5,top_k=20"])
    assert args.sampling == {"temperature": 0.7, "top_p": 0.5, "top_k": 20}
    assert build_parser().parse_args(["run"]).sampling == {}


def test_sigterm_ends_a_running_task_saved_with_its_output_and_says_the_server_stopped(tmp_path):
    """A background task still writing when the server is told to stop: it was cut as the event loop closed,
    saved as it was when it began (no output), and only the next start failed it; now it ends with the
    backend, its answer so far kept (``incomplete``), saved before the server exits, with no traceback."""
    port, db = free_port(), tmp_path / "tasks.sqlite3"
    url = f"http://127.0.0.1:{port}"
    process = mashbox("--port", str(port), "--ctx", "8192", "--cache-disk", "0", "--tasks-db", str(db))
    try:
        poll_health(url, process)
        created = httpx.post(f"{url}/v1/tasks", timeout=60, json={
            "stream": False, "background": True, "task_id": "essay", "inference_args": {"max_tokens": 6000},
            "user_message_content": "Write a very long essay about Rome."}).json()["result"]
        assert created["status"] in ("queued", "working"), created
        deadline = time.monotonic() + 30
        while not httpx.get(f"{url}/v1/tasks/essay", timeout=10).json()["result"]["output"]:
            assert time.monotonic() < deadline, "the task wrote nothing"
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in err, err
    store = task_store.TaskStore(db, ttl_s=3600)
    task = store.get("default", "essay")
    store.close()
    assert task["status"] == "failed" and task["error"] == {"code": -32012, "message": (
        "the server stopped while this task was running (the server is shutting down); create it again")}
    assert [item["status"] for item in task["output"]] == ["incomplete"]
    assert task["output"][0]["message_content"][0]["text"].strip()
    assert task["usage"]["input_tokens"] > 0 and task["usage"]["output_tokens"] > 0, task["usage"]  # it was null


def _limited(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _files_limit(pid: int) -> int:
    line = next(line for line in open(f"/proc/{pid}/limits") if line.startswith("Max open files"))
    return int(line.split()[3])


def test_idle_connections_past_the_file_limit_are_closed_as_they_come_and_the_server_answers_after():
    """At the file descriptor limit every accept failed (a traceback each, megabytes of log a second) and
    no client was answered until the idle connections left; the server raises its soft limit to the hard
    one, and past it closes new connections at once."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "mashbox", "run", "--port", str(port), "--cache-disk", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_limited(256, 256))
    idle = []
    try:
        poll_health(url, process)
        for _ in range(200):  # past 256 less the 128 kept for the server's own files
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            idle[-1].sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        with pytest.raises(httpx.TransportError):  # closed at once, not left waiting
            httpx.get(f"{url}/health", timeout=10)
        burst = [socket.socket() for _ in range(200)]  # accepted all at once: past the limit before any is closed
        for sock in burst:
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
        time.sleep(1.5)
        for sock in idle + burst:
            sock.close()
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                    break
            assert time.monotonic() < deadline, "no answer once the idle connections left"
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert "closing new connections: 128 are open, the most this process's file descriptors allow" in err, err
    assert "Traceback" not in err and err.count("could not be accepted") <= 1, err[-3000:]  # each accept said, once


def test_the_server_raises_its_file_limit_to_the_hard_limit():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "mashbox", "run", "--port", str(port), "--cache-disk", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_limited(256, 4096))
    try:
        poll_health(f"http://127.0.0.1:{port}", process)
        assert _files_limit(process.pid) == 4096
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
