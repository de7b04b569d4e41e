"""How fast this machine reads memory: GB/s of a plain read of 1 GiB, on 1 and on all threads.

    .venv/bin/python bench/memory_read.py

The roofline for a decode step at one stream, which reads every weight once: bench/compare.py
prints it beside the GB/s each server reaches. Built with the machine's C compiler and OpenMP
(vector loads summed, so nothing is optimised away), best of 5 passes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int64_t v8 __attribute__((vector_size(64)));
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
    size_t n = (size_t)1 << 30, words = n / sizeof(v8);
    v8 *p = aligned_alloc(64, n);
#pragma omp parallel for
    for (size_t i = 0; i < words; i++) p[i] = (v8){(int64_t)i};
    double best = 1e9;
    int64_t total = 0;
    for (int pass = 0; pass < 5; pass++) {
        double t = now();
        v8 sum = {0};
#pragma omp parallel
        {
            v8 acc = {0};
#pragma omp for
            for (size_t i = 0; i < words; i += 4) acc += p[i] + p[i + 1] + p[i + 2] + p[i + 3];
#pragma omp critical
            sum += acc;
        }
        double dt = now() - t;
        best = dt < best ? dt : best;
        total += sum[0];
    }
    printf("%.2f %lld\n", n / best / 1e9, (long long)total);
    return 0;
}
"""


def gb_per_s(threads: int) -> float:
    """GB/s of a plain read of 1 GiB on ``threads`` threads."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("memory_read.py needs a C compiler")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "read.c", Path(tmp) / "read"
        source.write_text(SOURCE)
        subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(source), "-o", str(binary)], check=True)
        out = subprocess.run([str(binary)], check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    return float(out.split()[0])


def main() -> None:
    threads = os.cpu_count() or 1
    for n in sorted({1, threads}):
        print(f"{n} thread{'s' * (n > 1)}: {gb_per_s(n):.1f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
