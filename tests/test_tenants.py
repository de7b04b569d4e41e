"""Keys and tenants over real HTTP: each tenant may have 32 requests waiting for a slot, the server
256 in all; a request that holds a slot no longer waits, even before its first token; keys go in
``Authorization: Bearer`` or ``x-api-key`` and nowhere else."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from server import Running, _running

from mashbox import Engine
from mashbox.server.security import parse_keys
from mashbox.server.settings import Settings

TENANTS = [f"t{i}" for i in range(9)]
KEYS = "\n".join(f"key-{name} {name}" for name in TENANTS) + "\nkey-loner\n"
LONG = {"messages": [{"role": "user", "content": "Go on and on."}], "max_tokens": 1500, "stream": True}


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir) -> Iterator[Running]:
    """One slot, so every request but the first waits; keys for nine named tenants and one alone."""
    with Engine(str(tiny_model_dir), ctx=2048, slots=1, allow_long_context=True, quiet=True) as engine:
        yield from _running(engine, Settings(api_keys=parse_keys(KEYS)))


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer key-{tenant}"}


async def waiting(client: httpx.AsyncClient) -> int:
    return (await client.get("/health")).json()["waiting"]


async def until_waiting(client: httpx.AsyncClient, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (now := await waiting(client)) != n:
        assert time.monotonic() < deadline, f"{now} waiting, not {n}"
        await asyncio.sleep(0.05)


async def hold(client: httpx.AsyncClient, tenant: str) -> None:
    """A long streamed request, held open until cancelled."""
    async with client.stream("POST", "/v1/chat/completions", json=LONG, headers=auth(tenant)) as response:
        async for _ in response.aiter_bytes():
            pass


async def flood(client: httpx.AsyncClient, per_tenant: dict[str, int]) -> list[asyncio.Task]:
    tasks = []
    for tenant, n in per_tenant.items():
        tasks += [asyncio.create_task(hold(client, tenant)) for _ in range(n)]
    return tasks


async def stop(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_a_tenant_that_fills_its_32_is_refused_while_another_is_still_admitted(one_slot, caplog):
    caplog.set_level("WARNING", logger="mashbox.server")

    async def scenario():
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=120, limits=limits) as client:
            tasks = await flood(client, {"t0": 1})
            await until_waiting(client, 0)  # the first has the slot: it no longer waits, tokens or not
            tasks += await flood(client, {"t0": 32})
            try:
                await until_waiting(client, 32)
                refused = await client.post("/v1/chat/completions", json={**LONG, "stream": False}, headers=auth("t0"))
                assert refused.status_code == 429, refused.text
                assert "32 of yours" in refused.json()["error"]["message"] and int(refused.headers["retry-after"]) >= 1
                assert f"{refused.headers['x-request-id']} refused (429): " in caplog.text  # not in the log before
                metrics = (await client.get("/metrics", headers=auth("t0"))).text  # nor in /metrics
                assert re.search(r'mashbox:request_refused_total\{model_name="[^"]*",scope="tenant"\} [1-9]', metrics)
                tasks += await flood(client, {"t1": 1})  # another tenant is still admitted
                await until_waiting(client, 33)
            finally:
                await stop(tasks)

    asyncio.run(scenario())


def test_the_server_admits_256_waiting_in_all_then_refuses_everyone(one_slot):
    async def scenario():
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=120, limits=limits) as client:
            await until_waiting(client, 0)
            tasks = await flood(client, {"t0": 1})
            tasks += await flood(client, {name: 32 for name in TENANTS[:8]})  # 8 x 32 = 256 waiting
            try:
                await until_waiting(client, 256)
                for path, body, status in (
                        ("/v1/chat/completions", {**LONG, "stream": False}, 429),
                        ("/v1/messages", {"messages": LONG["messages"], "max_tokens": 5}, 529)):
                    refused = await client.post(path, json=body, headers=auth(TENANTS[8]))  # its first request
                    assert refused.status_code == status, refused.text
                    assert "queue is full" in refused.text and "x-should-retry" not in refused.headers
            finally:
                await stop(tasks)

    asyncio.run(scenario())


@pytest.mark.parametrize("headers", [
    {"api-key": "key-t0"}, {"authorization": "key-t0"}, {"authorization": "Basic key-t0"},
    {"x-api-key": "key-t0 "[:-1] + "x"}, {"authorization": "Bearer key-nobody"},
])
def test_a_key_anywhere_but_bearer_or_x_api_key_is_refused(one_slot, headers):
    response = httpx.get(f"{one_slot.url}/v1/models", headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.headers["www-authenticate"].startswith("Bearer")  # RFC 9110: a 401 names its scheme
    scraped = httpx.get(f"{one_slot.url}/metrics", headers=auth("t0")).text
    assert re.search(r'mashbox:error_answers_total\{model_name="[^"]*",status="401"\} [1-9]', scraped)


@pytest.mark.parametrize("headers", [auth("t3"), {"x-api-key": "key-t3"}, {"authorization": "Bearer key-loner"}])
def test_either_header_carries_the_key(one_slot, headers):
    assert httpx.get(f"{one_slot.url}/v1/models", headers=headers).status_code == 200


def test_a_long_prefill_that_holds_a_slot_no_longer_waits(smol_server):
    """The spec counts requests waiting for a slot: one whose prompt is being computed has one."""
    nonce = str(time.time_ns())  # first, so that no cached prefix shortens the prefill
    body = {"messages": [{"role": "user", "content": nonce + " lorem ipsum" * 300}], "max_tokens": 1}

    async def scenario():
        async with httpx.AsyncClient(base_url=smol_server.url, timeout=120) as client:
            answer = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            deadline = time.monotonic() + 60
            while (health := (await client.get("/health")).json())["live_rows"] < 1:
                assert time.monotonic() < deadline and not answer.done(), (health, answer.done() and answer.result().text[:300])
                await asyncio.sleep(0.02)
            assert not answer.done(), "the prefill should still run"
            assert health["waiting"] == 0
            assert (await answer).status_code == 200

    asyncio.run(scenario())


def test_one_tenants_prompts_never_hit_another_tenants_cached_prefix(one_slot):
    body = {"messages": [{"role": "user", "content": "shared preamble " * 60 + str(time.time_ns())}],
            "max_tokens": 1}

    def cached(tenant: str) -> int:
        answer = httpx.post(f"{one_slot.url}/v1/chat/completions", json=body, headers=auth(tenant), timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("t5") == 0
    assert cached("t6") == 0  # the same prompt, another tenant: computed again
    assert cached("t5") > 100 and cached("t6") > 100  # each tenant's own prefix is kept
