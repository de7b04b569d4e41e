"""Admission: per-tenant and total waiting limits, release, Retry-After."""

from __future__ import annotations

import threading

import pytest

from mashbox.server.admission import MAX_RETRY_AFTER, Admission, QueueFull, combined_waiting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tenant_limit_refuses_that_tenant_only():
    admission = Admission(max_per_tenant=2, max_total=10)
    tickets = [admission.admit("a"), admission.admit("a")]
    with pytest.raises(QueueFull) as info:
        admission.admit("a")
    assert info.value.scope == "tenant" and info.value.retry_after >= 1
    assert "2 of yours" in str(info.value)
    admission.admit("b")
    assert admission.waiting == 3 and admission.waiting_for("a") == 2 and admission.waiting_for("b") == 1
    tickets[0].running()
    admission.admit("a")  # a slot of a's allowance came free


def test_requests_on_their_way_to_free_slots_are_not_waiting_for_one():
    """4 slots, 2 waiting a tenant: 4 requests at once all go in (2 of them were refused when each
    counted as waiting until the engine gave it its slot), and 2 more wait; a request that ends frees
    its slot for the next."""
    admission = Admission(max_per_tenant=2, max_total=3, slots=lambda: 4)
    together = [admission.admit("a") for _ in range(6)]
    with pytest.raises(QueueFull, match="2 of yours"):
        admission.admit("a")
    for ticket in together[:4]:
        ticket.running()
    with pytest.raises(QueueFull):  # the slots taken, 2 wait: the tenant's allowance
        admission.admit("a")
    admission.admit("b")  # the server's allowance: 3
    with pytest.raises(QueueFull) as info:
        admission.admit("c")
    assert info.value.scope == "server"
    together[0].done()
    admission.admit("c")  # its slot came free
    together[1].done()
    together[1].done()  # once only
    admission.admit("c")
    with pytest.raises(QueueFull):
        admission.admit("c")


def test_total_limit_refuses_everyone():
    admission = Admission(max_per_tenant=2, max_total=3)
    tickets = [admission.admit(t) for t in ("a", "a", "b")]
    with pytest.raises(QueueFull) as info:
        admission.admit("c")
    assert info.value.scope == "server" and info.value.limit == 3
    tickets[2].done()
    admission.admit("c")


def test_without_keys_one_tenant_gets_32():
    admission = Admission()
    for _ in range(32):
        admission.admit("default")
    with pytest.raises(QueueFull, match="32 of yours") as info:
        admission.admit("default")
    assert info.value.scope == "tenant"


def test_running_and_done_are_idempotent():
    admission = Admission()
    ticket = admission.admit("a")
    ticket.running()
    ticket.running()
    ticket.done()
    ticket.done()
    assert admission.waiting == 0 and admission.waiting_for("a") == 0 and not ticket.waiting
    other = admission.admit("a")
    other.done()
    other.running()
    assert admission.waiting == 0


def test_ticket_as_context_manager_releases_on_error():
    admission = Admission()
    with pytest.raises(RuntimeError), admission.admit("a") as ticket:
        assert ticket.waiting and admission.waiting == 1
        raise RuntimeError("client went away")
    assert admission.waiting == 0


def test_retry_after_follows_recent_waits():
    clock = Clock()
    admission = Admission(max_per_tenant=1, retry_after=2, clock=clock)
    assert admission.retry_after_s == 2
    for _ in range(20):
        ticket = admission.admit("a")
        clock.now += 10.0
        ticket.running()
    assert 9 <= admission.retry_after_s <= 10
    admission.admit("a")
    with pytest.raises(QueueFull) as info:
        admission.admit("a")
    assert info.value.retry_after == admission.retry_after_s


def test_retry_after_is_capped_and_ignores_cancelled_waits():
    clock = Clock()
    admission = Admission(clock=clock)
    cancelled = admission.admit("a")
    clock.now += 1000
    cancelled.done()
    assert admission.retry_after_s == 1
    for _ in range(50):
        ticket = admission.admit("a")
        clock.now += 1000
        ticket.running()
    assert admission.retry_after_s == MAX_RETRY_AFTER


def test_thread_safe_counts():
    admission = Admission(max_per_tenant=10_000, max_total=10_000)

    def work() -> None:
        for _ in range(500):
            ticket = admission.admit("a")
            ticket.running()
            ticket.done()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admission.waiting == 0 and admission.waiting_for("a") == 0


def test_bad_limits():
    with pytest.raises(ValueError):
        Admission(max_per_tenant=0)


def test_combined_waiting_does_not_double_count():
    assert combined_waiting(5, 3) == 5  # the engine's 3 are among the 5 admitted
    assert combined_waiting(0, 2) == 2  # requests that bypass admission
