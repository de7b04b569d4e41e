"""Where one decode step spends its time, at 1 and 16 running requests (no HTTP, no other load).

    .venv/bin/python bench/step_profile.py [--model smollm2-135m] [--rows 1 16] [--dtype int8]

Puts N requests with ~100-token prompts into a runner, prefills them, then times 30 pure decode
steps split into: the scheduler (plan and update), batch tensors, the layers (matmuls, attention,
norms), the final norm and lm_head, and sampling. IPC and the text state machines are not in it.
"""

from __future__ import annotations

import argparse
import time

import torch

from mashbox import Engine, SamplingParams
from mashbox.engine.model import sampler
from mashbox.engine.sched.scheduler import Scheduler
from mashbox.engine.sched.sequence import Sequence

PARTS = ("scheduler", "batch", "layers", "lm_head", "sampling")


def profile(engine: Engine, rows: int, steps: int) -> dict[str, float]:
    runner = engine._core.runner
    scheduler = Scheduler(rows, engine.ctx, 256)
    for i in range(rows):
        scheduler.add(Sequence(str(i), list(range(100 + i, 200 + i)), SamplingParams(), 10_000))
    while any(s.in_prefill or not s.output_ids for s in scheduler.running + list(scheduler.waiting)):
        plan = scheduler.schedule()
        scheduler.update(plan, runner.run(plan))
    spent = dict.fromkeys(PARTS, 0.0)
    w = runner.weights
    with torch.inference_mode():
        for _ in range(steps):
            t0 = time.perf_counter()
            plan = scheduler.schedule()
            t1 = time.perf_counter()
            batch = runner._batch(plan)
            t2 = time.perf_counter()
            hidden = runner.forward(batch).index_select(0, batch.sample_rows)
            t3 = time.perf_counter()
            logits = w.lm_head(runner.ops.rms_norm(hidden, w.norm, w.spec.eps))
            t4 = time.perf_counter()
            seqs = [item.seq for item in plan.work]
            tokens = sampler.sample(logits, [s.sampling for s in seqs], [(s.prompt_ids, s.output_ids) for s in seqs],
                                    [None] * len(seqs), runner.ops.argmax)
            t5 = time.perf_counter()
            scheduler.update(plan, tokens)
            t6 = time.perf_counter()
            for part, seconds in zip(PARTS, (t1 - t0 + t6 - t5, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                spent[part] += seconds
    return {part: seconds / steps * 1000 for part, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with Engine(args.model, ctx=2048, slots=max(args.rows), dtype=args.dtype, quiet=True) as engine:
        print(f"model {engine.model_id}, weights {engine.info.weights_mode}, threads {torch.get_num_threads()}")
        print("rows  " + "  ".join(f"{p:>9}" for p in PARTS) + "   step ms   tok/s")
        for rows in args.rows:
            ms = profile(engine, rows, args.steps)
            total = sum(ms.values())
            print(f"{rows:>4}  " + "  ".join(f"{ms[p]:>9.2f}" for p in PARTS) + f"  {total:>8.2f}  {rows / total * 1000:>6.1f}")


if __name__ == "__main__":
    main()
