"""Tasks kept in SQLite (standard library): one row per task, its object as JSON, per tenant.

The file is opened on first use (a server that never sees a task never creates it). On open, tasks
that were running when the server stopped become ``failed``, unless another server has the file open
(a lock beside it, shared while each runs, tells): those may be its tasks, running. ``sweep`` ends
tasks left untouched for ``ttl_s``: unfinished ones become ``expired``, finished ones are deleted, so
the file stays bounded. A file deleted or moved away while the server runs (a cache cleared) is made
again where it was, with the tasks it held, read from the file still open.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from mashbox.api.task_items import FINAL
from mashbox.api.task_loop import EXPIRED as EXPIRED_CODE
from mashbox.api.task_loop import SERVER_STOPPED
from mashbox.engine.load.catalog import cache_dir
from mashbox.errors import InvalidRequestError, StorageError

log = logging.getLogger("mashbox.server")

SCHEMA = """CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, id TEXT NOT NULL, status TEXT NOT NULL,
    session_id TEXT NOT NULL, user_id TEXT NOT NULL, updated_at REAL NOT NULL, body TEXT NOT NULL,
    UNIQUE (tenant, id));
CREATE INDEX IF NOT EXISTS tasks_updated ON tasks (updated_at)"""
RUNNING = ("created", "queued", "working", "paused")
STOPPED = "the server stopped while this task was {}; create it again"
EXPIRED = {"code": EXPIRED_CODE, "message": "the task expired: nothing happened to it for the tasks' time to live"}


def path_of(given: str | None) -> Path:
    """Where the tasks are kept: ``given`` (``--tasks-db``), else ``tasks.sqlite3`` in the mashbox cache."""
    return Path(given) if given else cache_dir() / "tasks.sqlite3"


def check(path: Path) -> None:
    """Raise ValueError where ``path`` cannot hold the tasks: its folder cannot be made, or SQLite cannot
    open it as a database (a file that is none, a link to nowhere, a folder it cannot write in). Makes
    the folder and, where there was none, the (empty) database file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(_private(path))
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=rwc", uri=True)) as db:
            db.execute("PRAGMA schema_version")
    except (OSError, sqlite3.Error) as err:
        raise ValueError(f"tasks_db: {path} cannot hold the tasks ({err})") from None


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file ``path`` names now (its device and inode), or None where none."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _private(path: Path) -> int:
    """``path`` opened (a descriptor), made readable by its owner only: the tasks hold every tenant's answers
    (SQLite gives its journal the file's mode). One an earlier mashbox made 0644 is made 0600 too."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with contextlib.suppress(OSError):  # another user's file, shared through its group: left as it is
        os.fchmod(fd, 0o600)
    return fd


class TaskStore:
    def __init__(self, path: Path, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.path, self.ttl_s, self._clock = path, ttl_s, clock
        self._db: sqlite3.Connection | None = None
        self._file: tuple[int, int] | None = None  # the device and inode of the file ``_db`` has open
        self._holder: Any = None  # the lock file, held open (``_share``)
        self._lock = threading.RLock()

    def close(self) -> None:
        """Let the file go (its lock too)."""
        with self._lock:
            for held in (self._db, self._holder):
                if held is not None:
                    held.close()
            self._db = self._holder = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is not None and self._file != _identity(self.path):
            self._made_again(self._db)
        if self._db is None:
            self._db, self._holder, self._file, alone = self._open()
            if alone:
                self._fail_running()
        return self._db

    def _open(self) -> tuple[sqlite3.Connection, Any, tuple[int, int] | None, bool]:
        """A connection to the file at ``path`` (made, with its table, where there is none), its lock held shared
        (``_share``), which file it is (``_identity``), and whether no other server had it open."""
        db = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(_private(self.path))
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.executescript(SCHEMA)
            found = _identity(self.path)
            holder, alone = self._share()
        except (OSError, sqlite3.Error) as err:
            if db is not None:
                db.close()
            raise StorageError(f"the agent tasks cannot be kept in {self.path} ({type(err).__name__}: {err}); "
                               "start the server with --tasks-db naming a file it can write") from err
        return db, holder, found, alone

    def _made_again(self, old: sqlite3.Connection) -> None:
        """The file was deleted or moved away under the open connection ``old`` (SQLite then refuses every
        write): a new one at ``path`` gets the tasks the old one holds, read through ``old``, still open to it.
        Where another file took its place, that one is used as it is (someone put it there). Where no file can
        be made there yet, ``old`` stays, and the next call tries again."""
        gone = _identity(self.path) is None
        new, holder, found, _ = self._open()  # its tasks running are this server's: not failed
        if gone:
            try:
                old.backup(new)
            except sqlite3.Error as err:
                new.close()
                holder.close()
                self.path.unlink(missing_ok=True)  # an empty file left there would be taken for one put there
                raise StorageError(f"{self.path} was deleted or moved away, and copying its tasks to a new one "
                                   f"failed ({type(err).__name__}: {err})") from err
        old.close()
        self._holder.close()
        self._db, self._holder, self._file = new, holder, found
        log.warning("%s was %s while the server ran: %s", self.path, "deleted or moved away" if gone else "replaced",
                    "made again, with its tasks" if gone else "the new file is used")

    def _share(self) -> tuple[Any, bool]:
        """The file's lock, held shared with the other servers using it for as long as this one runs (the
        file it returns, held open); whether no other held it (then the tasks left running are those of
        servers that stopped)."""
        holder = os.fdopen(_private(self.path.with_name(self.path.name + ".lock")), "a+b")
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        fcntl.flock(holder, fcntl.LOCK_SH)
        return holder, alone

    def _fail_running(self) -> None:
        marks = ",".join("?" * len(RUNNING))
        with self._using("failing the tasks left running") as db:
            rows = db.execute(f"SELECT tenant, body FROM tasks WHERE status IN ({marks})", RUNNING).fetchall()
        for tenant, body in rows:
            task = json.loads(body)
            how = "paused" if task["status"] == "paused" else "running"
            error = {"code": SERVER_STOPPED, "message": STOPPED.format(how)}
            self.save(tenant, {**task, "status": "failed", "error": error})

    @contextlib.contextmanager
    def _using(self, what: str) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock; SQLite's errors (a full disk, a file gone read-only, locked by
        another program, overwritten) as ``StorageError`` naming the file and ``what`` failed."""
        with self._lock:
            db = self._conn()
            try:
                yield db
            except sqlite3.Error as err:
                said = str(err)
                fix = ("another program holds it locked: try again" if "locked" in said or "busy" in said else
                       "free space there, or start the server with --tasks-db naming another file" if "full" in said
                       else "start the server with --tasks-db naming a file it can write")  # read-only, damaged
                raise StorageError(f"{what} in {self.path} failed ({type(err).__name__}: {err}); {fix}") from err

    def save(self, tenant: str, task: dict[str, Any]) -> None:
        with self._using(f"saving task {task['id']}") as db:
            db.execute(
                "INSERT INTO tasks (tenant, id, status, session_id, user_id, updated_at, body) VALUES (?,?,?,?,?,?,?) "
                "ON CONFLICT (tenant, id) DO UPDATE SET status=excluded.status, updated_at=excluded.updated_at, "
                "body=excluded.body",
                (tenant, task["id"], task["status"], task.get("session_id", ""), task.get("user_id", ""),
                 self._clock(), json.dumps(task, ensure_ascii=False)))

    def get(self, tenant: str, task_id: str) -> dict[str, Any] | None:
        with self._using(f"reading task {task_id}") as db:
            row = db.execute("SELECT body FROM tasks WHERE tenant=? AND id=?", (tenant, task_id)).fetchone()
        return json.loads(row[0]) if row else None

    def delete(self, tenant: str, task_id: str) -> None:
        with self._using(f"deleting task {task_id}") as db:
            db.execute("DELETE FROM tasks WHERE tenant=? AND id=?", (tenant, task_id))

    def page(self, tenant: str, limit: int, after: str | None = None, before: str | None = None,
             statuses: Collection[str] = (), session_id: str | None = None,
             user_id: str | None = None) -> list[dict[str, Any]]:
        """Newest first; ``after`` / ``before`` are task ids (cursors) of the same listing."""
        where, args = ["tenant=?"], [tenant]
        for column, value in (("session_id", session_id), ("user_id", user_id)):
            if value is not None:
                where.append(f"{column}=?")
                args.append(value)
        if statuses:
            where.append(f"status IN ({','.join('?' * len(statuses))})")
            args += list(statuses)
        order = "ASC" if before is not None and after is None else "DESC"
        with self._using("listing the tasks") as db:
            for cursor, op, field in ((after, "<", "starting_after"), (before, ">", "ending_before")):
                if cursor is not None:
                    where.append(f"seq {op} ?")
                    args.append(self._seq(db, tenant, cursor, field))
            sql = f"SELECT body FROM tasks WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?"
            rows = db.execute(sql, [*args, limit]).fetchall()
        bodies = [json.loads(r[0]) for r in rows]
        return bodies[::-1] if order == "ASC" else bodies

    @staticmethod
    def _seq(db: sqlite3.Connection, tenant: str, task_id: str, field: str) -> int:
        """Where the task a cursor names lies in the listing; a cursor that names none is refused (listing
        from the start, or from nowhere, would be silently wrong)."""
        row = db.execute("SELECT seq FROM tasks WHERE tenant=? AND id=?", (tenant, task_id)).fetchone()
        if row is None:
            raise InvalidRequestError(field, f"no task {task_id!r} to page from (deleted, or expired): list again "
                                             "from the start")
        return row[0]

    def sweep(self, live: Collection[tuple[str, str]]) -> list[tuple[str, str]]:
        """Expire or delete tasks untouched for ``ttl_s``; the (tenant, id) of live ones found (their
        runs are the caller's to expire)."""
        cutoff = self._clock() - self.ttl_s
        with self._using("expiring old tasks") as db:
            rows = db.execute("SELECT tenant, id, status, body FROM tasks WHERE updated_at < ?",
                                        (cutoff,)).fetchall()
        found = []
        for tenant, task_id, status, body in rows:
            if (tenant, task_id) in live:
                found.append((tenant, task_id))
            elif status in FINAL:
                self.delete(tenant, task_id)
            else:
                self.save(tenant, {**json.loads(body), "status": "expired", "error": EXPIRED})
        return found
