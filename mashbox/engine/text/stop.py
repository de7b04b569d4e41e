"""Stop strings as a text state machine: text ends before the first match,
and a partial match at the end is held back, never half-emitted."""

from __future__ import annotations


class StopMatcher:
    """Each stop string is followed as the text comes, a character at a time (Knuth-Morris-Pratt): how much
    of it the text's end already holds. A token costs its characters times the stops, however long the
    stops and the text held back; searching the held text again at every token cost its length squared
    (two 100,000-character stops slowed every other stream 15-fold)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        self.matched: str | None = None
        self._borders: list[list[int]] = [[0] for _ in stops]  # of each stop, as far as a match went (_grown)
        self._depths = [0] * len(stops)  # of each stop, the longest prefix the text so far ends with

    def push(self, text: str) -> str:
        """Feed new text; return what can be emitted now."""
        if self.matched is not None:
            return ""
        buf = self.held + text
        hit = min(filter(None, (self._follow(i, text, len(self.held)) for i in range(len(self.stops)))),
                  default=None)
        if hit is not None:
            self.matched, self.held = hit[1], ""
            return buf[: hit[0]]
        keep = max(self._depths, default=0)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def _follow(self, i: int, text: str, offset: int) -> tuple[int, str] | None:
        """Stop ``i`` followed over ``text``: where in ``held + text`` it first matches, or None."""
        stop, borders, depth = self.stops[i], self._borders[i], self._depths[i]
        end = len(stop)
        _grown(stop, borders, min(depth + len(text), end))
        for at, char in enumerate(text):
            while depth and stop[depth] != char:
                depth = borders[depth - 1]
            depth += stop[depth] == char
            if depth == end:
                return offset + at + 1 - end, stop
        self._depths[i] = depth
        return None

    def release(self) -> str:
        """The held-back tail, given up as no longer text (a call began in it); stops are followed afresh after."""
        out, self.held = self.held, ""
        self._depths = [0] * len(self.stops)
        return out

    def flush(self) -> str:
        """The held-back tail, when the stream ends without a match."""
        out, self.held = self.held, ""
        return out if self.matched is None else ""


def _grown(stop: str, borders: list[int], upto: int) -> None:
    """KMP's failure table of ``stop`` (for each prefix, its longest proper prefix that is also its suffix)
    grown to ``upto`` prefixes: as far as a match can reach, not the whole stop at once (64 stops of 10,000
    characters cost 0.15 s of the thread that streams every answer's events, for each request that sent them)."""
    depth = borders[-1]
    for at in range(len(borders), upto):
        while depth and stop[depth] != stop[at]:
            depth = borders[depth - 1]
        depth += stop[depth] == stop[at]
        borders.append(depth)


def overlap(text: str, stop: str) -> int:
    """Longest suffix of ``text`` that is a proper prefix of ``stop``: tried only where ``stop``'s first
    character is (a long stop string costs a search, not a comparison per length)."""
    at = max(0, len(text) - len(stop) + 1)
    while (at := text.find(stop[0], at)) != -1:
        if stop.startswith(text[at:]):
            return len(text) - at
        at += 1
    return 0
