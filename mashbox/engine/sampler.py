"""Token sampling: pure functions over a batch of logits rows.

Each row has its own ``SamplingParams`` and, when it samples randomly, its
own generator, so a seeded request draws the same tokens whatever runs
beside it. Greedy rows take the argmax and never touch a generator.
"""

from __future__ import annotations

import torch

from mashbox.engine.request import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Repetition (over prompt and output), frequency and presence (over output) penalties."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])
        counts = counts[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks on one row."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def draw(logits: torch.Tensor, generator: torch.Generator) -> int:
    """Sample one token from a filtered logits row (exponential race)."""
    probs = torch.softmax(logits.float(), -1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]]],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]."""
    logits = logits.float()
    tokens = torch.argmax(logits, -1).tolist()
    for i, p in enumerate(params):
        needs_penalty = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        if not needs_penalty and p.greedy:
            continue
        row = apply_penalties(logits[i].clone(), p, *histories[i]) if needs_penalty else logits[i]
        tokens[i] = int(torch.argmax(row)) if p.greedy else draw(filter_logits(row, p), generators[i])
    return tokens
