"""A model that writes a script: each sampled token is the next of a list, through a real EngineCore, so
that the markup, the detokenizer and the call guard see exactly the tokens a test chooses."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mashbox.engine.core import EngineCore
from mashbox.engine.events import Finish
from mashbox.engine.request import SamplingParams
from mashbox.engine.sched.scheduler import Scheduler
from mashbox.engine.sched.sequence import Sequence
from mashbox.engine.text.markup import Markup


class ScriptedRunner:
    """Stands in for the model: each sampled token is the next of ``script``."""

    def __init__(self, script: list[int]) -> None:
        self.script = iter(script)
        self.kv = SimpleNamespace(nbytes=0)
        self.sampled = 0

    def run(self, plan) -> list[int]:
        tokens = [next(self.script) for w in plan.work if w.sample]
        self.sampled += len(tokens)
        return tokens


def scripted_events(runner, tok, new: int, markup: Markup, guard=None) -> list:
    """Every event of one request of at most ``new`` tokens that ``runner`` writes through a real EngineCore."""
    core = EngineCore(Scheduler(num_slots=1, ctx=2048, chunk_tokens=64), runner, tok)
    try:
        seq = Sequence("r", [1, 2, 3], SamplingParams(), new, frozenset({tok.eos_token_id}))
        channel = core.submit(seq, markup, None, guard)
        events = [channel.get(timeout=30)]
        while not isinstance(events[-1], Finish):
            events.append(channel.get(timeout=30))
        return events
    finally:
        core.close()


class MaskedScriptRunner(ScriptedRunner):
    """Writes ``script`` as a model would through the real runner's constraint steps: the row of
    each sampled token (the model's weight on the script's token) is masked by the request's constraint
    (if any), then the token accepted (the best one left where the mask took the script's). Records, for each step, the tokens the mask left (None: no
    constraint; every token where the constraint let go)."""

    def __init__(self, script: list[int], vocab: int, lean: float = 20.0) -> None:
        super().__init__(script)
        self.vocab = vocab
        self.lean = lean  # the script's token's logit above every other's
        self.allowed: list[set[int] | None] = []

    def run(self, plan) -> list[int]:
        tokens = super().run(plan)
        for k, (token, work) in enumerate(zip(tokens, [w for w in plan.work if w.sample])):
            constraint = work.seq.constraint
            if constraint is None:
                self.allowed.append(None)
                continue
            row = torch.zeros(self.vocab)
            row[token] = self.lean
            constraint.mask(row)
            self.allowed.append(set(torch.isfinite(row).nonzero().flatten().tolist()))
            if token not in self.allowed[-1]:  # masked away: the model writes the best it may instead
                token = tokens[k] = int(row.argmax())
            constraint.accept(token)
        return tokens
