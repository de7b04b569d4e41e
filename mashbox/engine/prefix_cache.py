"""Prompt prefixes kept in free slots, reused by requests that start the same way.

Each slot remembers the tokens whose KV it still holds. A new request takes
the free slot sharing the longest prefix with its prompt and prefills only the
rest. Only whole prompt chunks (multiples of ``block`` tokens, prefilled as
chunks) are reused, so a cached prefix holds exactly the KV a cold prefill
would compute: answers do not depend on what ran before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Match:
    slot: int
    tokens: int


class PrefixCache:
    def __init__(self, num_slots: int, block: int) -> None:
        self.block = block
        self._tokens: list[tuple[int, ...]] = [()] * num_slots
        self._used: list[int] = [0] * num_slots
        self._clock = 0

    def match(self, prompt: list[int], free: list[int]) -> Match:
        """The free slot to run ``prompt`` in, and how many of its tokens are cached.

        With no hit, the least recently used free slot (emptiest first).
        """
        best = max(free, key=lambda s: (self._hit(s, prompt), -self._used[s]))
        return Match(best, self._hit(best, prompt))

    def insert(self, slot: int, tokens: list[int]) -> None:
        """Record that ``slot`` holds the KV of ``tokens`` (whole blocks only are kept)."""
        keep = len(tokens) // self.block * self.block
        self._tokens[slot] = tuple(tokens[:keep])
        self._clock += 1
        self._used[slot] = self._clock

    def holds(self, slot: int) -> int:
        return len(self._tokens[slot])

    @property
    def cached_tokens(self) -> int:
        return sum(len(t) for t in self._tokens)

    def check_integrity(self) -> None:
        for tokens in self._tokens:
            if len(tokens) % self.block:
                raise AssertionError("a slot holds a partial block")

    def _hit(self, slot: int, prompt: list[int]) -> int:
        cached = self._tokens[slot]
        limit = min(len(cached), len(prompt) - 1) // self.block * self.block
        n = 0
        while n < limit and cached[n : n + self.block] == tuple(prompt[n : n + self.block]):
            n += self.block
        return n
