"""GF/s of mashbox's Q4_1 and int8 matmul kernels at 1, 16 and 256 rows (a random weight, 2 threads).

    OMP_NUM_THREADS=2 .venv/bin/python bench/kernel_speed.py

Run it from two checkouts in turn (PYTHONPATH=<checkout>) to compare kernels side by side.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_native import q41_blocks

from mashbox.engine import blocks, native
from mashbox.engine.weights import Linear

SHAPES = {"q41": [(576, 3072), (1536, 576), (576, 960)], "q8": [(896, 4864), (576, 49152)]}


def linear(form: str, k: int, n: int, lib) -> Linear:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    if form == "q8":
        return Linear(weight, "q8", lib)
    rows = q41_blocks(weight)
    return Linear(blocks.dequantize(rows), "gguf", lib, rows)


def seconds(fn, x: torch.Tensor) -> float:
    reps, best = max(3, 2000 // x.shape[0]), float("inf")
    fn(x)
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn(x)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    lib = native.load()
    assert lib is not None, "the kernels need a C compiler"
    for form, shapes in SHAPES.items():
        for k, n in shapes:
            lin = linear(form, k, n, lib)
            for m in (1, 16, 256):
                t = seconds(lin, torch.randn(m, k))
                print(f"{form:4} {k}x{n} rows {m:3}: {t * 1e6:9.0f} us {2 * m * n * k / t / 1e9:6.1f} GF/s", flush=True)


if __name__ == "__main__":
    main()
