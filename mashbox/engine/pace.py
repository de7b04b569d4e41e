"""How many prompt tokens a step may add beside running streams, from how long steps take.

A step that runs prompt tokens beside decode rows delays each running stream's next token by
what those prompt tokens cost. ``Pace`` keeps running averages of a decode-only step and of
what one prompt token adds, and allows as many prompt tokens as keep such a step within
``ratio`` decode steps: few beside one fast stream, more beside 16 slower ones. Pure
arithmetic on the times the engine reports; no clock here.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.2  # of the newest step in each running average


@dataclass(slots=True)
class Pace:
    ratio: float = 2.5
    decode_s: float | None = None  # a step of decode rows only
    token_s: float | None = None  # what one prompt token adds to a step

    def record(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        if not prompt_tokens:
            self.decode_s = _average(self.decode_s, seconds)
        elif not decode_rows:  # prompt only: the step's fixed costs count against its tokens (an upper bound)
            self.token_s = _average(self.token_s, seconds / prompt_tokens)
        elif self.decode_s is not None:
            self.token_s = _average(self.token_s, max(seconds - self.decode_s, 0.0) / prompt_tokens)

    def budget(self, unit: int, cap: int) -> int:
        """Prompt tokens for a step beside decode rows: whole ``unit``s, at least one (only that until
        both costs are known), at most ``cap``."""
        if self.decode_s is None or not self.token_s:
            return unit
        fits = int((self.ratio - 1) * self.decode_s / self.token_s) // unit * unit
        return max(unit, min(cap, fits))


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
