"""Time to first token with and without a cached prompt prefix.

    .venv/bin/python bench/prefix_cache.py [--model smollm2-135m] [--prefix-tokens 2048]

An agent resends its whole conversation every turn; the second request here
shares a long prefix with the first (as turn 2 shares turn 1) and should reach
its first token in a fraction of the cold time.
"""

from __future__ import annotations

import argparse
import time

from mashbox import Engine, EngineRequest, Queued, SamplingParams, Started


def ttft(engine: Engine, prompt: str) -> tuple[float, int]:
    start = time.perf_counter()
    events = (e for e in engine.stream(EngineRequest(prompt=prompt, sampling=SamplingParams(max_tokens=1)))
              if not isinstance(e, (Queued, Started)))  # a slot, not a token
    first = next(events)
    elapsed = time.perf_counter() - start
    finish = list(events)[-1] if first.type != "finish" else first
    return elapsed, finish.timings.cache_n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    args = parser.parse_args()
    with Engine(args.model, ctx=args.prefix_tokens + 512, slots=4, quiet=True) as engine:
        words = [f"item{i}" for i in range(args.prefix_tokens)]
        ids = engine.tokenizer.encode(" ".join(words))[: args.prefix_tokens]
        prefix = engine.tokenizer.decode(ids)
        ttft(engine, "warm-up")
        cold, _ = ttft(engine, prefix + " First question?")
        warm, cached = ttft(engine, prefix + " Second, different question?")
        print(f"model {engine.model_id}, prefix {len(engine.tokenizer.encode(prefix))} tokens")
        print(f"cold TTFT {cold * 1000:.0f} ms, warm TTFT {warm * 1000:.0f} ms ({cached} tokens cached), "
              f"warm/cold {warm / cold:.0%}")


if __name__ == "__main__":
    main()
