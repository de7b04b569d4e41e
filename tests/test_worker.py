"""The engine in a worker process: loading, parity with the in-process engine,
errors, aborts, and a worker killed mid-way: it restarts, and over HTTP a request
whose client has received nothing is answered anyway (re-sent once)."""

import asyncio
import concurrent.futures
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from mashbox import ContextLengthError, EngineRequest, Finish, Message, SamplingParams, Started, TextDelta
from mashbox.server.worker import WorkerBackend
from mashbox.server.worker_messages import Events


def chat(text, **sampling):
    return EngineRequest(messages=(Message("user", text),), sampling=SamplingParams(**sampling))


async def collect(events):
    return [event async for event in events]


async def until(check, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def without_timings(events):
    """The events but the Finish's timings, and where a prompt left another cached prefix (what
    each engine ran before)."""
    return [e.reason if isinstance(e, Finish) else Started(e.cached) if isinstance(e, Started) else e
            for e in events], events[-1].usage


@pytest.fixture(scope="module")
def started(tiny_model_dir):
    backend = WorkerBackend(str(tiny_model_dir), {"ctx": 512, "slots": 4, "quiet": True})
    first = backend.state
    yield backend, first
    backend.close()


@pytest.fixture
def worker(started):
    backend = started[0]
    assert backend.wait(60) == "ready", backend.error
    return backend


def test_loads_in_a_worker_process_with_all_threads(started):
    backend, first = started
    assert first == "loading"
    assert backend.wait(60) == "ready"
    assert backend.worker_pid not in (None, os.getpid()) and backend.worker_restarts == 0
    assert backend.info.ctx == 512 and backend.info.slots == 4 and backend.model_id == backend.info.id
    assert backend.threads == torch.get_num_threads()


def test_stream_equals_the_in_process_engine(worker, tiny_engine):
    request = chat("Name three planets.", max_tokens=40)
    events = asyncio.run(collect(worker.astream(request)))
    assert without_timings(events) == without_timings(list(tiny_engine.stream(request)))
    assert asyncio.run(worker.count(request)) == len(tiny_engine.encode(request))


def test_context_too_long_raises_with_param(worker):
    with pytest.raises(ContextLengthError) as err:
        asyncio.run(collect(worker.astream(chat("word " * 600))))
    assert err.value.param == "messages" and err.value.ctx == 512 and err.value.tokens > 512
    assert worker.state == "ready"


def test_abort_frees_the_slot(worker):
    async def scenario():
        events = worker.astream(chat("Tell me everything.", max_tokens=400))
        await anext(events)
        await events.aclose()
        await until(lambda: (s := worker.stats()) is not None and s.running == 0 and s.finished.get("abort", 0) >= 1, 5)

    asyncio.run(scenario())


def test_a_request_stopped_by_its_id_still_ends_with_its_finish_and_usage(worker):
    async def scenario():
        request = chat("Tell me everything.", max_tokens=400)
        events, seen = worker.astream(request), []
        async for event in events:
            seen.append(event)
            if sum(isinstance(e, TextDelta) for e in seen) == 3:
                worker.abort(request.id)
        return seen

    seen = asyncio.run(scenario())
    finish = seen[-1]
    assert isinstance(finish, Finish) and finish.reason == "abort"
    assert 3 <= finish.usage.completion_tokens < 400 and finish.usage.prompt_tokens > 5


def test_the_events_of_one_step_for_every_stream_come_back_in_one_message(worker, monkeypatch):
    replies, dispatch = [], worker._dispatch  # the reader thread's handler of each message from the worker
    monkeypatch.setattr(worker, "_dispatch", lambda incarnation, reply: (replies.append(reply), dispatch(incarnation, reply)))

    async def scenario():
        await collect(worker.astream(chat("Hi.", max_tokens=1)))  # the reader now calls the handler above
        replies.clear()
        requests = [chat(f"Count to {n}.", max_tokens=120) for n in range(4)]  # long enough to overlap on a busy machine
        return await asyncio.gather(*(collect(worker.astream(r)) for r in requests))

    streams = asyncio.run(scenario())
    batches = [[m.request_id for m in reply.messages] for reply in replies if isinstance(reply, Events)]
    assert sum(map(len, batches)) == sum(map(len, streams))  # every event, once
    assert max(len(set(ids)) for ids in batches) == 4  # a decode step's tokens for all four streams at once
    assert sum(map(len, batches)) > 2 * len(batches)


def drained(changes):
    out = []
    while not changes.empty():
        change = changes.get()
        out.append((change.state, change.restarts))
    return out


def test_stats_are_the_last_snapshot_the_worker_sent_never_a_wait(worker):
    async def scenario():
        await collect(worker.astream(chat("Count to three.", max_tokens=4)))
        await until(lambda: worker.stats() is not None and worker.stats().generated_tokens >= 4, 5)

    asyncio.run(scenario())
    os.kill(worker.worker_pid, signal.SIGSTOP)  # a worker that answers nothing
    try:
        time.sleep(0.3)  # older than any "fresh enough" window
        snapshot, started = worker.stats(), time.monotonic()
        assert all(worker.stats() is snapshot for _ in range(20))
        assert time.monotonic() - started < 0.5  # asking the worker and waiting 0.1 s each took 2 s
    finally:
        os.kill(worker.worker_pid, signal.SIGCONT)


def test_a_killed_workers_token_counts_are_kept_in_the_totals(worker):
    """A new worker counts from 0: the tokens of the one before were lost from /metrics unless a
    scrape had come between (the totals were folded at each scrape only)."""
    async def served() -> int:
        events = await collect(worker.astream(chat("Count to five.", max_tokens=6)))
        return events[-1].usage.prompt_tokens

    prompt = asyncio.run(served())
    asyncio.run(until(lambda: worker.stats() is not None and worker.stats().generated_tokens > 0))
    before = worker.stats()
    os.kill(worker.worker_pid, signal.SIGKILL)
    asyncio.run(until(lambda: worker.worker_restarts > 0 and worker.state == "ready", timeout=60))
    asyncio.run(served())
    asyncio.run(until(lambda: worker.stats() is not None and worker.stats().prompt_tokens > before.prompt_tokens))
    after = worker.stats()
    assert after.prompt_tokens >= before.prompt_tokens + prompt and after.generated_tokens > before.generated_tokens
    assert sum(after.finished.values()) > sum(before.finished.values())


def test_killed_worker_restarts_and_ends_its_streams_with_an_error(worker):
    drained(worker.changes)

    async def scenario():
        old_pid = worker.worker_pid
        streamed = worker.astream(chat("Tell me everything.", max_tokens=400))
        await anext(streamed)
        os.kill(old_pid, signal.SIGKILL)
        rest = await collect(streamed)
        assert isinstance(rest[-1], Finish) and rest[-1].reason == "error" and rest[-1].error == "worker restarted"
        assert worker.state == "loading" and worker.worker_pid != old_pid
        assert worker.stats() is None

    restarts = worker.worker_restarts
    asyncio.run(scenario())
    assert worker.wait(60) == "ready" and worker.worker_restarts == restarts + 1
    # every state change is queued for the terminal, however quickly the next one follows
    assert drained(worker.changes) == [("loading", restarts + 1), ("ready", restarts + 1)]


def test_a_worker_killed_again_while_it_loads_again_is_started_once_more(worker):
    """Out of memory twice: the worker killed, then its new one killed while it loaded the model that had
    loaded before; the whole server stopped (exit 1, connections refused)."""
    assert worker.wait(60) == "ready"
    first = worker.worker_pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while worker.worker_pid in (first, None):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = worker.worker_pid
    assert worker.state == "loading"
    os.kill(second, signal.SIGKILL)
    while worker.worker_pid in (first, second, None) and worker.state != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert worker.wait(60) == "ready", worker.error


def test_request_in_flight_when_the_worker_dies_is_answered_over_http(worker, tiny_engine):
    from server import serve

    from mashbox.server.settings import Settings

    body = {"messages": [{"role": "user", "content": "Am I answered?"}], "max_tokens": 24}
    expected = tiny_engine.chat(body).choices[0].message.content
    for url in serve(worker, Settings()):
        old_pid = worker.worker_pid
        os.kill(old_pid, signal.SIGSTOP)  # holds the worker so that the request stays unanswered
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=120)
            time.sleep(0.5)
            os.kill(old_pid, signal.SIGKILL)
            response = answer.result()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert worker.worker_pid != old_pid and worker.state == "ready"


