"""The status a request ends with once every attempt failed."""

import grpc

from common.basics.errors import RETRY_AFTER_MS
from common.request.forwarding import Attempts, Failover


def failover(child: str, code: grpc.StatusCode, retry_ms: str | None = None) -> Failover:
    trailers = ((RETRY_AFTER_MS, retry_ms),) if retry_ms else ()
    return Failover(child, code, "busy", trailers)


def test_every_child_shedding_is_resource_exhausted_with_the_soonest_retry() -> None:
    attempts = Attempts(
        failures=[
            failover("eu-west", grpc.StatusCode.RESOURCE_EXHAUSTED, "800"),
            failover("us-east", grpc.StatusCode.RESOURCE_EXHAUSTED, "300"),
        ]
    )
    err = attempts.error("region", "demo-llm")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.trailers)[RETRY_AFTER_MS] == "300"
    assert "eu-west" in err.message and "us-east" in err.message


def test_any_unreachable_child_makes_it_unavailable() -> None:
    attempts = Attempts(
        failures=[
            failover("eu-west", grpc.StatusCode.RESOURCE_EXHAUSTED, "800"),
            failover("us-east", grpc.StatusCode.UNAVAILABLE),
        ]
    )
    err = attempts.error("region", "demo-llm")
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "demo-llm" in err.message
