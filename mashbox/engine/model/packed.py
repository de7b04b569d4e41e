"""The kernels' packed copies of a model's matrices, kept in a file so that a later start maps them.

Packing a model (``quant.pack``: the same blocks, rearranged for the kernels) reads every matrix of
the file and writes as many new bytes: ~0.3 s for a 0.5B Q4_K_M model here, ~0.6 s for a 1.5B one,
most of it the kernel handing out fresh pages. So the first start saves what it packed in one file
under the cache folder, named for the weights and the kernels' build; a later start maps that file
and packs nothing. Mapped, the packed matrices are the page cache's pages: replicas of one model share
them, and the kernels read them at least as fast as the anonymous copies.

The file: each packed matrix at a 4096-byte boundary, in the order the model packs them; then an
index (JSON: the weights it was made from, and each matrix's format, rows, width, offset and bytes),
its offset (8 bytes) and ``MAGIC``. A matrix whose description differs from the index's next entry
(a file made by other code) is packed in memory, and the file made again.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import time
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mashbox.engine.load.catalog import stamps
from mashbox.engine.model import quant

MAGIC = b"MBPACK01"
ALIGN = 4096
SUFFIX = ".mbpack"
ROOM = 2 << 30  # free bytes a saved file must leave on its disk
HALF_WRITTEN_S = 600  # a temporary file this old was left by a start that stopped while writing it
TAIL = struct.Struct("<Q8s")  # the index's offset, MAGIC
log = logging.getLogger("mashbox.engine")


class Packer:
    """Packs a model's matrices for the kernels in order: as views of ``path`` where it was saved by
    an earlier start, else in memory (``save`` then writes them there). ``path`` None: in memory only."""

    def __init__(self, lib: ctypes.CDLL, path: Path | None = None, origin: dict[str, Any] | None = None) -> None:
        self.lib, self.path, self.origin = lib, path, origin or {}  # origin: the weights' path, stamps and form
        self._saved, self._data = _index(path) if path is not None else ([], None)
        self._made: list[quant.Blocks] = []  # every packed matrix, in order
        self._new = False  # whether any was packed here: the file is (re)written

    @classmethod
    def kept(cls, lib: ctypes.CDLL, folder: Path, weights: Path, mode: str) -> Packer:
        """A packer whose file, in ``folder``, is named for ``weights`` (a GGUF, or an HF folder): its
        path, then its files' ``stamp``, the weights' form and the kernels' build (the layout is theirs).
        Files left half-written by a start that stopped while writing are removed."""
        weights = weights.resolve()
        made = stamps(weights)
        if made is None:  # weights that cannot be listed are packed in memory
            return cls(lib)
        _remove_half_written(folder)
        key = sha256(json.dumps([made, Path(lib._name).name, mode]).encode()).hexdigest()[:16]
        return cls(lib, folder / f"{_prefix(weights)}-{key}{SUFFIX}", {"source": str(weights), "made": made,
                                                                        "mode": mode})

    def pack(self, blocks: quant.Blocks) -> quant.Blocks:
        """``blocks`` packed for the kernels (as ``quant.pack``): the saved file's next matrix where it is
        this one, else packed now."""
        size = quant.packed_bytes(blocks, self.lib)
        if not size:
            return blocks
        at = len(self._made)
        entry = self._saved[at] if at < len(self._saved) else None
        if entry is not None and entry[:3] == [blocks.fmt, blocks.rows, blocks.k] and entry[4] == size:
            packed = quant.as_packed(blocks, self._data[entry[3] : entry[3] + size], self.lib)
        else:
            self._saved, self._new = [], True  # the file no longer follows this model's order
            packed = quant.pack(blocks, self.lib)
        self._made.append(packed)
        return packed

    def save(self) -> None:
        """Write every packed matrix to ``path`` where any was packed here (not from the file): atomically,
        and the files of earlier kernels or weights of the same name removed. A failure (no room, no
        right to write) is logged; the model runs from memory all the same."""
        if self.path is None or not self._new or not self._made:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            size = sum(p.data.numel() for p in self._made)
            if shutil.disk_usage(self.path.parent).free < size + ROOM:
                log.info("the packed weights (%.1f GB) are not saved in %s: the disk would have less than %d "
                         "GiB free; every start packs them", size / 1e9, self.path.parent, ROOM >> 30)
                return
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.stem, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    _write(f, self._made, self.origin)
                    _let_go(f)
                os.replace(tmp, self.path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except OSError as err:
            log.warning("the packed weights could not be saved to %s (%s): the next start packs them again",
                        self.path, err)
            return
        _prune(self.path, self.origin)
        log.info("packed weights saved to %s: the next start maps them", self.path)


def _prefix(weights: Path) -> str:
    return f"{weights.stem}-{sha256(os.fsencode(weights)).hexdigest()[:8]}"


def _write(f, made: list[quant.Blocks], origin: dict[str, Any]) -> None:
    entries = []
    for blocks in made:
        f.seek(-(-f.tell() // ALIGN) * ALIGN)
        data = blocks.data.reshape(-1)
        entries.append([blocks.fmt % quant.PACKED, blocks.rows, blocks.k, f.tell(), data.numel()])
        f.write(memoryview(data.numpy()))
    at = f.tell()
    f.write(json.dumps({**origin, "matrices": entries}).encode())
    f.write(TAIL.pack(at, MAGIC))


def _let_go(f) -> None:
    """Put the written file on the disk and out of the page cache. Written a matrix at a time, its cached
    pages are mostly of 4 KB (a 2 MB page needs one write to fill it), and a later start's mapping would
    use them as they are: read anew, the mapping brings the file in 2 MB pages (qwen2.5-coder-0.5b's layers
    at one row: 14.1 -> 12.3 ms a step, fewer misses of the TLB)."""
    f.flush()
    os.fsync(f.fileno())
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _index(path: Path) -> tuple[list[list[int]], torch.Tensor | None]:
    """The saved matrices' entries and the file's bytes, mapped; ([], None) where there is no readable file."""
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never written back
    except (OSError, ValueError):  # none yet, or empty
        return [], None
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: pages read anew come in 2 MB pieces, fewer misses of the TLB
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            data.madvise(mmap.MADV_HUGEPAGE)
    try:
        matrices = _read(data)["matrices"]
    except UNREADABLE as err:
        log.warning("ignoring the packed weights in %s (%s): packing again", path, err)
        data.close()
        return [], None
    return matrices, torch.from_numpy(np.frombuffer(data, dtype=np.uint8))


UNREADABLE = (struct.error, ValueError, KeyError, TypeError)  # what _read raises on a file it cannot read


def _read(data: mmap.mmap) -> dict:
    """The index at the end of a packed file's bytes (checked: every matrix lies before it)."""
    at, magic = TAIL.unpack_from(data, len(data) - TAIL.size)
    if magic != MAGIC:
        raise ValueError("no index at its end")
    index = json.loads(data[at : len(data) - TAIL.size])
    if any(offset + size > at for _, _, _, offset, size in index["matrices"]):
        raise ValueError("a matrix runs past the index")
    return index


def _prune(kept: Path, origin: dict[str, Any]) -> None:
    """Remove the other packed files of these weights in this form (made for other kernels), those whose
    weights are gone or changed since, and temporary files left half-written."""
    _remove_half_written(kept.parent)
    for path in kept.parent.iterdir():
        if path.suffix != SUFFIX or path == kept:
            continue
        other = _origin(path)
        source = other.get("source")
        gone = not source or other.get("made") != stamps(Path(source))
        if gone or (source, other.get("mode")) == (origin["source"], origin["mode"]):
            path.unlink(missing_ok=True)


def _remove_half_written(folder: Path) -> None:
    """Remove the temporary files in ``folder`` that a start left half-written (old enough not to be another's
    being written)."""
    with contextlib.suppress(OSError):
        for path in folder.glob("*.tmp"):
            if _age(path) > HALF_WRITTEN_S:
                path.unlink(missing_ok=True)


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _origin(path: Path) -> dict[str, Any]:
    """What a packed file was made from: its index but the matrices ({} where unreadable)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            index = _read(data)
    except (OSError, *UNREADABLE):
        return {}
    return {k: v for k, v in index.items() if k != "matrices"}
