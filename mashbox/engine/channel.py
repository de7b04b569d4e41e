"""A one-way queue of events from the engine thread to one reader, which may
be plain code (``get``) or a coroutine on any event loop (``aget``).

``hold`` queues an item without waking an async reader; ``wake_all`` then wakes
the readers of many channels with one call per event loop, so that the streams
of one engine step all run on their loop before it does anything else."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict, deque
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Channel(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._ready = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def put(self, item: T) -> None:
        self.hold(item)
        self.wake_all([self])

    def hold(self, item: T) -> None:
        """Queue ``item`` for the reader; an async reader sees it once woken (``wake_all``)."""
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    @staticmethod
    def wake_all(channels: Iterable[Channel]) -> None:
        """Wake the async readers of ``channels``: one call into each event loop for all of its readers."""
        events: defaultdict[asyncio.AbstractEventLoop, list[asyncio.Event]] = defaultdict(list)
        for channel in channels:
            with channel._ready:
                loop, event = channel._loop, channel._event
            if loop is not None and event is not None and not loop.is_closed():
                events[loop].append(event)
        for loop, waiting in events.items():
            try:
                loop.call_soon_threadsafe(_set_all, waiting)
            except RuntimeError:  # the loop closed since
                pass

    def get(self, timeout: float | None = None) -> T:
        with self._ready:
            if not self._ready.wait_for(lambda: self._items, timeout):
                raise TimeoutError("no event in time")
            return self._items.popleft()

    async def aget(self) -> T:
        if self._event is None:
            self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        while True:
            with self._ready:
                if self._items:
                    return self._items.popleft()
                self._event.clear()
            await self._event.wait()


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
