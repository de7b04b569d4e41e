"""Two versions of the CPU kernels side by side in one process: the matmul's time at 1, 4, 16 and 64
rows (or --rows) for each block format, on one thread and a weight that stays in cache, so the kernels' own
arithmetic is what differs (bench/kernel_speed.py measures them reading from memory).

    OMP_NUM_THREADS=1 .venv/bin/python bench/kernel_ab.py [--base HEAD] [--formats Q4_K Q6_K ...] [--cold]

``--cold`` empties the caches before each call (a numpy pass over 64 MB, not timed: a torch op would
leave OpenMP's threads spinning beside the kernels), so the weight and the output come from and go
to memory as in a decode step, where the layers before have evicted them.

``--base`` is a git revision: its kernels.c, against the working tree's. Both are built with the
compiler and flags mashbox builds with; each shape's rounds alternate between them and the best of each counts.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from quants import FORMATS, random_blocks  # noqa: E402

from mashbox.engine.model import native, quant  # noqa: E402
from mashbox.engine.model.weights import Linear  # noqa: E402

SHAPES = [(512, 1536), (256, 8960)]  # (N, K): rows 1536 wide (attention, gate, up), 8960 wide (down)


def build(source: str, folder: Path, name: str) -> ctypes.CDLL:
    src, lib = folder / f"{name}.c", folder / f"{name}.so"
    src.write_text(source)
    subprocess.run([native.find_compiler() or "cc", *native.FLAGS, str(src), "-o", str(lib), "-lm"], check=True)
    return native.bind(ctypes.CDLL(str(lib)))


def seconds_each(fn, x: torch.Tensor, reps: int, flush: np.ndarray | None = None) -> float:
    """The mean time of ``reps`` calls; with ``flush``, the median call, each after a pass over it (not timed)."""
    fn(x)
    if flush is None:
        start = time.perf_counter()
        for _ in range(reps):
            fn(x)
        return (time.perf_counter() - start) / reps
    times = []
    for _ in range(reps):
        np.add(flush, 1, out=flush)
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--formats", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0"],
                        choices=sorted(FORMATS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64],
                        help="activation rows (default 1 4 16 64)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="empty the caches before each call")
    args = parser.parse_args()
    old = subprocess.run(["git", "show", f"{args.base}:mashbox/engine/model/kernels.c"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        libs = {args.base: build(old, Path(folder), "base"), "working tree": build(native.SOURCE.read_text(),
                                                                                   Path(folder), "tree")}
        flush = np.zeros(64 << 18, dtype=np.float32) if args.cold else None
        print(f"threads {torch.get_num_threads()}; microseconds a matmul, best of {args.rounds} rounds"
              + (", caches emptied before each" if args.cold else ""))
        for name in args.formats:
            for n, k in SHAPES:
                if k % quant.FORMATS[FORMATS[name]][1]:
                    continue
                blocks = random_blocks(name, n, k, seed=1)
                linears = {v: Linear("blocks", lib=lib, parts=[quant.pack(blocks, lib)]) for v, lib in libs.items()}
                for m in args.rows:
                    x = torch.randn(m, k)
                    best = dict.fromkeys(linears, float("inf"))
                    for _ in range(args.rounds):
                        for v, linear in linears.items():
                            reps = 10 if args.cold else 200 // m + 10
                            best[v] = min(best[v], seconds_each(linear, x, reps, flush))
                    base, tree = best.values()
                    print(f"{name:5} {n}x{k} rows {m:3}: {args.base} {base * 1e6:8.1f}  working tree {tree * 1e6:8.1f}"
                          f"  {base / tree:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