def test_a_worker_silent_with_requests_to_answer_is_killed_and_started_again(tiny_model_dir, tiny_engine):
    """A stopped or deadlocked worker (its process alive) was never found out: /health said ready, and every
    request waited for the hour's timeout. Silent for ``hang_s`` with requests to answer, it is killed: its
    streams end in an error, a request whose client had nothing is answered by the new worker; an idle worker,
    silent as long, is not touched."""
    from server import serve

    from mashbox.server.settings import Settings

    body = {"messages": [{"role": "user", "content": "Am I answered?"}], "max_tokens": 24}
    expected = tiny_engine.chat(body).choices[0].message.content
    backend = WorkerBackend(str(tiny_model_dir), {"ctx": 512, "slots": 4, "quiet": True}, hang_s=2.0)
    try:
        assert backend.wait(60) == "ready", backend.error
        first = backend.worker_pid
        time.sleep(2.5)  # idle: nothing to say; then a second of silence on a request is no hang
        os.kill(first, signal.SIGSTOP)
        threading.Timer(1.0, os.kill, (first, signal.SIGCONT)).start()
        assert asyncio.run(collect(backend.astream(chat("Hi.", max_tokens=4))))[-1].reason == "length"
        assert backend.worker_restarts == 0 and backend.worker_pid == first

        async def read_slowly():  # a client that stops reading: the worker, its answer sent, owes nothing
            streamed = backend.astream(chat("Count to ten.", max_tokens=8))
            await anext(streamed)
            await asyncio.sleep(3)
            return await collect(streamed)

        assert asyncio.run(read_slowly())[-1].reason == "length"
        assert backend.worker_restarts == 0 and backend.worker_pid == first, "a worker that owed nothing was killed"

        async def stopped_mid_stream():
            streamed = backend.astream(chat("Tell me everything.", max_tokens=400))
            await anext(streamed)
            os.kill(first, signal.SIGSTOP)
            return await asyncio.wait_for(collect(streamed), 30)

        began = time.monotonic()
        rest = asyncio.run(stopped_mid_stream())
        assert isinstance(rest[-1], Finish) and rest[-1].error == "worker restarted" and time.monotonic() - began > 2
        assert backend.worker_restarts == 1 and backend.worker_pid != first
        assert backend.wait(60) == "ready", backend.error
        for url in serve(backend, Settings()):
            second = backend.worker_pid
            os.kill(second, signal.SIGSTOP)  # stopped before the request: its client gets nothing until it is killed
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == expected
        assert backend.worker_restarts == 2 and backend.worker_pid not in (first, second)
    finally:
        backend.close()


