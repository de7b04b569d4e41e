"""What ``mashbox run`` does once its flags are read: build the backend, serve
the app on uvicorn, report loading / ready / failed in the terminal, and stop
the worker on the way out (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import queue
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from mashbox.engine.load.catalog import served_id
from mashbox.server import logs
from mashbox.server.backend import Backend, Change, InProcessBackend
from mashbox.server.settings import Settings
from mashbox.server.worker import WorkerBackend

if TYPE_CHECKING:
    import uvicorn

GRACE_S = 5  # on Ctrl-C or SIGTERM, answers have this long to end; the ones still running end in an error
MOST_FILES = 1 << 20  # the file descriptor limit asked for, where the hard limit allows it
SEND_BUFFER = 64 * 1024  # bytes asked for; Linux doubles it (a 128 KiB window is ~128 MB/s at 1 ms)


@dataclass(slots=True, frozen=True)
class Launch:
    model: str
    settings: Settings
    engine_options: dict[str, Any]
    in_process: bool = False


class Stop:
    """Ctrl-C and SIGTERM from the command's start, remembered and acted on where it is safe (``check``:
    ``KeyboardInterrupt``). Raised at once, inside an import (torch's and numpy's C modules, as ``--in-process``
    loads them), the interrupt broke it (numpy cannot be imported twice: a traceback, exit 1) or was swallowed
    (the server served on); SIGTERM, not taken yet, killed the process (143 to a supervisor). Once uvicorn
    runs, its own handlers take both."""

    def __init__(self) -> None:
        self.asked = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._take)

    def _take(self, signum: int, frame: FrameType | None) -> None:
        self.asked = True

    def check(self) -> None:
        if self.asked:
            raise KeyboardInterrupt


def serve(launch: Launch, stop: Stop) -> int:
    """Serve until interrupted (0) or until the model fails to load (1); 2 if the address cannot be
    listened on (found before the model loads) or the engine refuses a setting (before allocating)."""
    try:
        sock = listen(launch.settings.host, launch.settings.port)
    except OSError as err:
        _say(f"cannot listen on {_url(launch.settings).removeprefix('http://')}: {_reason(err)}")
        return 2
    logs.to_stderr()  # each request with its id, session and tenant
    _more_files()
    stop.check()
    backend = _backend(launch)
    signal.signal(signal.SIGHUP, lambda *_: _reload_keys(launch.settings))  # (its default ends the process)
    try:
        return _serve(backend, launch.settings, sock, stop)
    except KeyboardInterrupt:
        return 0
    finally:
        _say("stopping")
        backend.close()


def _more_files() -> None:
    """Raise the process's file descriptor limit to its hard limit (as a busy server's clients each hold one;
    past the limit, new connections are closed as they come: ``Connection``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MOST_FILES if hard == resource.RLIM_INFINITY else min(hard, MOST_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # a container may refuse: the limit stays
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now so that a port in use shows before any loading.

    Its connections inherit a bounded send buffer (``SEND_BUFFER``): left to grow, the kernel's
    buffer on loopback takes megabytes, so a client that stops reading is not seen (its stream's
    writes still fit) until a long answer has been written to nobody; bounded, the writes stall
    once ~200 KB wait, and the stream's idle timeout ends it."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _reason(err: OSError) -> str:
    if isinstance(err, socket.gaierror):
        return f"no such host ({err.strerror})"
    reason = (err.strerror or str(err)).lower()
    if err.errno == errno.EADDRINUSE:
        return f"{reason} (another server is on it: stop it or pick another --port)"
    return reason


def _serve(backend: Backend, settings: Settings, sock: socket.socket, stop: Stop) -> int:
    import uvicorn  # with the app, imported while the worker loads the model (~1 s on 2 cores)

    from mashbox.server.app import create_app
    from mashbox.server.connection import Connection

    config = uvicorn.Config(create_app(backend, settings), host=settings.host, port=settings.port, http=Connection,
                            log_level="warning", timeout_graceful_shutdown=GRACE_S)
    server = _server(config, backend, stop)
    watch = Watch(backend, server, _url(settings))
    threading.Thread(target=watch.run, name="mashbox-watch", daemon=True).start()
    server.run(sockets=[sock])
    return watch.status


def _server(config: uvicorn.Config, backend: Backend, stop: Stop) -> uvicorn.Server:
    import uvicorn

    from mashbox.server.connection import Seldom, accepts_said_seldom

    class Server(uvicorn.Server):
        """uvicorn's, but a second Ctrl-C ends the answers still running at once, each with its protocol's
        error event (uvicorn's own cut their connections, a traceback each); a third cuts them. Accepts that
        fail for want of file descriptors are said seldom (``accepts_said_seldom``). A stop asked before its
        handlers took the signals (``stop``) is taken as soon as they do."""

        hurried = False

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                if stop.asked:
                    self.handle_exit(signal.SIGTERM, None)
                yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            asyncio.get_running_loop().set_exception_handler(accepts_said_seldom(Seldom()))
            await super().startup(sockets=sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if sig == signal.SIGINT and self.should_exit and not self.hurried:
                self.hurried = True  # the backend's close may wait on the worker: not in the handler
                threading.Thread(target=backend.close, name="mashbox-stop", daemon=True).start()
                return
            super().handle_exit(sig, frame)

    return Server(config)


class Watch:
    """Says in the terminal where the server listens and what its model does; drains it on the way out."""

    def __init__(self, backend: Backend, server: uvicorn.Server, url: str, every: float = 0.1) -> None:
        self.backend, self.server, self.url, self.every = backend, server, url, every
        self.status = 0  # the exit status: 1 once the model failed to load, 2 once a setting was refused

    def run(self) -> None:
        while not self.server.started and not self.server.should_exit:
            time.sleep(self.every)
        _say(f"serving {self.backend.model_id} on {self.url} (loading...)")
        while not self.server.should_exit:
            try:
                change = self.backend.changes.get(timeout=self.every)
            except queue.Empty:
                continue
            self._report(change)
            if change.state == "failed":
                self.status = 2 if change.refused else 1
                self.server.should_exit = True
        self._drain()

    def _drain(self) -> None:
        """The server is stopping: let running answers end, then, a second before uvicorn would cut
        them, stop the backend, which ends the rest with their protocol's error event."""
        deadline = time.monotonic() + GRACE_S - 1
        if busy := self.backend.busy():  # said now: the drain may take seconds before "stopping"
            _say(f"stopping: {busy} answer{'s' if busy > 1 else ''} under way, given up to {GRACE_S - 1} s to end "
                 "(a second Ctrl-C ends them now)")
        while time.monotonic() < deadline and self.backend.busy():
            time.sleep(self.every)
        self.backend.close()

    def _report(self, change: Change) -> None:
        if change.state == "ready" and change.info is not None:
            info = change.info
            _say(f"{info.id} ready on {self.url} (ctx {info.ctx}, {info.slots} slots, {info.device})")
        elif change.state == "loading":
            _say(f"the worker stopped; loading the model again (restart {change.restarts})")
        elif change.state == "failed":
            _say(change.error if change.refused else f"the model did not load: {change.error}")


def _backend(launch: Launch) -> Backend:
    if not launch.in_process:
        # the HTTP layer re-sends a request lost before its client got output (once), so the
        # backend does not retry too
        return WorkerBackend(launch.model, launch.engine_options, hang_s=launch.settings.hang_s)
    from mashbox.facade import Engine  # torch loads in this process only with --in-process

    return InProcessBackend(served_id(launch.model), lambda: Engine(launch.model, **launch.engine_options))


def _reload_keys(settings: Settings) -> None:
    """SIGHUP: read the key file again; a file that does not read keeps the keys in use."""
    from mashbox.server.security import load_keys

    if not settings.key_file:
        _say("SIGHUP reads the key file again, and there is none (--api-key-file): nothing changed")
        return

    try:
        keys = load_keys(settings.key_file, os.environ.get("MASHBOX_API_KEY"))
    except ValueError as err:
        _say(f"kept the API keys in use: {err}")
        return
    settings.api_keys.replace(keys)  # type: ignore[attr-defined]  # a KeyRing
    _say(f"API keys read again from {settings.key_file}: {len(keys)} keys")


def _url(settings: Settings) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"


def _say(text: str) -> None:
    # the real stderr: with --in-process the loader swaps sys.stderr while it loads; one that nobody reads
    # any more (its terminal closed, `| head`) is no reason to stop serving, or to fail to stop
    with contextlib.suppress(OSError):
        print(f"mashbox: {text}", file=sys.__stderr__ or sys.stderr, flush=True)
