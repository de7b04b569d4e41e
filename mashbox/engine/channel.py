"""A one-way queue of events from the engine thread to one reader, which may
be plain code (``get``) or a coroutine on any event loop (``aget``)."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Channel(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._ready = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def put(self, item: T) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()
            loop, event = self._loop, self._event
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

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