def test_a_worker_stopped_with_its_server_is_not_taken_as_hung(tiny_model_dir, monkeypatch):
    """Ctrl-Z stops the server and its worker, fg goes on: the watch, stopped too, woke to a silence as long as
    the stop and killed a worker that was fine. A check that comes late starts the worker's span anew."""
    from mashbox.server import worker as module

    stopped, real = threading.Event(), time.sleep

    class Clock:  # the watch's clock: its sleep waits out the server's stop
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds):
            real(seconds)
            while stopped.is_set():
                real(0.01)

    monkeypatch.setattr(module, "time", Clock)
    backend = WorkerBackend(str(tiny_model_dir), {"ctx": 512, "slots": 4, "quiet": True}, hang_s=2.0)
    try:
        assert backend.wait(60) == "ready", backend.error
        pid = backend.worker_pid

        async def stopped_and_resumed():
            streamed = backend.astream(chat("Tell me everything.", max_tokens=200))
            await anext(streamed)
            stopped.set()
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(3)
            stopped.clear()  # the watch goes on first, its worker still stopped for a moment
            await asyncio.sleep(0.1)
            os.kill(pid, signal.SIGCONT)
            return await asyncio.wait_for(collect(streamed), 60)

        rest = asyncio.run(stopped_and_resumed())
        assert rest[-1].reason == "length" and backend.worker_restarts == 0 and backend.worker_pid == pid
    finally:
        backend.close()


