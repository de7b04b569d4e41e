"""How much a long prompt delays the streams already running (inter-token latency), no HTTP.

    .venv/bin/python bench/interleave.py [--chunk-tokens 32] [--step-tokens 256] [--busy-tokens 256]

Four requests decode alone (their ITL is the baseline); then four more decode 200 tokens while a
~2k-token prompt arrives after one second: their ITL p50/p99/max while it prefills (the tokens that
came between its arrival and its first token), its time to first token, and their ITL over their
whole run.
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


async def stream(engine: Engine, text: str, max_tokens: int, gaps: list[tuple[float, float]]) -> float:
    """Time to first event; (time, gap) of each later event is appended to ``gaps``."""
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
            gaps.append((now, now - last))
        last = now
    return first or 0.0


def ms(gaps: list[float], q: float) -> float:
    return sorted(gaps)[int(q * (len(gaps) - 1))] * 1000


async def scenario(engine: Engine) -> None:
    alone: list[tuple[float, float]] = []
    await asyncio.gather(*(stream(engine, f"Write a long story about {t}.", 60, alone) for t in "abcd"))
    mixed: list[tuple[float, float]] = []
    long_prompt = loadgen.make_prompts(1, 1500, seed=7)[0]
    window: list[float] = []

    async def later() -> float:
        await asyncio.sleep(1.0)
        window.append(time.perf_counter())
        ttft = await stream(engine, long_prompt, 2, [])
        window.append(window[0] + ttft)
        return ttft

    *_, ttft = await asyncio.gather(*(stream(engine, f"Write a long story about {t}.", 200, mixed) for t in "efgh"),
                                    later())
    normal = [gap for _, gap in alone]
    during = [gap for at, gap in mixed if window[0] < at <= window[1]]  # tokens that came while it prefilled
    whole = [gap for _, gap in mixed]
    print(f"ITL alone: p50 {ms(normal, .5):.0f} ms, p99 {ms(normal, .99):.0f} ms")
    print(f"ITL while a 2k prompt prefills: p50 {ms(during, .5):.0f} ms, p99 {ms(during, .99):.0f} ms, "
          f"max {max(during) * 1000:.0f} ms ({len(during)} tokens); the 2k prompt's TTFT {ttft:.2f} s")
    print(f"p99 while it prefills / p50 alone: {ms(during, .99) / ms(normal, .5):.1f}x (the bar: 3x)")
    print(f"ITL over the streams' whole run (their own starts too): p50 {ms(whole, .5):.0f} ms, "
          f"p99 {ms(whole, .99):.0f} ms")


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
