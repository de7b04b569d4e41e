"""Memory a KV cache needs and memory the device has free: checked before the cache is allocated,
so that a context too large for the machine is one clear error, not minutes of allocation."""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

from mashbox.engine.load.checkpoint import Spec
from mashbox.engine.model.form import Form
from mashbox.errors import ConfigError


class HeapTrim:
    """Gives the C heap's free pages back to the system after the prefix cache dropped host entries: at most
    every ``every`` s, on a thread of its own. glibc keeps the holes that entries of every size leave (its
    moving mmap threshold puts all but the largest on the heap), and a busy server's memory crept past the
    cache's cap: +450 MB over 2,500 requests on SmolLM2, +14 MB each 250 more; one ``malloc_trim`` (47 ms,
    off the engine's thread) gave it all back."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self._last = -every
        self._thread: threading.Thread | None = None

    def freed(self) -> None:
        now = time.monotonic()
        if now - self._last < self.every or self._thread is not None and self._thread.is_alive():
            return
        self._last = now
        self._thread = threading.Thread(target=give_back, name="mashbox-trim", daemon=True)
        self._thread.start()


def give_back() -> None:
    """glibc's ``malloc_trim(0)``: every arena's free pages back to the system (a no-op elsewhere)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None
    if trim is not None:
        trim(0)


def kv_bytes_per_token(spec: Spec, form: Form) -> int:
    """Bytes of keys and values one token position holds over all layers."""
    return 2 * spec.num_layers * spec.num_kv_heads * form.kv_row(spec.head_dim) * form.kv_dtype.itemsize


def room(device: torch.device, meminfo: Path = Path("/proc/meminfo"), cgroups: Path = Path("/proc/self/cgroup"),
         root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, str]:
    """Bytes free for a new allocation on ``device`` (None where that cannot be told), and what bounds them: on
    the CPU the least of the machine's free memory, what its cgroup (a container's limit) leaves and what its
    address-space limit (``ulimit -v``) leaves."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], str(device)
    machine = _machine_room(meminfo)
    rooms = [(machine, "this machine") if machine is not None else (_physical(), WHOLE),
             (_address_room(), "this process's address space (ulimit -v)"),
             *((free, "this process's cgroup (its memory limit)") for free in _cgroup_rooms(cgroups, root))]
    known = [(free, where) for free, where in rooms if free is not None]
    return min(known) if known else (None, "this machine")


def _machine_room(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    found = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    return found[0] if found else None


WHOLE = "this machine (in all: what is free cannot be read here)"


def _physical() -> int | None:
    """The machine's whole memory, where its free memory cannot be read (no /proc/meminfo: macOS)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


# a cgroup's files: its limit, its use, and the file cache in its use that can be let go (v2, then v1)
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _cgroup_rooms(cgroups: Path, root: Path) -> list[int | None]:
    """What this process's memory cgroup and each one above it leave free under their limits."""
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            bases, names = (root, root / "unified"), _V2
        elif "memory" in controllers.split(","):
            bases, names = (root / "memory",), _V1
        else:
            continue
        for base in bases:  # inside a container the mount may be the process's own cgroup, not its path
            leaf = base / path.lstrip("/")
            rooms += [_cgroup_room(folder, names) for folder in (leaf, *leaf.parents) if folder.is_relative_to(base)]
    return rooms


def _cgroup_room(folder: Path, names: tuple[str, str, str]) -> int | None:
    limit_file, used_file, cache_key = names
    try:
        limit = (folder / limit_file).read_text().strip()
        used = int((folder / used_file).read_text())
        stat = dict(line.split()[:2] for line in (folder / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 2**60:  # no limit (v1 says so with a number near 2**63)
        return None
    return max(int(limit) - used + int(stat.get(cache_key, 0)), 0)


ADDRESS_HEADROOM = 2**30  # what the process maps after its KV cache: threads' arenas and stacks, a step's work


def _address_room(status: Path = Path("/proc/self/status")) -> int | None:
    """What an address-space limit (``ulimit -v``) leaves of this process's, less what it maps later (the
    cache given all of it, the first request failed its allocations: SIGABRT, over and over)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        size = next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines()
                    if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None
    return max(limit - size - ADDRESS_HEADROOM, 0)


GPU_WORK = 2**30  # beside the KV cache on a GPU: cuBLAS's workspace, the CUDA graphs' pool, a step's logits


def check_fits(ctx: int, slots: int, per_token: int, free: int | None, where: str, layers: int | None = None) -> None:
    """Refuse a KV cache of ``ctx`` x ``slots`` tokens that needs more than ``free`` bytes; on a GPU (``layers``:
    the model's) with room for a step's work too: attention's copies of a layer's keys and values for every row
    (twice: masked), and ``GPU_WORK`` (a cache that took all the memory free failed its first long step)."""
    per, work = (per_token * (1 + 2 / layers), GPU_WORK) if layers else (per_token, 0)
    need = int(ctx * slots * per) + work
    if free is None or need <= free:
        return
    fits = int(max(free - work, 0) // (slots * per))
    lower = f"lower ctx (at most {fits} fits with {slots} slots) or slots" if fits >= 16 else "lower slots and ctx"
    what = "of KV cache and a step's work" if layers else "of KV cache"
    raise ConfigError(f"ctx {ctx} x {slots} slots needs {_gib(need)} {what} but {where} has {_gib(free)} free; "
                      f"{lower}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
