"""Tenants end to end: keys, rights, quotas, residency, usage records, forged metadata."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from cli.launcher import Fleet
from common.basics.errors import RETRY_AFTER_MS
from common.gen.inference import grpc_service_pb2 as pb
from common.tenancy.usage import summarise
from tests.client import V2Client, expect_code, region_of
from tests.conftest import small_fleet_spec

SINGAPORE = ("x-meridian-client-geo", "1.35,103.82")


def tenants_spec() -> dict[str, Any]:
    spec = small_fleet_spec(regions=3, zones=1, gpus=1)
    spec["auth"] = {
        "enabled": True,
        "tenants": [
            {"id": "gold", "api_key": "generate", "priority_ceiling": "critical"},
            {
                "id": "free",
                "api_key": "generate",
                "priority_ceiling": "sheddable",
                "requests_per_s": 2,
                "allowed_regions": ["us-east", "eu-west"],
            },
            {"id": "narrow", "api_key": "generate", "max_concurrent": 2},
        ],
    }
    return spec


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.conftest import start_fleet

    fleet = start_fleet(tmp_path_factory.mktemp("tenants"), tenants_spec())
    try:
        yield fleet
    finally:
        fleet.stop()


def bearer(fleet: Fleet, tenant: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {fleet.tenant_keys[tenant]}")


def test_missing_and_wrong_keys_are_unauthenticated(fleet: Fleet) -> None:
    with V2Client(fleet.global_address) as client:
        err = expect_code(grpc.StatusCode.UNAUTHENTICATED, client.infer)
        assert "authorization" in err.details()
        expect_code(
            grpc.StatusCode.UNAUTHENTICATED,
            client.infer,
            metadata=[("authorization", "Bearer mk_not-a-key")],
        )
        expect_code(
            grpc.StatusCode.UNAUTHENTICATED, client.infer, metadata=[("authorization", "Basic abc")]
        )
        assert client.infer(metadata=[bearer(fleet, "gold")]).text


def test_priority_above_the_ceiling_is_permission_denied(fleet: Fleet) -> None:
    with V2Client(fleet.global_address) as client:
        err = expect_code(
            grpc.StatusCode.PERMISSION_DENIED,
            client.infer,
            metadata=[bearer(fleet, "free"), ("x-meridian-priority", "critical")],
        )
        assert "sheddable" in err.details()
        assert client.infer(
            metadata=[bearer(fleet, "gold"), ("x-meridian-priority", "critical")]
        ).text


def test_region_outside_the_allowed_ones_is_permission_denied(fleet: Fleet) -> None:
    with V2Client(fleet.global_address) as client:
        err = expect_code(
            grpc.StatusCode.PERMISSION_DENIED,
            client.infer,
            metadata=[bearer(fleet, "free"), ("x-meridian-client-region", "ap-southeast")],
        )
        assert "us-east" in err.details()


def test_data_residency_holds_for_a_client_near_a_forbidden_region(fleet: Fleet) -> None:
    with V2Client(fleet.global_address) as client:
        gold = client.infer(metadata=[bearer(fleet, "gold"), SINGAPORE])
        assert region_of(gold.route) == "ap-southeast"
        free = client.infer(metadata=[bearer(fleet, "free"), SINGAPORE])
        assert region_of(free.route) in {"us-east", "eu-west"}


def test_rate_limit_is_resource_exhausted_with_retry_after(fleet: Fleet) -> None:
    with V2Client(fleet.global_address) as client:
        errors = []
        for _ in range(8):
            try:
                client.infer(metadata=[bearer(fleet, "free")])
            except grpc.RpcError as err:
                errors.append(err)
        assert errors, "the request-rate limit never applied"
        err = errors[0]
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "free" in err.details() and "requests_per_s" in err.details()
        retry = dict(err.trailing_metadata())[RETRY_AFTER_MS]
        assert 0 < int(retry) <= 1000


def test_forged_internal_metadata_is_ignored(fleet: Fleet) -> None:
    """A free-tier client claiming to be gold via internal metadata stays free-tier."""
    with V2Client(fleet.global_address) as client:
        forged = [bearer(fleet, "free"), ("x-meridian-tenant", "gold"), SINGAPORE]
        reply = None
        for _ in range(3):
            try:
                reply = client.infer(metadata=forged)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                asyncio.run(asyncio.sleep(0.6))
        assert reply is not None and region_of(reply.route) in {"us-east", "eu-west"}


def test_concurrency_cap_per_tenant(fleet: Fleet) -> None:
    meta = [bearer(fleet, "narrow")]

    def long_call(_: int) -> grpc.StatusCode:
        with V2Client(fleet.global_address) as client:
            try:
                client.infer("long", 400, metadata=meta, timeout=30)
                return grpc.StatusCode.OK
            except grpc.RpcError as err:
                return err.code()

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(long_call, range(8)))
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert grpc.StatusCode.OK in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_usage_records_reconcile_with_what_was_served(fleet_factory: Callable[..., Fleet]) -> None:
    spec = tenants_spec()
    fleet = fleet_factory(spec)
    ok, bad = 7, 3
    with V2Client(fleet.global_address) as client:
        for i in range(ok):
            client.infer(f"prompt number {i}", 5, metadata=[bearer(fleet, "gold")])
        for _ in range(bad):
            expect_code(
                grpc.StatusCode.INVALID_ARGUMENT,
                client.infer,
                request=pb.ModelInferRequest(model_name="demo-llm"),
                metadata=[bearer(fleet, "gold")],
            )

    async def totals() -> Any:
        for _ in range(50):
            result = await summarise(fleet.topology.redis_url, since_ms=None, until_ms=None)
            got = result.get(("gold", "demo-llm"))
            if got is not None and got.requests >= ok + bad:
                return result
            await asyncio.sleep(0.1)
        return await summarise(fleet.topology.redis_url, since_ms=None, until_ms=None)

    result = asyncio.run(totals())
    gold = result[("gold", "demo-llm")]
    assert gold.requests == ok + bad
    assert gold.ok_requests == ok
    assert gold.completion_tokens == ok * 5
    assert gold.prompt_tokens == sum(len(f"prompt number {i}".split()) for i in range(ok))
    assert gold.statuses == {"OK": ok, "INVALID_ARGUMENT": bad}
