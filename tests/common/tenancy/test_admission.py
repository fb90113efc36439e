"""common.tenancy.admission: identity, rate limits and caps, usage records — against the
real embedded Redis."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import redis

from common.basics.errors import RETRY_AFTER_MS, TENANT_QUOTA, RouteError
from common.basics.redis_embed import EmbeddedRedis
from common.basics.vocabulary import Priority
from common.config.access import AuthConfig, TenantConfig
from common.request.call import CallRecord
from common.request.pick import PickRequest
from common.request.routing import TENANT, RouteHints, parse_hints
from common.tenancy.admission import Admission, edge_admission, inner_admission
from common.tenancy.auth import hash_key
from common.tenancy.usage import USAGE_STREAM, UsageRecord

EdgeFactory = Callable[..., Admission]


def tenant(**limits: float | int) -> TenantConfig:
    """A tenant with a fresh id (the rate limits' Redis keys are per tenant) and key."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    return TenantConfig(id=name, key_hashes=frozenset({hash_key(f"mk_{name}")}), **limits)  # type: ignore[arg-type]


def key_of(who: TenantConfig) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer mk_{who.id}")]


def edge_hints(metadata: list[tuple[str, str]]) -> RouteHints:
    return parse_hints(metadata, trust_internal=False)


def inner_hints(tenant_id: str) -> RouteHints:
    return parse_hints([(TENANT, tenant_id)], trust_internal=True)


def pick(prompt_tokens: int = 1, max_tokens: int = 1) -> PickRequest:
    return PickRequest(
        model="demo-llm",
        version="",
        origin=None,
        session=None,
        priority=Priority.STANDARD,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
    )


@pytest.fixture
async def edges(redis_server: EmbeddedRedis) -> AsyncIterator[EdgeFactory]:
    """Started edge admissions on the shared Redis; all stopped (flushed, closed) at the end."""
    made: list[Admission] = []

    def make(*tenants: TenantConfig, enabled: bool = True) -> Admission:
        admission = edge_admission(AuthConfig(enabled=enabled, tenants=tenants), redis_server.url)
        made.append(admission)
        return admission

    try:
        yield make
    finally:
        for admission in made:
            await admission.stop()


async def refusal(admission: Admission, hints: RouteHints, request: PickRequest) -> RouteError:
    with pytest.raises(RouteError) as info:
        await admission.admit(hints, request)
    return info.value


# ------------------------------------------------------------------ wiring


async def test_edge_without_limits_has_no_limiter(edges: EdgeFactory) -> None:
    admission = edges(tenant())
    assert admission.authenticator is not None
    assert admission.limiter is None
    assert admission.usage is not None
    assert admission.concurrency is None


async def test_edge_with_a_capped_tenant_holds_the_cap(edges: EdgeFactory) -> None:
    admission = edges(tenant(max_concurrent=2))
    assert admission.concurrency is not None
    assert admission.limiter is None


async def test_edge_with_auth_off_has_no_authenticator(edges: EdgeFactory) -> None:
    admission = edges(enabled=False)
    assert admission.authenticator is None


def test_inner_tiers_count_no_quota() -> None:
    """The edge holds every quota for the fleet: an inner tier's refusal would only be
    failed over to another region."""
    admission = inner_admission(AuthConfig(enabled=True, tenants=(tenant(max_concurrent=1),)))
    assert admission.concurrency is None
    assert admission.authenticator is None
    assert admission.limiter is None
    assert admission.usage is None


# ------------------------------------------------------------------ identify


async def test_identify_sets_the_tenant(edges: EdgeFactory) -> None:
    who = tenant()
    admission = edges(who)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    assert hints.tenant == who.id
    assert admission.tenant(hints.tenant) is who


async def test_identify_unknown_key_is_unauthenticated(edges: EdgeFactory) -> None:
    admission = edges(tenant())
    metadata = [("authorization", "Bearer mk_nobody")]
    with pytest.raises(RouteError) as info:
        admission.identify(metadata, edge_hints(metadata))
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "not recognised" in info.value.message


async def test_identify_missing_key_is_unauthenticated(edges: EdgeFactory) -> None:
    admission = edges(tenant())
    with pytest.raises(RouteError) as info:
        admission.identify([], edge_hints([]))
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_identify_priority_above_ceiling_is_denied(edges: EdgeFactory) -> None:
    who = tenant()  # ceiling: standard
    admission = edges(who)
    metadata = [*key_of(who), ("x-meridian-priority", "critical")]
    with pytest.raises(RouteError) as info:
        admission.identify(metadata, edge_hints(metadata))
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "ceiling" in info.value.message


async def test_identify_with_auth_off_leaves_hints_as_they_are(edges: EdgeFactory) -> None:
    admission = edges(enabled=False)
    hints = edge_hints([])
    assert admission.identify([], hints) is hints
    assert admission.tenant(hints.tenant).id == "anonymous"


# ------------------------------------------------------------------ rate limits


async def test_requests_per_s_limit_refuses_past_the_burst(
    edges: EdgeFactory, redis_server: EmbeddedRedis
) -> None:
    who = tenant(requests_per_s=2)  # burst: 2 at once
    admission = edges(who)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    for _ in range(2):
        release = await admission.admit(hints, pick())
        release()
    err = await refusal(admission, hints, pick())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"'{who.id}'" in err.message
    assert "requests_per_s" in err.message
    assert int(dict(err.trailers)[RETRY_AFTER_MS]) > 0
    # Counted in the shared Redis, not in the in-process fallback.
    assert admission.limiter is not None and not admission.limiter.degraded
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert client.exists(f"meridian:quota:{{{who.id}}}:rps") == 1
    finally:
        client.close()


async def test_tokens_per_min_limit_counts_prompt_and_max_tokens(edges: EdgeFactory) -> None:
    who = tenant(tokens_per_min=60)  # burst: 10 tokens
    admission = edges(who)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    await admission.admit(hints, pick(prompt_tokens=4, max_tokens=4))
    err = await refusal(admission, hints, pick(prompt_tokens=2, max_tokens=2))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens_per_min" in err.message


async def test_request_larger_than_the_token_burst_is_invalid(edges: EdgeFactory) -> None:
    who = tenant(tokens_per_min=60)
    admission = edges(who)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    err = await refusal(admission, hints, pick(prompt_tokens=6, max_tokens=5))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "11 tokens" in err.message
    assert "max_tokens" in err.message


async def test_limits_are_per_tenant(edges: EdgeFactory) -> None:
    first, second = tenant(requests_per_s=1), tenant(requests_per_s=1)
    admission = edges(first, second)
    one = admission.identify(key_of(first), edge_hints(key_of(first)))
    two = admission.identify(key_of(second), edge_hints(key_of(second)))
    await admission.admit(one, pick())
    await admission.admit(two, pick())
    err = await refusal(admission, one, pick())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_anonymous_is_never_rate_limited(edges: EdgeFactory) -> None:
    # A limited tenant makes the edge build a limiter; with auth off no one is that tenant.
    admission = edges(tenant(requests_per_s=1), enabled=False)
    assert admission.limiter is not None
    hints = admission.identify([], edge_hints([]))
    for _ in range(20):
        release = await admission.admit(hints, pick())
        release()


# ------------------------------------------------------------------ concurrency caps


async def test_cap_refuses_past_max_concurrent_and_a_release_frees_a_slot(
    edges: EdgeFactory,
) -> None:
    who = tenant(max_concurrent=2)
    admission = edges(who)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    first = await admission.admit(hints, pick())
    await admission.admit(hints, pick())
    err = await refusal(admission, hints, pick())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent" in err.message
    assert dict(err.trailers) == {RETRY_AFTER_MS: "100", TENANT_QUOTA: "max_concurrent"}
    first()
    assert admission.concurrency is not None and admission.concurrency.in_flight(who.id) == 1
    await admission.admit(hints, pick())
    assert admission.concurrency.in_flight(who.id) == 2


async def test_release_twice_never_frees_a_slot_it_did_not_take(edges: EdgeFactory) -> None:
    who = tenant(max_concurrent=1)
    admission = edges(who)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    assert admission.concurrency is not None
    release = await admission.admit(hints, pick())
    release()
    release()
    assert admission.concurrency.in_flight(who.id) == 0
    await admission.admit(hints, pick())
    err = await refusal(admission, hints, pick())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_uncapped_and_anonymous_callers_take_no_lease(edges: EdgeFactory) -> None:
    uncapped, capped = tenant(), tenant(max_concurrent=1)
    admission = edges(uncapped, capped)
    assert admission.concurrency is not None
    hints = admission.identify(key_of(uncapped), edge_hints(key_of(uncapped)))
    for _ in range(10):
        await admission.admit(hints, pick())
    assert admission.concurrency.in_flight(uncapped.id) == 0
    anonymous = edges(capped, enabled=False)
    for _ in range(10):
        await anonymous.admit(anonymous.identify([], edge_hints([])), pick())


async def test_a_request_over_its_rate_holds_no_lease(edges: EdgeFactory) -> None:
    who = tenant(max_concurrent=5, requests_per_s=1)
    admission = edges(who)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    await admission.admit(hints, pick())
    for _ in range(3):
        err = await refusal(admission, hints, pick())
        assert "requests_per_s" in err.message
    assert admission.concurrency is not None and admission.concurrency.in_flight(who.id) == 1


async def test_a_request_over_its_cap_takes_nothing_from_its_rate(edges: EdgeFactory) -> None:
    who = tenant(max_concurrent=1, requests_per_s=2)  # burst: 2 requests
    admission = edges(who)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    release = await admission.admit(hints, pick())
    for _ in range(5):
        err = await refusal(admission, hints, pick())
        assert "max_concurrent" in err.message
    release()
    await admission.admit(hints, pick())  # the second of the burst: refusals took none


# ------------------------------------------------------------------ usage records


def records_with(redis_server: EmbeddedRedis, trace_id: str) -> list[UsageRecord]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(USAGE_STREAM)  # type: ignore[assignment]
    finally:
        client.close()
    found = [UsageRecord.from_fields(fields) for _, fields in entries]
    return [r for r in found if r.trace_id == trace_id]


def end_call(
    admission: Admission,
    hints: RouteHints | None,
    pick_made: PickRequest | None,
    model: str,
    route: str,
    code: grpc.StatusCode,
    started: float,
    *,
    completion_tokens: int,
    trace_id: str,
) -> None:
    """Tell ``admission`` (as the call interceptor would) that a call ended; the trace id
    travels as the caller's ``traceparent``."""
    if hints is not None:
        parent = ("traceparent", f"00-{trace_id}-{'0' * 15}1-01")
        hints = dataclasses.replace(hints, passed_down=(*hints.passed_down, parent))
    call = CallRecord("ModelInfer", (), started, hints=hints, model=model, route=route)
    call.prompt_tokens = pick_made.prompt_tokens if pick_made is not None else 0
    call.completion_tokens = completion_tokens
    call.code = code
    admission.call_ended(call)


async def test_record_writes_exactly_one_usage_record(
    edges: EdgeFactory, redis_server: EmbeddedRedis
) -> None:
    who = tenant()
    admission = edges(who)
    await admission.start()
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    trace_id = uuid.uuid4().hex
    started = time.monotonic() - 0.25
    before_ms = int(time.time() * 1000)
    end_call(
        admission,
        hints,
        pick(prompt_tokens=12, max_tokens=30),
        "demo-llm",
        "eu-west/eu-west-1a/gpu-0",
        grpc.StatusCode.OK,
        started,
        completion_tokens=7,
        trace_id=trace_id,
    )
    await admission.stop()
    [rec] = records_with(redis_server, trace_id)
    assert (rec.tenant, rec.model) == (who.id, "demo-llm")
    assert (rec.region, rec.zone, rec.gpu) == ("eu-west", "eu-west-1a", "gpu-0")
    assert (rec.prompt_tokens, rec.completion_tokens) == (12, 7)
    assert rec.status == "OK"
    assert 0.25 <= rec.gpu_seconds < 5.0
    assert len(rec.request_id) == 32
    assert before_ms <= rec.finished_at_ms <= int(time.time() * 1000)


async def test_record_of_a_failure_costs_no_gpu_time_and_names_the_status(
    edges: EdgeFactory, redis_server: EmbeddedRedis
) -> None:
    admission = edges(enabled=False)
    await admission.start()
    trace_id = uuid.uuid4().hex
    end_call(
        admission,
        edge_hints([]),
        None,  # refused before a pick was made
        "demo-llm",
        "",
        grpc.StatusCode.UNAVAILABLE,
        time.monotonic() - 1.0,
        completion_tokens=0,
        trace_id=trace_id,
    )
    await admission.stop()
    [rec] = records_with(redis_server, trace_id)
    assert rec.tenant == "anonymous"
    assert rec.status == "UNAVAILABLE"
    assert rec.gpu_seconds == 0.0
    assert rec.prompt_tokens == 0
    assert (rec.region, rec.zone, rec.gpu) == ("", "", "")


async def test_record_of_a_partial_route(edges: EdgeFactory, redis_server: EmbeddedRedis) -> None:
    admission = edges(enabled=False)
    await admission.start()
    trace_id = uuid.uuid4().hex
    end_call(
        admission,
        edge_hints([]), pick(), "demo-llm", "us-east", grpc.StatusCode.DEADLINE_EXCEEDED,
        time.monotonic(), completion_tokens=0, trace_id=trace_id,
    )  # fmt: skip
    await admission.stop()
    [rec] = records_with(redis_server, trace_id)
    assert (rec.region, rec.zone, rec.gpu) == ("us-east", "", "")
    assert rec.status == "DEADLINE_EXCEEDED"


async def test_inner_tiers_record_nothing(redis_server: EmbeddedRedis) -> None:
    admission = inner_admission(AuthConfig())
    await admission.start()
    trace_id = uuid.uuid4().hex
    end_call(
        admission,
        inner_hints("acme"), pick(), "demo-llm", "eu-west", grpc.StatusCode.OK,
        time.monotonic(), completion_tokens=1, trace_id=trace_id,
    )  # fmt: skip
    await admission.stop()
    assert records_with(redis_server, trace_id) == []
