"""What each weight form costs in quality: perplexity on a fixed text and greedy agreement with fp32.

    .venv/bin/python bench/quality.py [--model smollm2-135m] [--forms float32 gguf int8 float16] [--prompts 50]

The text is the docstrings of a fixed list of standard-library modules (English prose that ships
with Python, so every machine has the same). Perplexity runs the engine's own forward (the same
kernels a request uses) over the text in prompt chunks; `transformers` on the fp32 weights is the
reference. Greedy agreement: 50 fixed prompts, 32 new tokens each, through the Engine in each form,
compared with the float32 form token for token. `gguf` is the default form (the dtype left unset:
a GGUF's Q4_1 blocks as the file has them, int8 elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math

import torch

from mashbox import Engine, EngineRequest, Message, SamplingParams
from mashbox.engine.load.loader import hf_model, load
from mashbox.engine.model.form import decide
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.sched.scheduler import Scheduler
from mashbox.engine.sched.sequence import Sequence

MODULES = ["argparse", "json", "collections", "textwrap", "csv", "logging", "difflib", "heapq", "bisect",
           "pickle", "shutil", "tempfile", "unittest", "doctest", "calendar", "sched", "zipfile", "string"]
TOPICS = ["the sea", "a lighthouse", "mountains", "a robot", "the moon", "a forest", "a train", "rain", "a library",
          "a volcano", "bees", "a desert", "winter", "a city at night", "a garden", "the wind", "coffee", "chess",
          "a violin", "bridges", "the sun", "glaciers", "a market", "owls", "a river", "clocks", "paper", "salt",
          "a castle", "tigers", "the internet", "bread", "a comet", "islands", "a museum", "snow", "whales",
          "a bicycle", "maps", "thunder", "a farm", "copper", "kites", "a harbour", "ants", "mirrors", "tea",
          "a telescope", "caves", "autumn"]


def text() -> str:
    return "\n\n".join(importlib.import_module(m).__doc__.strip() for m in MODULES)


def perplexity_engine(runner: ModelRunner, ids: list[int], chunk: int = 256) -> float:
    """exp(mean NLL of each next token) through the runner's forward, prompt chunk by chunk."""
    scheduler = Scheduler(1, len(ids) + 1, chunk)
    seq = Sequence("ppl", ids, SamplingParams(), 1)
    scheduler.add(seq)
    nll, count = 0.0, 0
    with torch.inference_mode():
        while seq.in_prefill or seq.num_computed == 0:
            plan = scheduler.schedule()
            batch = runner._batch(plan)
            hidden = runner.forward(batch)
            w = runner.weights
            logits = w.lm_head(runner.ops.rms_norm(hidden, w.norm, w.spec.eps)).float()
            start = plan.work[0].position
            targets = torch.tensor(ids[start + 1 : start + 1 + logits.shape[0]])
            logits = logits[: targets.shape[0]]
            nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            count += targets.shape[0]
            scheduler.update(plan, [0] if plan.work[0].sample else [])
    return math.exp(nll / count)


def perplexity_hf(model, ids: list[int]) -> float:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), labels=torch.tensor([ids]))
    return math.exp(out.loss.item())


def greedy(engine: Engine, prompts: int, tokens: int) -> list[list[str]]:
    """The text pieces of each prompt's greedy answer, all prompts running at once."""
    async def one(i: int) -> list[str]:
        request = EngineRequest(messages=(Message("user", f"Write one sentence about {TOPICS[i % len(TOPICS)]}."),),
                                sampling=SamplingParams(max_tokens=tokens))
        return [e.text async for e in engine.astream(request) if hasattr(e, "text")]

    async def every() -> list[list[str]]:
        return list(await asyncio.gather(*(one(i) for i in range(prompts))))

    return asyncio.run(every())


def agreement(ref: list[str], got: list[str]) -> int:
    """How many leading text pieces are the same."""
    n = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--forms", nargs="+", default=["float32", "gguf", "int8", "float16"])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    loaded = load(args.model)
    ids = loaded.tokenizer.encode(text())[:2048]
    print(f"model {loaded.id}; text: docstrings of {len(MODULES)} stdlib modules, {len(ids)} tokens")
    print(f"transformers fp32 perplexity: {perplexity_hf(hf_model(args.model), ids):.3f}")
    reference = None
    print("form      Linear  perplexity  greedy: same 32 tokens  mean agreeing pieces")
    for form in args.forms:
        dtype = None if form == "gguf" else form
        mode = decide(torch.device("cpu"), dtype, batch_invariant=True).mode
        ppl = perplexity_engine(ModelRunner(loaded.checkpoint, 1, len(ids) + 1, mode), ids)
        with Engine(args.model, dtype=dtype, ctx=512, slots=16, quiet=True) as engine:
            outputs = greedy(engine, args.prompts, args.tokens)
        reference = reference or outputs
        same = [agreement(r, o) for r, o in zip(reference, outputs)]
        full = sum(a == len(r) for a, r in zip(same, reference))
        print(f"{form:9s} {mode:7s} {ppl:10.3f}  {full:>3}/{len(same)}  {sum(same) / len(same):>22.1f}")


if __name__ == "__main__":
    main()
