"""How many prompt tokens a step may add beside running streams, from how long steps take.

A step that runs prompt tokens beside decode rows delays each running stream's next token by
what those prompt tokens cost. ``Pace`` keeps a running average of the time of a step of each
size (decode rows and prompt tokens together: on a CPU a row costs little while the weights are
read anyway and a prompt token's full share once the step is compute-bound), and allows as many
prompt tokens as keep a step within a given multiple of the decode step it joins: few beside one
fast stream, more beside 16 slower ones. Pure arithmetic on the times the engine reports; no
clock here.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

WEIGHT = 0.2  # of the newest step in each running average


@dataclass(slots=True)
class Pace:
    sizes: list[int] = field(default_factory=list)  # the step sizes measured, sorted
    seconds: dict[int, float] = field(default_factory=dict)  # a step of n rows, by n

    def record(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """Average the step into its size's time, and keep the times rising with the size: the newest
        step corrects what older ones of other sizes said (a first, cold step; a stray slow one)."""
        n = decode_rows + prompt_tokens
        at = bisect_left(self.sizes, n)
        if n not in self.seconds:
            self.sizes.insert(at, n)
        now = self.seconds[n] = _average(self.seconds.get(n), seconds)
        for i in range(at - 1, -1, -1):  # the times were rising before: stop where they still do
            if self.seconds[self.sizes[i]] <= now:
                break
            self.seconds[self.sizes[i]] = now
        for i in range(at + 1, len(self.sizes)):
            if self.seconds[self.sizes[i]] >= now:
                break
            self.seconds[self.sizes[i]] = now

    def step(self, rows: int) -> float | None:
        """A step of ``rows`` rows: as measured, else between the sizes measured around it, else in
        proportion to the nearest one."""
        if not self.sizes:
            return None
        i = bisect_left(self.sizes, rows)
        if i < len(self.sizes) and self.sizes[i] == rows:
            return self.seconds[rows]
        if i in (0, len(self.sizes)):
            near = self.sizes[min(i, len(self.sizes) - 1)]
            return self.seconds[near] * rows / near
        lo, hi = self.sizes[i - 1], self.sizes[i]
        return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (rows - lo) / (hi - lo)

    def budget(self, rows: int, unit: int, cap: int, ratio: float, unknown: int | None = None) -> int:
        """Prompt tokens for a step beside ``rows`` decode rows that keep it within ``ratio`` decode
        steps of as many rows: whole ``unit``s, at least one, at most ``cap``; ``unknown`` (default
        one unit) until two step sizes are known."""
        if len(self.sizes) < 2:
            return unknown or unit
        limit = ratio * self.step(rows)
        fits, more = 0, cap // unit  # the most units known to fit; the fewest known not to, plus one
        while more - fits > 1:
            mid = (fits + more) // 2
            fits, more = (mid, more) if self.step(rows + mid * unit) <= limit else (fits, mid)
        if self.step(rows + more * unit) <= limit:
            fits = more
        return max(unit, fits * unit)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
