"""GF/s and GB/s of mashbox's matmul over each block format, at 1, 16 and 256 rows (random blocks,
all threads), on the matrix shapes of Qwen2.5-1.5B (1536 wide, 8960 for the MLP's down).

    OMP_NUM_THREADS=2 .venv/bin/python bench/kernel_speed.py [--formats Q4_K Q6_K ...] [--shape K N] [--rows 1 16]

``--shape K N`` measures that shape alone (Gemma 3's lm_head: ``--formats Q8_0 --shape 640 262144``);
``--cached`` takes one copy, read again and again: for a matrix the caches hold, the arithmetic alone.

Each pass reads its matrix from memory as a decode step does: the matrix has copies enough to fill
COPIES_BYTES (well over a last-level cache), taken in turn.
Run it from two checkouts in turn (PYTHONPATH=<checkout>) to compare kernels side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quants import FORMATS, random_blocks

from mashbox.engine.model import native
from mashbox.engine.model.weights import Linear

SHAPES = [(1536, 17920), (8960, 1536)]  # (K, N): gate and up together; down
COPIES_BYTES = 256 << 20


def seconds(fns: list, x: torch.Tensor) -> float:
    """The best time of one matmul, over passes that take the copies in turn."""
    reps, best = max(len(fns), 64 // x.shape[0]), float("inf")
    for fn in fns:
        fn(x)
    for _ in range(3):
        start = time.perf_counter()
        for i in range(reps):
            fns[i % len(fns)](x)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", nargs="+", default=["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"],
                        choices=sorted(FORMATS))
    parser.add_argument("--shape", type=int, nargs=2, metavar=("K", "N"), help="one shape instead of 1.5B's two")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--cached", action="store_true", help="one copy of the matrix, not copies past the caches")
    args = parser.parse_args()
    lib = native.load()
    assert lib is not None, "the kernels need a C compiler"
    for name in args.formats:
        for k, n in [tuple(args.shape)] if args.shape else SHAPES:
            blocks = random_blocks(name, n, k, seed=1)
            count = 1 if args.cached else -(-COPIES_BYTES // blocks.data.nbytes)
            copies = [Linear("blocks", lib=lib, parts=[blocks]) for _ in range(count)]
            for m in args.rows:
                t = seconds(copies, torch.randn(m, k))
                print(f"{name:5} {k}x{n} rows {m:3}: {t * 1e3:7.2f} ms {2 * m * n * k / t / 1e9:6.1f} GF/s "
                      f"{blocks.data.nbytes / t / 1e9:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
