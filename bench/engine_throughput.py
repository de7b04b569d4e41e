"""Throughput of the Engine under N concurrent requests, next to plain generate().

    .venv/bin/python bench/engine_throughput.py [--model smollm2-135m] [--n 1 4 16] [--max-tokens 128]

For each N, N streaming chat requests (greedy, ~100-token prompts) run at once
through one Engine; it prints total output tokens/s and time to first token
(median and worst). Then the same prompt through transformers' generate(),
batch 1, on the same weights.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from mashbox import Engine, EngineRequest, Finish, Message, Queued, SamplingParams, Started
from mashbox.engine.load.loader import hf_model

TOPICS = ["the sea", "a lighthouse", "mountains", "a robot", "the moon", "a forest", "a train", "rain",
          "a library", "a volcano", "bees", "a desert", "winter", "a city at night", "a garden", "the wind"]
PREAMBLE = ("You are a careful storyteller. Stories should be vivid, concrete and long, with several "
            "characters, a setting described in detail, and a clear beginning, middle and end. ")


def prompt(i: int) -> tuple[Message, ...]:
    return (Message("system", PREAMBLE * 2), Message("user", f"Write a long story about {TOPICS[i % len(TOPICS)]}."))


async def one(engine: Engine, i: int, max_tokens: int, start: float) -> tuple[int, float]:
    request = EngineRequest(messages=prompt(i), sampling=SamplingParams(max_tokens=max_tokens))
    first = None
    async for event in engine.astream(request):
        if isinstance(event, (Queued, Started)):  # a slot, not a token
            continue
        first = first or time.perf_counter() - start
        if isinstance(event, Finish):
            return event.usage.completion_tokens, first
    raise RuntimeError("stream ended without a finish")


async def round_of(engine: Engine, n: int, max_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(one(engine, i, max_tokens, start) for i in range(n)))
    wall = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    ttfts = [r[1] for r in results]
    return {"n": n, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50": statistics.median(ttfts), "ttft_max": max(ttfts)}


def generate_baseline(engine: Engine, model, max_tokens: int) -> float:
    ids = engine.encode(EngineRequest(messages=prompt(0)))
    inputs = torch.tensor([ids], device=model.device)
    model.generate(inputs, max_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    out = model.generate(inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return (out.shape[1] - len(ids)) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--dtype", default=None, help="CPU: int8 (default), float16 (packed fp16 weights) or float32")
    parser.add_argument("--not-batch-invariant", action="store_true", help="float32: plain matmuls (faster alone)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: every decode step eager")
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers' generate()")
    args = parser.parse_args()
    with Engine(args.model, ctx=args.ctx, slots=max(args.n), quiet=True, dtype=args.dtype,
                batch_invariant=not args.not_batch_invariant, cuda_graphs=not args.no_cuda_graphs) as engine:
        asyncio.run(round_of(engine, 1, 8))  # warm-up
        print(f"model {engine.model_id}, ctx {engine.ctx}, slots {max(args.n)}, threads {torch.get_num_threads()}, "
              f"weights {engine.info.weights_mode} ({engine.info.dtype}) on {engine.info.device}, "
              f"CUDA graphs {engine._core.runner._graphs is not None}")
        print(f"prompt tokens: {len(engine.encode(EngineRequest(messages=prompt(0))))}, max new tokens {args.max_tokens}")
        print("   N  tokens   tok/s  TTFT p50  TTFT max")
        for n in args.n:
            r = asyncio.run(round_of(engine, n, args.max_tokens))
            print(f"{r['n']:>4} {r['tokens']:>7} {r['tok_s']:>7.1f} {r['ttft_p50']:>8.2f}s {r['ttft_max']:>8.2f}s")
        if args.no_baseline:
            return
        device = engine.info.device  # on a GPU, transformers there too, in bfloat16 (it ran on the CPU in float32)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = hf_model(args.model, dtype).to(device)
        print(f"transformers generate() on {device}, batch 1: {generate_baseline(engine, model, args.max_tokens):.1f} "
              "tok/s")


if __name__ == "__main__":
    main()
