"""How much a long prompt delays the streams already running (inter-token latency), no HTTP.

    .venv/bin/python bench/interleave.py [--chunk-tokens 32] [--step-tokens 256] [--busy-tokens 256]

Four requests decode alone (their ITL is the baseline); then four more decode 200 tokens while a
~2k-token prompt arrives after one second: their ITL p50/p99/max while it prefills, and its time
to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
import sys

from mashbox import Engine, EngineRequest, Message, Queued, SamplingParams, Started

sys.path.insert(0, str(Path(__file__).parent))
import loadgen  # noqa: E402


async def stream(engine: Engine, text: str, max_tokens: int, gaps: list[float]) -> float:
    """Time to first event; gaps between later events are appended to ``gaps``."""
    request = EngineRequest(messages=(Message("user", text),), sampling=SamplingParams(max_tokens=max_tokens))
    start = last = time.perf_counter()
    first = None
    async for event in engine.astream(request):
        if isinstance(event, (Queued, Started)):  # a slot, not a token
            continue
        now = time.perf_counter()
        if first is None:
            first = now - start
        else:
            gaps.append(now - last)
        last = now
    return first or 0.0


def ms(gaps: list[float], q: float) -> float:
    return sorted(gaps)[int(q * (len(gaps) - 1))] * 1000


async def scenario(engine: Engine) -> None:
    alone: list[float] = []
    await asyncio.gather(*(stream(engine, f"Write a long story about {t}.", 60, alone) for t in "abcd"))
    mixed: list[float] = []
    long_prompt = loadgen.make_prompts(1, 1500, seed=7)[0]

    async def later() -> float:
        await asyncio.sleep(1.0)
        return await stream(engine, long_prompt, 2, [])

    *_, ttft = await asyncio.gather(*(stream(engine, f"Write a long story about {t}.", 200, mixed) for t in "efgh"),
                                    later())
    print(f"ITL alone: p50 {ms(alone, .5):.0f} ms, p99 {ms(alone, .99):.0f} ms")
    print(f"ITL while a 2k prompt prefills: p50 {ms(mixed, .5):.0f} ms, p99 {ms(mixed, .99):.0f} ms, "
          f"max {max(mixed) * 1000:.0f} ms; the 2k prompt's TTFT {ttft:.2f} s")
    print(f"p99 while it prefills / p50 alone: {ms(mixed, .99) / ms(alone, .5):.1f}x (the bar: 3x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--chunk-tokens", type=int, default=32)
    parser.add_argument("--step-tokens", type=int, default=256)
    parser.add_argument("--busy-tokens", type=int, default=256)
    args = parser.parse_args()
    with Engine(args.model, ctx=4096, slots=8, chunk_tokens=args.chunk_tokens, step_tokens=args.step_tokens,
                busy_tokens=args.busy_tokens, quiet=True) as engine:
        print(f"chunk {args.chunk_tokens}, step {args.step_tokens}, busy {args.busy_tokens} tokens")
        asyncio.run(scenario(engine))


if __name__ == "__main__":
    main()
