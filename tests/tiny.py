"""A tiny random Llama config for tests that need a model but not a good one, greedy answers of a
runner without an engine around it, and transformers' own greedy answers."""

import torch
from transformers import LlamaConfig

from mashbox import SamplingParams
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.sched.scheduler import Scheduler
from mashbox.engine.sched.sequence import Sequence


def tiny_config(vocab_size: int, **overrides: object) -> LlamaConfig:
    return LlamaConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "initializer_range": 0.3, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, **overrides,
    })


def greedy(runner: ModelRunner, prompts: list[list[int]], new: int = 12) -> list[list[int]]:
    """Greedy answers (the runner has 4 slots of 512). The steps are given times in which a prompt
    token costs 1-4 decode rows, so that beside decoding rows prompts are cut mid-chunk where the
    runner allows it."""
    scheduler = Scheduler(num_slots=4, ctx=512, chunk_tokens=32, step_tokens=64, busy_tokens=64,
                          cut_anywhere=runner.cut_anywhere)
    seqs = [Sequence(str(i), p, SamplingParams(), new) for i, p in enumerate(prompts)]
    for s in seqs:
        scheduler.add(s)
    while scheduler.has_work:
        plan = scheduler.schedule()
        cost = 1 + len(scheduler.running) % 4
        scheduler.update(plan, runner.run(plan), 0.001 * (plan.decode_rows + cost * plan.prompt_tokens))
    return [s.output_ids for s in seqs]


def last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The runner's logits after ``prompt`` (at most 512 tokens, all in one step)."""
    scheduler = Scheduler(num_slots=4, ctx=512, chunk_tokens=512, step_tokens=512, busy_tokens=512)
    scheduler.add(Sequence("0", prompt, SamplingParams(), 1))
    batch = runner._batch(scheduler.schedule())
    with torch.inference_mode():
        return runner._logits(runner.forward(batch).index_select(0, batch.sample_rows))[0]


def logits(model, prompt: list[int]) -> torch.Tensor:
    """transformers' logits after ``prompt`` (ids)."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1]


def generate(model, prompt: list[int], n: int = 12) -> list[int]:
    """transformers' greedy answer of ``n`` tokens to ``prompt`` (ids)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
