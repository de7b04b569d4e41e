"""Stop strings as a text state machine: text ends before the first match,
and a partial match at the end is held back, never half-emitted."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Feed new text; return what can be emitted now."""
        if self.matched is not None:
            return ""
        buf = self.held + text
        hit = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if hit is not None:
            self.matched, self.held = hit[1], ""
            return buf[: hit[0]]
        keep = max((overlap(buf, s) for s in self.stops), default=0)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail, when the stream ends without a match."""
        out, self.held = self.held, ""
        return out if self.matched is None else ""


def overlap(text: str, stop: str) -> int:
    """Longest suffix of ``text`` that is a proper prefix of ``stop``: tried only where ``stop``'s first
    character is (a long stop string costs a search, not a comparison per length)."""
    at = max(0, len(text) - len(stop) + 1)
    while (at := text.find(stop[0], at)) != -1:
        if stop.startswith(text[at:]):
            return len(text) - at
        at += 1
    return 0
