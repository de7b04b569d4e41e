"""What the protocol translator tests share: a one-line user turn, engine timings, and a run of
engine events through a translator (start, feed each event, dump every object it emits)."""

from __future__ import annotations

from collections.abc import Iterable

from mashbox.engine.events import Event, Timings

USER = [{"role": "user", "content": "hi"}]
TIMINGS = Timings(prompt_n=7, prompt_ms=14.0, predicted_n=5, predicted_ms=20.0, cache_n=3, queue_ms=0.5)


def translate(translator, events: Iterable[Event]) -> list[dict]:
    """The dumps of everything ``translator`` emits for ``events``, starting with ``start()``."""
    out = translator.start()
    for event in events:
        out += translator.feed(event)
    return [o.dump() for o in out]
