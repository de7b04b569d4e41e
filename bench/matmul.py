"""One matmul call at decode and prefill shapes: mashbox's int8 kernel against torch's CPU kernels.

    OMP_NUM_THREADS=2 .venv/bin/python bench/matmul.py

For SmolLM2's shapes (the MLP's 576x3072 and 1536x576, the lm_head's 576x49152) at 1, 16 and 256
rows: microseconds per call for mashbox's int8 kernel, fbgemm's packed fp16 and MKL's fp32, and
torch's own 8-bit weight op (`_weight_int8pack_mm`); and whether a row gives the same bits alone
as inside the batch. Warm loops over one weight: upper bounds for a whole model.
"""

from __future__ import annotations

import time
import warnings

import torch

from mashbox.engine.model import native
from mashbox.engine.model.weights import Linear


def seconds(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def kernels(weight: torch.Tensor, lib) -> dict:
    q8 = Linear(weight, "q8", lib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = torch.fbgemm_pack_gemm_matrix_fp16(weight)
    bias = torch.zeros(weight.shape[0])
    scales = weight.abs().amax(1) / 127
    w8 = (weight / scales[:, None]).round().to(torch.int8)
    return {
        "mashbox int8": q8,
        "fbgemm fp16": lambda x: torch.fbgemm_linear_fp16_weight(x, packed, bias),
        "MKL fp32": lambda x: x @ weight.T,
        "torch int8 weight-only": lambda x: torch._weight_int8pack_mm(x, w8, scales),
    }


def main() -> None:
    warnings.filterwarnings("ignore", message=".*fbgemm.*deprecated")
    lib = native.load()
    if lib is None:
        raise SystemExit("mashbox's kernels could not be built here (no C compiler?)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    torch.manual_seed(0)
    for k, n in [(576, 3072), (1536, 576), (576, 49152)]:
        weight = torch.randn(n, k)
        for name, fn in kernels(weight, lib).items():
            cells = []
            for rows in (1, 16, 256):
                x = torch.randn(rows, k)
                t = seconds(lambda: fn(x), max(2, int(2e8 / (rows * k * n))))
                cells.append(f"{rows:>3} rows {t * 1e6:>9.0f} us {2 * rows * k * n / t / 1e9:6.1f} GF/s")
            batch = torch.randn(16, k)
            same = torch.equal(fn(batch[3:4]), fn(batch)[3:4])
            print(f"{k}x{n} {name:24s} {' | '.join(cells)} | row alone == in batch: {same}")


if __name__ == "__main__":
    main()
