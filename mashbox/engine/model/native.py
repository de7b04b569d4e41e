"""mashbox's own CPU kernels (``kernels.c``), compiled once per machine and called through ctypes.

torch offers no fast one-row matmul over 8-bit weights on every CPU (see docs/performance.md), so
the decode step's matmuls and attention run in a small C file built with the machine's C compiler
on first use and kept under ``<cache>/kernels/`` (keyed by the source, the compiler and the CPU).
Without a C compiler, or with ``MASHBOX_NATIVE=0``, ``load()`` returns None and mashbox runs its
torch kernels instead. The library links the OpenMP runtime torch itself loaded, so both share
one pool of threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from mashbox.engine.load.catalog import cache_dir, remove_stale
from mashbox.errors import ConfigError

log = logging.getLogger("mashbox.engine")
SOURCE = Path(__file__).with_name("kernels.c")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "mb_matmul": (_P, _P, _P, _I, _I),
    "mb_dequantize": (_P, _I, _P, _I, _I, _P),
    "mb_pack": (_P, _I, _I, _I, _P),
    "mb_q8_quantize": (_P, _P, _I, _I),
    "mb_decode_attention": (_P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I, _I, _I, _F),
    "mb_chunk_attention": (_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I, _I, _I, _F),
    "mb_kv_store": (_P, _I, _P, _P, _P, _I, _I, _I, _I, _I),
    "mb_layer": (_P, _I, _I, _I, _I, _I, _I, _F, _F, *[_P] * 13, _I, _I, _I, _I, _P, _P, _P, _P, _I, _F, _F),
    "mb_rms_norm": (_P, _P, _P, _I, _I, _F),
    "mb_argmax": (_P, _I, _I, _P),
    "mb_rope": (_P, _I, _P, _P, _P, _I, _I, _I),
    "mb_silu_mul": (_P, _P, _I, _I),
    "mb_gelu_mul": (_P, _P, _I, _I),
}

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-pthread", "-ffp-contract=off")

@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, building them if needed; None where they cannot be built (``off``, or a build
    that failed: logged)."""
    if (why := off()) is not None:
        log.info("mashbox's CPU kernels are off (%s): torch's are used", why)
        return None
    compiler = find_compiler()
    try:
        return bind(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError, ConfigError) as err:
        log.warning("mashbox's CPU kernels could not be built (%s): torch's are used", _why(err))
        return None


def off() -> str | None:
    """Why the kernels are not built here, before trying (None: they are tried)."""
    if os.environ.get("MASHBOX_NATIVE", "1") == "0":
        return "MASHBOX_NATIVE=0"
    if platform.system() != "Linux":
        return f"they are built on Linux only, not {platform.system()}"
    return None if find_compiler() else "no C compiler found"


def _why(err: Exception) -> str:
    """What stopped a build: the compiler's own last lines where it failed."""
    said = getattr(err, "stderr", None)
    lines = said.decode(errors="replace").strip().splitlines()[-3:] if isinstance(said, bytes) else []
    return " / ".join([str(err), *lines])


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A build of the kernels, its functions given their signatures."""
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.mb_attention_bf16.argtypes, lib.mb_attention_bf16.restype = (), ctypes.c_int
    lib.mb_group_rows.argtypes, lib.mb_group_rows.restype = (), ctypes.c_int
    lib.mb_amx.argtypes, lib.mb_amx.restype = (), ctypes.c_int
    lib.mb_attention_amx.argtypes, lib.mb_attention_amx.restype = (), ctypes.c_int
    lib.mb_packed_bytes.argtypes, lib.mb_packed_bytes.restype = (_I, _I, _I), _I
    return lib


def source_hash() -> str:
    """A hash of the kernels' source: what they compute follows it (a build is named by it; the
    prefix cache's disk pages are kept apart by it)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _build(compiler: str) -> Path:
    key = hashlib.sha256((source_hash() + compiler + _cpu_id()).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"kernels-{key}.so"
    remove_stale(target.parent.glob("tmp*.so"))  # a build whose process was killed (its compiler ran on)
    if _whole(target):
        return target
    if target.exists():  # loaded, a file cut short faults the process (SIGBUS) at the first call
        log.warning("the kernels file %s is damaged (cut short): building it again", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True,
                       capture_output=True, timeout=120)
        with open(tmp, "rb") as built:  # on the disk before its name is: a crash leaves no file cut short
            os.fsync(built.fileno())
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _whole(path: Path) -> bool:
    """Whether ``path`` is a 64-bit ELF file as long as its header says (its section table, at its end, in it)."""
    try:
        with path.open("rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 64 or head[:5] != b"\x7fELF\x02":
        return False
    table, entry, count = struct.unpack_from("<Q", head, 0x28)[0], *struct.unpack_from("<HH", head, 0x3A)
    return size >= table + entry * count


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "".join(sorted(set(lines)))


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()
