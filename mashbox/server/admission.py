"""Admission: how many requests may wait for a slot, per tenant and in all.

A request takes a ``Ticket`` when it arrives and waits until it gets a slot;
the HTTP layer marks that with ``Ticket.running()`` when the engine gives it
one, and ``Ticket.done()`` when it ends either way. Requests that arrive
together are on their way to the free slots, not waiting for one: of the
tickets not yet running, as many as the slots free (``slots`` less those
running) are not counted. A tenant with ``max_per_tenant`` waiting beyond
them, or a server with ``max_total``, is refused with ``QueueFull`` (429, or
Anthropic's 529 for a full server).

Retry-After: about how long admitted requests recently waited for a slot (a
moving average of admit -> running), never under ``retry_after``, at most 60 s.
It needs no model of the slots: a queue that drains fast says so.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

Scope = Literal["tenant", "server"]
MAX_RETRY_AFTER = 60
_SMOOTHING = 0.2  # weight of the newest wait in the moving average


class QueueFull(Exception):
    """Too many waiting: ``scope`` says whose allowance is spent."""

    def __init__(self, scope: Scope, retry_after: int, limit: int) -> None:
        self.scope = scope
        self.retry_after = retry_after
        self.limit = limit
        super().__init__(self.message)

    @property
    def message(self) -> str:
        if self.scope == "tenant":
            return f"too many requests are waiting for a slot: {self.limit} of yours; retry after {self.retry_after} s"
        return f"the server's queue is full ({self.limit} waiting); retry after {self.retry_after} s"


class Admission:
    """Counts of waiting requests by tenant, behind one lock."""

    def __init__(
        self,
        max_per_tenant: int = 32,
        max_total: int = 256,
        retry_after: int = 1,
        clock: Callable[[], float] = time.monotonic,
        slots: Callable[[], int] = lambda: 0,
    ) -> None:
        if min(max_per_tenant, max_total, retry_after) < 1:
            raise ValueError("admission limits and retry_after must be >= 1")
        self.max_per_tenant = max_per_tenant
        self.max_total = max_total
        self.retry_after = retry_after
        self._clock, self._slots = clock, slots
        self._lock = threading.Lock()
        self._waiting: Counter[str] = Counter()
        self._total = 0
        self._running = 0  # tickets with a slot, not yet done
        self._wait_s = 0.0

    def admit(self, tenant: str) -> Ticket:
        """A ticket for one more waiting request of ``tenant``; raises ``QueueFull``."""
        free = self._slots()
        with self._lock:
            free = max(0, free - self._running)
            if self._waiting[tenant] >= self.max_per_tenant + free:
                raise QueueFull("tenant", self._retry_after(), self.max_per_tenant)
            if self._total >= self.max_total + free:
                raise QueueFull("server", self._retry_after(), self.max_total)
            self._waiting[tenant] += 1
            self._total += 1
        return Ticket(self, tenant, self._clock())

    @property
    def waiting(self) -> int:
        return self._total

    def waiting_for(self, tenant: str) -> int:
        return self._waiting[tenant]

    @property
    def retry_after_s(self) -> int:
        """The Retry-After seconds a refusal would carry now."""
        with self._lock:
            return self._retry_after()

    def _retry_after(self) -> int:
        return max(self.retry_after, min(MAX_RETRY_AFTER, math.ceil(self._wait_s)))

    def _leave(self, ticket: Ticket, got_slot: bool) -> None:
        with self._lock:
            if ticket._running and not got_slot:  # done after it ran
                ticket._running = False
                self._running -= 1
            if not ticket._waiting:
                return
            ticket._waiting = False
            if got_slot:
                ticket._running = True
                self._running += 1
            self._total -= 1
            self._waiting[ticket.tenant] -= 1
            if self._waiting[ticket.tenant] <= 0:
                del self._waiting[ticket.tenant]
            if got_slot:
                waited = max(0.0, self._clock() - ticket.since)
                self._wait_s += _SMOOTHING * (waited - self._wait_s)


class Ticket:
    """One admitted request: waiting until ``running()`` or ``done()``."""

    __slots__ = ("_admission", "_running", "_waiting", "since", "tenant")

    def __init__(self, admission: Admission, tenant: str, since: float) -> None:
        self._admission = admission
        self._waiting, self._running = True, False
        self.tenant = tenant
        self.since = since

    @property
    def waiting(self) -> bool:
        return self._waiting

    def running(self) -> None:
        """It got a slot (its first output): no longer waiting. Idempotent."""
        self._admission._leave(self, got_slot=True)

    def done(self) -> None:
        """It ended (answered, failed or cancelled). Idempotent."""
        self._admission._leave(self, got_slot=False)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()


def combined_waiting(admitted: int, engine_waiting: int) -> int:
    """Requests waiting for a slot, for health and metrics.

    Admitted tickets already include the engine's own queue (a ticket waits
    until its first output), so the two are not added: the larger one is
    right whether or not requests go through admission (the library API
    does not).
    """
    return max(admitted, engine_waiting)
