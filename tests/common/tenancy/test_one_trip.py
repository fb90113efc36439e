"""The edge admits a request to its tenant's cap and rate limits in one Redis script.

``edge_admission`` over a Redis of the test's own (its command counts are the
test's alone): ``ADMIT`` takes the lease and steps the rates together, all or
nothing, and falls back to counting both in process while Redis is down.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import redis

from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.access import AuthConfig, TenantConfig
from common.request.routing import RouteHints
from common.tenancy.admission import Admission, edge_admission
from common.tenancy.quota_scripts import ADMIT, GCRA, SETTLE, SYNC
from tests.common.tenancy.test_admission import edge_hints, key_of, pick, refusal, tenant

Edge = Callable[[TenantConfig], tuple[Admission, RouteHints]]


@pytest.fixture
async def edge(own_redis: EmbeddedRedis) -> AsyncIterator[Edge]:
    made: list[Admission] = []

    def make(who: TenantConfig) -> tuple[Admission, RouteHints]:
        admission = edge_admission(AuthConfig(enabled=True, tenants=(who,)), own_redis.url)
        made.append(admission)
        return admission, admission.identify(key_of(who), edge_hints(key_of(who)))

    try:
        yield make
    finally:
        for admission in made:
            await admission.stop()


def commands_run(url: str, *commands: str) -> dict[str, int]:
    """Calls of each command the server has answered so far."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {cmd: int(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0)) for cmd in commands}


def scripts_run(url: str) -> int:
    """EVALSHA and EVAL calls the server has answered so far."""
    return sum(commands_run(url, "evalsha", "eval").values())


def in_redis(url: str, *commands: tuple[str, ...]) -> list[object]:
    client = redis.Redis.from_url(url)
    try:
        return [client.execute_command(*command) for command in commands]
    finally:
        client.close()


async def test_a_request_under_both_quotas_costs_one_script(
    edge: Edge, own_redis: EmbeddedRedis
) -> None:
    who = tenant(max_concurrent=50, requests_per_s=1000, tokens_per_min=1_000_000)
    admission, hints = edge(who)
    in_redis(own_redis.url, ("SCRIPT", "LOAD", ADMIT.text))  # no NOSCRIPT round trip
    before = scripts_run(own_redis.url)
    for _ in range(10):  # held, not released: the lease keeper has nothing to send
        await admission.admit(hints, pick())
    assert scripts_run(own_redis.url) - before == 10
    assert admission.concurrency is not None and admission.concurrency.in_flight(who.id) == 10


async def test_a_started_edge_has_its_scripts_in_redis_before_the_first_request(
    edge: Edge, own_redis: EmbeddedRedis
) -> None:
    who = tenant(max_concurrent=50, requests_per_s=1000)
    admission, hints = edge(who)
    in_redis(own_redis.url, ("SCRIPT", "FLUSH"))
    await admission.start()
    shas = [script.sha for script in (ADMIT, GCRA, SETTLE, SYNC)]
    assert in_redis(own_redis.url, ("SCRIPT", "EXISTS", *shas)) == [[1, 1, 1, 1]]
    before = commands_run(own_redis.url, "evalsha", "eval")
    await admission.admit(hints, pick())
    after = commands_run(own_redis.url, "evalsha", "eval")
    # One EVALSHA, answered: no NOSCRIPT and EVAL on the request's time.
    assert (after["evalsha"] - before["evalsha"], after["eval"] - before["eval"]) == (1, 0)


async def test_an_edge_starts_while_redis_is_down_and_its_first_request_finds_it_down() -> None:
    port = free_port("127.0.0.1")
    who = tenant(requests_per_s=1000)
    url = f"redis://127.0.0.1:{port}/0"
    admission = edge_admission(AuthConfig(enabled=True, tenants=(who,)), url)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    try:
        await admission.start()  # nothing listens: starts all the same, not marked down
        assert admission.shared is not None and not admission.shared.degraded
        await admission.admit(hints, pick())  # admitted in process: Redis is found down
        assert admission.shared.degraded and admission.shared.outages == 1
    finally:
        await admission.stop()


async def test_a_request_over_its_rate_never_puts_a_lease_in_redis(
    edge: Edge, own_redis: EmbeddedRedis
) -> None:
    who = tenant(max_concurrent=5, requests_per_s=1)  # burst: 1 request
    admission, hints = edge(who)
    await admission.admit(hints, pick())
    assert admission.concurrency is not None
    leases = ("ZCARD", admission.concurrency.key(who.id))
    for _ in range(3):
        err = await refusal(admission, hints, pick())
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "requests_per_s" in err.message and "max_concurrent" not in err.message
        assert in_redis(own_redis.url, leases) == [1]  # not added and given back: never added
    assert admission.concurrency.in_flight(who.id) == 1


async def test_a_request_over_its_cap_steps_no_rate_in_redis(
    edge: Edge, own_redis: EmbeddedRedis
) -> None:
    who = tenant(max_concurrent=1, requests_per_s=0.5, tokens_per_min=60)  # TATs 2 s ahead
    admission, hints = edge(who)
    await admission.admit(hints, pick())
    assert admission.limiter is not None
    tats = [("GET", f"{admission.limiter.key_prefix}:{{{who.id}}}:{k}") for k in ("rps", "tpm")]
    stored = in_redis(own_redis.url, *tats)
    assert all(stored)
    for _ in range(3):
        err = await refusal(admission, hints, pick())
        assert "max_concurrent" in err.message
    assert in_redis(own_redis.url, *tats) == stored


async def test_a_request_too_large_for_its_token_burst_is_refused_before_any_lease(
    edge: Edge, own_redis: EmbeddedRedis
) -> None:
    who = tenant(max_concurrent=1, tokens_per_min=60)  # burst: 10 tokens
    admission, hints = edge(who)
    before = scripts_run(own_redis.url)
    err = await refusal(admission, hints, pick(prompt_tokens=8, max_tokens=8))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert scripts_run(own_redis.url) == before
    assert admission.concurrency is not None and admission.concurrency.in_flight(who.id) == 0


async def test_redis_down_counts_cap_and_rates_in_process_and_puts_the_leases_back(
    edge: Edge, own_redis: EmbeddedRedis
) -> None:
    who = tenant(max_concurrent=3, requests_per_s=2)  # one replica: all of both in process
    admission, hints = edge(who)
    assert admission.concurrency is not None and admission.limiter is not None
    own_redis.stop()
    held = [await admission.admit(hints, pick()), await admission.admit(hints, pick())]
    assert admission.limiter.degraded and admission.concurrency.degraded  # one client, one state
    err = await refusal(admission, hints, pick())  # the rate's burst is spent, not the cap
    assert "requests_per_s" in err.message
    assert admission.concurrency.in_flight(who.id) == 2
    own_redis.start()  # empty
    await asyncio.sleep(1.2)  # past the back-off (0.5 s) and a rate interval (0.5 s)
    await admission.admit(hints, pick())  # its first call puts the two leases back first
    leases = ("ZCARD", admission.concurrency.key(who.id))
    assert in_redis(own_redis.url, leases) == [3]
    err = await refusal(admission, hints, pick())
    assert "max_concurrent" in err.message
    for release in held:
        release()