def test_metrics_count_an_answer_before_its_client_has_it(worker):
    """A scrape straight after a non-streamed answer returns already counts its prompt tokens and
    its prefix-cache hits (the worker sends its figures before the request's last event)."""
    from server import serve

    from mashbox.server.settings import Settings

    def counters(url):
        text = httpx.get(f"{url}/metrics").text
        wanted = ("mashbox:prompt_tokens", "mashbox:prefix_cache_hits")
        return [float(line.split()[-1]) for name in wanted for line in text.splitlines()
                if line.split("{")[0].split(" ")[0] == name + "_total"]

    for url in serve(worker, Settings()):
        for n in range(6):
            before = counters(url)
            body = {"messages": [{"role": "user", "content": f"Question {n % 3}: is it counted?" * 20}], "max_tokens": 2}
            usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
            after = counters(url)
            assert after[0] - before[0] == usage["prompt_tokens"], n
            assert after[1] - before[1] == usage["prompt_tokens_details"]["cached_tokens"], n


def _load_and_report(conn, model):
    """In a fresh process: the worker's load, then the collector's state after it."""
    import gc

    from mashbox.server.worker_child import _load

    _load(conn, model, {"ctx": 256, "slots": 1, "quiet": True})
    conn.send((gc.isenabled(), gc.get_freeze_count()))


@pytest.mark.parametrize("loads", [True, False])
def test_what_loading_built_is_frozen_out_of_later_collections(tiny_model_dir, tmp_path, loads):
    import multiprocessing

    from mashbox.server.worker_messages import Failed, Ready

    spawn = multiprocessing.get_context("spawn")
    conn, child = spawn.Pipe()
    process = spawn.Process(target=_load_and_report,
                            args=(child, str(tiny_model_dir if loads else tmp_path / "missing")))
    process.start()
    try:
        assert conn.poll(120)
        assert isinstance(conn.recv(), Ready if loads else Failed)
        enabled, frozen = conn.recv()
    finally:
        process.join(30)
    assert enabled  # on again, whether the load succeeded or not
    assert (frozen > 50_000) == loads  # torch and the engine's objects are out of the collector's walks


ORPHAN = '''
import multiprocessing, os, sys, threading, time
from pathlib import Path

def loading(server, started):  # a worker still loading: its pipe is read by no one
    from mashbox.server import worker_child
    threading.Thread(target=worker_child._orphaned, args=(server,), daemon=True).start()
    Path(started).write_text("watching")
    time.sleep(120)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=loading, args=(os.getpid(), sys.argv[2]))
    child.start()
    time.sleep(float(sys.argv[1]))
    print(child.pid, flush=True)
    os._exit(0)  # as a server killed with SIGKILL: no Stop sent
'''


@pytest.mark.parametrize("after", [0.5, 3.0])
def test_a_worker_whose_server_died_while_it_loads_ends(tmp_path, after):
    """A server killed (SIGKILL) mid-load left its worker loading for minutes, orphaned, with its memory; also
    one killed while the worker still started (its imports), before it could note its parent."""
    import subprocess
    import sys

    script, started = tmp_path / "orphan.py", tmp_path / "started"
    script.write_text(ORPHAN)
    done = subprocess.run([sys.executable, str(script), str(after), str(started)], capture_output=True, text=True,
                          timeout=60)
    pid = done.stdout.split()[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":  # ended; its new parent may not reap
                break
        except (OSError, IndexError):
            break
        time.sleep(0.2)
    else:
        os.kill(int(pid), signal.SIGKILL)
        raise AssertionError("the orphaned worker went on")
    assert started.read_text() == "watching", done.stderr[-2000:]  # it got as far as watching
