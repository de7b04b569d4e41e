"""Prompt prefixes kept on disk, so a long prompt is prefilled once per machine, not per start.

A page holds the KV of ``page`` prompt tokens, [i * page, (i + 1) * page), and is named by a hash
of the namespace (model, weights, numerics), the tenant salt and every token up to the page's
end: a page is only ever used after exactly the tokens it was computed after. Pages are written
as they are computed (by a background thread: the engine only copies the slice), as safetensors
files, never pickles; a file is written whole (a temp file of the writer's own, then a rename) and
read back only if its header names the same key, its tokens are the prompt's, its tensors are of the
model's shape and their checksum is the one written. A file that does not read is skipped with a log line
and removed (where it cannot be, it is a miss from then on). A page that cannot be written (a full or
read-only disk) is not kept, said once until one is again, and the engine goes on. Only files named as
pages are ever counted or removed: the folder may hold others.

Several processes may share the folder (the replicas of a host): each sees the pages the others
wrote (a page missing from its index is looked for on disk), a page one of them removed is a miss,
and the cap holds for the folder: a writer counts the folder again before it trims, and at least
each ``cap / RESCAN`` bytes it wrote. Least recently used out first, by the files' times (a read
touches its file, and so does a prompt served from memory whose pages are on disk: the prefix used most,
never read back while the engine runs, would otherwise be the oldest on disk and the first trimmed).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
import zlib
from array import array
from collections import OrderedDict
from pathlib import Path

import torch

from mashbox.engine.load.catalog import remove_stale

log = logging.getLogger("mashbox.engine")

FORMAT = "mashbox-kv-page/2"  # 2: a checksum in the header (pages of 1 are other keys: misses)
RESCAN = 16  # a writer counts the folder again after writing cap / RESCAN bytes, whatever its index says
STUCK = 3  # pages in a row that cannot be removed: the folder cannot be trimmed now
ROOM = 1 << 30  # free bytes a page must leave on its disk (the cap may be more than a small disk has)
PAGE_NAME = re.compile(r"[0-9a-f]{40}")  # a page's file is named by its key: the folder may hold other files
QUEUED_BYTES = 256 << 20  # pages waiting for the writer, at most: past it (a slow or failing disk) pages are not kept
TOUCH_S = 60.0  # a page used from memory is touched on disk at most this often
TOUCHED = 1 << 16  # pages whose last touch is remembered, at most


class PageStore:
    """The pages of one namespace in ``folder``, at most ``cap_bytes`` of them (all namespaces). ``form``:
    the (shape, dtype) of a page's keys and of its values, where known; a page of another is not read."""

    def __init__(self, folder: Path, cap_bytes: int, namespace: str, page: int,
                 form: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()) -> None:
        self.folder, self.cap, self.namespace, self.page, self.form = folder, cap_bytes, namespace, page, form
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._written = 0  # bytes written since the folder was last counted
        self._queued = 0  # bytes of the pages waiting for the writer
        self._broken: set[str] = set()  # pages that do not read and could not be removed: misses, said once
        self._short = False  # whether the disk has too little room for pages (said once)
        self._failing = False  # whether the last page failed to be written (said once)
        self._touched: OrderedDict[str, float] = OrderedDict()  # key -> when last touched for a use from memory
        self._scan()
        self._writes: queue.SimpleQueue[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor] | list[str] | None] = \
            queue.SimpleQueue()  # pages to write, or (a list) keys to touch
        self._writer = threading.Thread(target=self._write_all, name="mashbox-disk-cache", daemon=True)
        self._writer.start()

    @property
    def bytes(self) -> int:
        return sum(self._files.values())

    def keys(self, prompt: list[int] | tuple[int, ...], salt: str, limit: int | None = None) -> list[str]:
        """The key of each whole page of ``prompt`` (of its first ``limit`` tokens)."""
        digest = hashlib.sha256(f"{FORMAT}\0{self.namespace}\0{salt}\0".encode())
        out = []
        for end in range(self.page, (len(prompt) if limit is None else limit) + 1, self.page):
            digest.update(array("i", prompt[end - self.page: end]).tobytes())
            out.append(digest.copy().hexdigest()[:40])
        return out

    def stored(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, have a page on disk."""
        return next((i for i, key in enumerate(keys) if not self._has(key)), len(keys))

    def _has(self, key: str) -> bool:
        with self._lock:  # a page claimed but not yet written (0 bytes) is not there yet
            if key in self._broken:
                return False
            if self._files.get(key):
                return True
            if key in self._files:
                return False
        try:  # written by another process sharing the folder
            size = self._path(key).stat().st_size
        except OSError:
            return False
        with self._lock:
            self._files.setdefault(key, size)
        return True

    def read(self, keys: list[str], prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values [layers, tokens, kv_heads, head_dim] of the pages ``keys``, from the
        first; None where the first does not read."""
        from safetensors import safe_open

        parts = []
        for i, key in enumerate(keys):
            path = self._path(key)
            if key in self._broken:
                break
            try:
                with safe_open(str(path), framework="pt") as file:
                    header = file.metadata()
                    if header.get("key") != key:
                        raise ValueError("its header names another key")
                    tokens = file.get_tensor("tokens").tolist()
                    if tokens != list(prompt[i * self.page: (i + 1) * self.page]):
                        raise ValueError("its tokens are not the prompt's")
                    kv = (file.get_tensor("keys"), file.get_tensor("values"))
                    if self.form and tuple((tuple(t.shape), t.dtype) for t in kv) != self.form:
                        raise ValueError("its keys and values are not of this model's shape")
                    if header.get("sum") != _sum(*kv):
                        raise ValueError("its keys and values are not those written (their checksum differs)")
                    parts.append(kv)
            except Exception as err:  # a file cut short, overwritten, foreign; or removed meanwhile
                if path.exists() and not isinstance(err, FileNotFoundError):
                    log.warning("skipped the cached prompt page %s (%s: %s); removing it", path, type(err).__name__, err)
                    if not self._remove(key):
                        with self._lock:
                            self._broken.add(key)
                else:  # by another process's trim (and maybe written again since): a miss
                    self._forget(key)
                break
        self._used(keys[: len(parts)])
        if not parts:
            return None
        return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)

    def touch(self, keys: list[str]) -> None:
        """Pages of a prompt the engine served from memory, marked used (by the writer, each at most every
        ``TOUCH_S``): the prefix used most is never read back from disk while the engine runs."""
        now = time.monotonic()
        with self._lock:
            due = [key for key in keys if now - self._touched.get(key, -TOUCH_S) >= TOUCH_S]
            for key in due:
                self._touched[key] = now
                self._touched.move_to_end(key)
            while len(self._touched) > TOUCHED:
                self._touched.popitem(last=False)
        if due:
            self._writes.put(due)

    def _used(self, keys: list[str]) -> None:
        """A prompt's pages ``keys`` marked most recently used, the first of them the most: a trim takes a
        prompt's last pages before its first, which they need."""
        now = time.time_ns()
        for i, key in enumerate(reversed(keys)):
            with contextlib.suppress(OSError):  # trimmed by another process since, or the folder read-only now:
                os.utime(self._path(key), ns=(now + i * 1000,) * 2)  # a touch is no reason to fail (the clock's
                # ticks are coarser than a read)
            with self._lock:
                if key in self._files:
                    self._files.move_to_end(key)

    def save(self, key: str, tokens: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a page in the background (``keys``/``values`` are the engine's own copy)."""
        if self._has(key):  # here, or written by another process
            return
        size = keys.nbytes + values.nbytes
        with self._lock:
            if key in self._files or key in self._broken or self._queued + size > QUEUED_BYTES:
                return
            self._files[key] = 0  # claimed: not written twice
            self._queued += size
        self._writes.put((key, torch.tensor(tokens, dtype=torch.int32), keys, values))

    def close(self) -> None:
        """Finish the writes queued so far."""
        self._writes.put(None)
        self._writer.join(timeout=60)

    def _write_all(self) -> None:
        from safetensors.torch import save_file

        while (item := self._writes.get()) is not None:
            if isinstance(item, list):
                self._used(item)
                continue
            key, tokens, keys, values = item
            with self._lock:
                self._queued -= keys.nbytes + values.nbytes
            if not self._room(keys.nbytes + values.nbytes):
                self._forget(key)
                continue
            path, tmp = self._path(key), self.folder / f".{key}.{uuid.uuid4().hex[:12]}.tmp"
            try:  # safetensors says a full disk as its own error, not OSError: any failure is a page not kept
                self.folder.mkdir(parents=True, exist_ok=True)  # removed meanwhile (by hand): made again
                save_file({"tokens": tokens, "keys": keys, "values": values}, str(tmp),
                          metadata={"key": key, "format": FORMAT, "sum": _sum(keys, values)})
                os.replace(tmp, path)
                os.utime(path, ns=(time.time_ns(),) * 2)  # the clock reads touch pages by: the file system's
                size = path.stat().st_size  # own may be a tick behind it, and a page just written look older
            except Exception as err:
                if not self._failing:  # once, not once a page: said again after a page is kept
                    log.warning("could not keep prompt pages on disk in %s (%s: %s)", self.folder,
                                type(err).__name__, err)
                self._failing = True
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
                self._forget(key)
                continue
            self._failing = False
            with self._lock:
                self._files[key] = size
                self._written += size
            self._trim()

    def _room(self, size: int) -> bool:
        """Whether the disk keeps ``ROOM`` free after a page of ``size`` bytes; said once as it stops doing so."""
        try:
            free = shutil.disk_usage(self.folder).free
        except OSError:
            return True  # a write says what is wrong
        if free - size >= ROOM:
            self._short = False
            return True
        if not self._short:
            log.warning("prompt pages are not kept in %s while its disk has less than %d GiB free", self.folder,
                        ROOM >> 30)
            self._short = True
        return False

    def _trim(self) -> None:
        """Remove the least recently used pages until the folder fits its cap (counted again first)."""
        if self.bytes <= self.cap and self._written * RESCAN <= self.cap:
            return
        self._scan()
        stuck = 0
        while stuck < STUCK:  # pages in a row that stay: a folder that cannot be trimmed (read-only now),
            with self._lock:  # tried again after the next write; one that stays alone is passed over
                if self.bytes <= self.cap or len(self._files) <= 1:
                    return
                key = next(iter(self._files))
            stuck = 0 if self._remove(key) else stuck + 1

    def _scan(self) -> None:
        """The index read again from the folder, least recently used first; stale temp files removed."""
        files = OrderedDict()
        pages = [(path, stat) for path, stat in _stats(self.folder, "*.safetensors") if PAGE_NAME.fullmatch(path.stem)]
        for path, stat in sorted(pages, key=lambda item: item[1].st_mtime):
            if stat.st_size:
                files[path.stem] = stat.st_size
            else:  # written whole then renamed, a page is never empty: this one lost its bytes (a crash)
                log.warning("skipped the cached prompt page %s (it is empty); removing it", path)
                _unlink(path)
        ours = [path for path in self.folder.glob(".*.tmp") if PAGE_NAME.fullmatch(path.name.split(".")[1])]
        remove_stale([*ours, *self.folder.glob(".tmp*")])  # ours (.key.id.tmp, older: .key.tmp), safetensors'
        with self._lock:  # pages claimed here and not yet written stay claimed
            claimed = {key: 0 for key, size in self._files.items() if size == 0 and key not in files}
            self._files = OrderedDict({**claimed, **files})
            self._written = 0

    def _remove(self, key: str) -> bool:
        """Remove a page; False where its file stays (a read-only folder, a directory in its place)."""
        self._forget(key)
        return _unlink(self._path(key))

    def _forget(self, key: str) -> None:
        with self._lock:
            self._files.pop(key, None)

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"


def _sum(keys: torch.Tensor, values: torch.Tensor) -> str:
    """A page's checksum (CRC-32 of its keys' and values' bytes, ~1.4 GB/s): bytes a disk lost or changed
    after the page was written read back as another prompt's KV, answers of garbage with no word said."""
    crc = 0
    for t in (keys, values):
        crc = zlib.crc32(t.contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def _unlink(path: Path) -> bool:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        log.warning("could not remove %s (%s)", path, err)
        return False
    return True


def _stats(folder: Path, pattern: str) -> list[tuple[Path, os.stat_result]]:
    """Each file of ``folder`` matching ``pattern`` with its stat (files removed meanwhile left out)."""
    out = []
    for path in folder.glob(pattern):
        try:
            out.append((path, path.stat()))
        except OSError:
            continue
    return out
