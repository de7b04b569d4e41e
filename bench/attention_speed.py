"""The native attention kernel alone: one layer's prompt chunk (or one-token rows) over an fp16 cache
at several depths, in ms per call and GF/s of useful multiply-adds (causal: row i of a chunk at
p0 sees p0 + i + 1 positions).

    OMP_NUM_THREADS=2 .venv/bin/python bench/attention_speed.py                  # qwen2.5-0.5b's heads
    OMP_NUM_THREADS=2 .venv/bin/python bench/attention_speed.py --heads 9 --kv-heads 3   # SmolLM2's

Both ways of multiplying where the kernels were built with AVX512-BF16 (bf16 pairs and fp32), else
fp32 alone; with bf16 pairs, the keys both as rows and in blocks (kvq 2: as mashbox keeps them there).
"""

import argparse
import time

import torch

from mashbox.engine.model import native
from mashbox.engine.model.kv_cache import BLOCK, _pairs


def call(lib, q, keys, values, rows: int, depth: int, heads: int, kv_heads: int, dim: int, bf16: int,
         kvq: int) -> float:
    """Seconds for one call: `rows` prompt rows at positions depth-rows .. depth-1 of slot 0."""
    out = torch.empty(rows, heads * dim)
    chunk = torch.tensor([[0], [rows], [0], [depth - rows]])
    start = time.perf_counter()
    lib.mb_chunk_attention(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(),
                           *(c.data_ptr() for c in chunk), out.data_ptr(), 1, heads, kv_heads, dim, keys.shape[2],
                           dim**-0.5, bf16, kvq, 0, 0.0)  # an fp16 cache, no sliding window, no soft cap
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1])
    parser.add_argument("--depths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    lib = native.load()
    if lib is None:
        raise SystemExit("no C compiler: the native kernels are not built")
    g = torch.Generator().manual_seed(0)
    ctx = -(-max(args.depths) // BLOCK) * BLOCK
    keys = torch.randn(1, args.kv_heads, ctx, args.dim, generator=g).half()
    forms = {0: keys, 2: _pairs(keys, BLOCK)}
    values = torch.randn(1, args.kv_heads, ctx, args.dim, generator=g).half()
    print(f"heads {args.heads}/{args.kv_heads} x {args.dim}, {torch.get_num_threads()} threads")
    print(f"| multiply | keys | rows | depth | ms per call (best of {args.repeat}) | GF/s |")
    print("|---|---|---|---|---|---|")
    for bf16 in [1, 0] if lib.mb_attention_bf16() else [0]:
        for rows in args.rows:
            q = torch.randn(rows, args.heads * args.dim, generator=g)
            for depth in args.depths:
                for kvq in (0, 2) if bf16 else (0,):  # side by side, each the best of its calls
                    best = min(call(lib, q, forms[kvq], values, rows, depth, args.heads, args.kv_heads, args.dim,
                                    bf16, kvq) for _ in range(args.repeat))
                    seen = rows * (depth - rows) + rows * (rows + 1) / 2
                    flops = 4 * seen * args.heads * args.dim
                    form, layout = "bf16 pairs" if bf16 else "fp32", "blocks" if kvq else "rows"
                    print(f"| {form} | {layout} | {rows} | {depth} | {best * 1e3:.2f} | {flops / best / 1e9:.1f} |")


if __name__ == "__main__":
    main()
