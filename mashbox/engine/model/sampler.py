"""Token sampling: pure functions over a batch of logits rows.

Each row has its own ``SamplingParams`` and, when it samples randomly, its
own uniform number: a hash of the request's seed and the output position
drawn (``uniform``), so a seeded request draws the same tokens whatever runs
beside it, however its tokens are grouped into steps (one at a time, or
several positions at once where a step checks proposals), and a position
drawn again draws the same. Greedy rows take the argmax and draw nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mashbox.engine.model.ops import TorchOps
from mashbox.engine.request import SamplingParams


Bias = tuple[torch.Tensor, torch.Tensor]  # token ids and what is added to their logits


def bias(params: SamplingParams, vocab: int, device: torch.device) -> Bias | None:
    """``params``' logit bias as tensors: made once a request (the whole vocabulary's, rebuilt at every
    token, cost 60 ms a step in the step all streams share)."""
    biased = [(i, b) for i, b in params.logit_bias if i < vocab]  # the runtime checked the ids
    if not biased:
        return None
    return (torch.tensor([i for i, _ in biased], device=device),
            torch.tensor([b for _, b in biased], dtype=torch.float32, device=device))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                    biased: Bias | None = None) -> torch.Tensor:
    """Repetition (over prompt and output), frequency and presence (over output) penalties, then the
    logit bias (``biased``: made by ``bias`` where not given); a penalty so strong that a logit overflows
    leaves it the largest (or smallest) finite number, never inf."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])
        counts = counts[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    if biased is None and params.logit_bias:
        biased = bias(params, logits.shape[-1], logits.device)
    if biased is not None:
        ids, added = biased
        logits[ids] += added.to(logits.dtype)
    return torch.nan_to_num(logits, nan=float(torch.finfo(logits.dtype).min))


MASK = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """The number in [0, 1) that a request of ``seed`` draws its output token at ``position`` with
    (splitmix64 of the pair: a counter-based generator, no state between draws)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return ((z ^ (z >> 31)) >> 11) / (1 << 53)


CANDIDATES = 1024  # top-p and min-p look at the most likely tokens first, the whole vocabulary only if needed


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` shifted so that the largest is 0: however small the temperature, the
    likeliest token stays finite (the others may go to -inf), so the softmax never holds NaN; a
    temperature below the dtype's smallest normal number (1e-46 is 0 in float32) is taken as that."""
    return (logits - logits.max()) / max(temperature, torch.finfo(logits.dtype).tiny)


def support(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, probabilities) a filtered row may draw from: top-k, then top-p and min-p.

    Probabilities are those of the temperature-scaled row (renormalised over the top k when
    top_k is set); ids come most likely first. Only the top ``CANDIDATES`` tokens are sorted
    unless top-p and min-p keep every one of them.
    """
    logits = scaled(logits, params.temperature)
    vocab = logits.shape[-1]
    k = params.top_k if 0 < params.top_k < vocab else vocab
    values, ids = torch.topk(logits, min(k, CANDIDATES) if k == vocab else k)
    norm = torch.logsumexp(logits if k == vocab else values, -1)
    probs = torch.exp(values - norm)
    keep = _kept(probs, params)
    if keep == len(ids) < k:  # every candidate kept: the rest of the vocabulary may be too
        values, ids = torch.sort(logits, descending=True)
        probs = torch.exp(values - norm)
        keep = _kept(probs, params)
    return ids[:keep], probs[:keep]


def _kept(probs: torch.Tensor, params: SamplingParams) -> int:
    """How many of the (descending) ``probs`` top-p and min-p keep."""
    keep = _nucleus(probs, params.top_p) if params.top_p < 1.0 else len(probs)
    if params.min_p > 0:
        keep = min(keep, int((probs[:keep] >= params.min_p * probs[0]).sum()))
    return keep


def _nucleus(probs: torch.Tensor, top_p: float) -> int:
    """How many of the (descending) ``probs`` the smallest set reaching ``top_p`` takes."""
    before = probs.cumsum(-1) - probs
    return max(1, int((before < top_p).sum()))


def filtered(params: SamplingParams) -> bool:
    return bool(params.top_k) or params.top_p < 1.0 or params.min_p > 0


def draw(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """Sample one token from one row: the uniform number ``u`` against the cumulative distribution."""
    if not filtered(params):
        return _pick(torch.softmax(scaled(logits.float(), params.temperature), -1), u)
    ids, probs = support(logits.float(), params)
    return int(ids[_pick(probs, u)])


def _pick(probs: torch.Tensor, u: float) -> int:
    """Index that ``u`` falls on in the cumulative ``probs`` (which need not sum to one)."""
    cdf = probs.double().cumsum(-1)
    return min(int(torch.searchsorted(cdf, cdf[-1:] * u, right=True)), len(cdf) - 1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]]],
    uniforms: list[float | None],
    argmax: Callable[[torch.Tensor], list[int]] = TorchOps().argmax,
    biases: list[Bias | None] | None = None,
) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]; a sampled row draws with its number of ``uniforms``.
    ``argmax`` gives every row's greedy token at once (the runner's ops: the kernels' on CPU); ``biases``,
    each row's logit bias made once (``bias``), where its request keeps them."""
    logits = logits.float()
    tokens = argmax(logits)
    for i, p in enumerate(params):
        needs_penalty = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or p.logit_bias
        if not needs_penalty and p.greedy:
            continue
        biased = biases[i] if biases else None
        row = apply_penalties(logits[i].clone(), p, *histories[i], biased) if needs_penalty else logits[i]
        tokens[i] = int(torch.argmax(row)) if p.greedy else draw(row, p, uniforms[i])
    return tokens
