"""Draft tokens from what a request already holds (prompt lookup): where its last few tokens occurred
before (in the prompt, a predicted output, or the answer so far), the tokens that followed them there
are proposed, and the next step checks them all at once (one row each, as a prompt chunk runs).
Pure: no torch.

A coding agent's answer re-writes much of what it was shown (a file read a turn ago, with two
lines changed), so long runs of proposals are right; on prose with nothing to copy there is rarely
a match, and the length proposed backs off after misses (``Drafts.record``). How many of the
proposals a step checks is the scheduler's choice, by what rows cost (``Scheduler._afford``).

A proposal is kept where the token the model chooses at its position is the same, and the first
that differs is replaced by that choice. Greedy, that is the argmax; sampled, the token drawn with
the number of that position (``sampler.uniform``), so a proposal is kept with the probability the
model gives it and otherwise the token comes from the rest of its distribution: rejection sampling
for a proposal that is one token, and the same tokens as without speculation for the same seed.
"""

from __future__ import annotations

LONGEST = 4  # the longest suffix looked up, then shorter ones down to SHORTEST
SHORTEST = 2
MOST = 16  # tokens proposed at once, at most
START = 4  # tokens proposed after a hit, before the record says more
REST = 8  # tokens to wait after the proposals failed twice in a row before proposing again
TAKEN = 0.5  # the share of proposals taken, assumed before a request's own record says


class Drafts:
    """A request's tokens indexed by the n-grams they hold (n = SHORTEST..LONGEST), each mapped to
    where its latest occurrence was followed by another token; and how much to propose next."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []
        self._follows: dict[tuple[int, ...], int] = {}
        self.size = START
        self.taken = TAKEN  # the share of its recent proposals taken (a running average)
        self._misses = 0
        self._resting = 0
        for token in tokens:
            self.add(token)

    def add(self, token: int) -> None:
        """Index one more token: the n-grams that end just before it are now followed by it."""
        end = len(self.tokens)
        for n in range(SHORTEST, LONGEST + 1):
            if end >= n:
                self._follows[tuple(self.tokens[end - n : end])] = end
        self.tokens.append(token)
        self._resting = max(0, self._resting - 1)

    def propose(self, most: int) -> tuple[int, ...]:
        """Up to ``most`` (and the current size) tokens that followed the latest earlier occurrence of
        the longest suffix found; none while resting after misses."""
        most = min(most, self.size)
        if most <= 0 or self._resting:
            return ()
        for n in range(LONGEST, SHORTEST - 1, -1):
            at = self._follows.get(tuple(self.tokens[-n:]))
            if at is not None:
                return tuple(self.tokens[at : at + most])
        return ()

    def record(self, proposed: int, accepted: int) -> None:
        """Adapt to how the last proposal did: all taken, propose twice as many (up to MOST); none
        taken, half as many, and after two such in a row rest for REST tokens."""
        self.taken = 0.75 * self.taken + 0.25 * accepted / proposed
        if accepted == proposed:
            self.size, self._misses = min(MOST, 2 * self.size), 0
        elif accepted == 0:
            self.size, self._misses = max(1, self.size // 2), self._misses + 1
            if self._misses >= 2:
                self._resting, self._misses = REST, 0
        else:
            self.size, self._misses = max(1, accepted + 1), 0
